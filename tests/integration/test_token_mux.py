"""The gateway's one token reader (gateway/tokens.py) on a real Redis: many streams through one
blocking XREAD, each request's entries once and in order; a newcomer ends a read in flight; a slow
subscriber's buffer stays bounded; the same entries as the per-request reader and the decode
pod's fenced script."""
from __future__ import annotations

import asyncio


from gateway.tokens import TokenMux
from tandem_core.bus import token_stream
from tandem_core.types import GenerationRequest, TokenLogprobs

N_STREAMS = 24
N_TOKENS = 40


async def _write(r, ks, rid: str, start: int, n: int, finish: str | None = None) -> None:
    pipe = r.pipeline(transaction=False)
    token_stream.add_tokens(pipe, ks, rid, start, list(range(100 + start, 100 + start + n)), finish, 60, 1000)
    await pipe.execute()


async def _drain(sub, want: int, timeout_s: float = 20.0) -> list[token_stream.TokenEvent]:
    got: list[token_stream.TokenEvent] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while len(got) < want and loop.time() < end:
        got += await sub.get(0.5)
    return got


async def test_many_streams_one_reader_in_order(any_redis, any_keys):
    ks = any_keys
    mux = TokenMux(any_redis, ks, block_ms=200)
    mux.start()
    try:
        rids = [f"mux-{i}" for i in range(N_STREAMS)]
        subs = [mux.subscribe(rid) for rid in rids]

        async def writer(rid: str) -> None:
            for start in range(0, N_TOKENS, 5):  # 5 tokens per "step", interleaved with the others
                await _write(any_redis, ks, rid, start, 5, "length" if start + 5 == N_TOKENS else None)
                await asyncio.sleep(0)

        results = await asyncio.gather(*(_drain(s, N_TOKENS) for s in subs), *(writer(r) for r in rids))
        for events in results[:N_STREAMS]:
            assert [e.index for e in events] == list(range(N_TOKENS))
            assert [e.token_id for e in events] == [100 + i for i in range(N_TOKENS)]
            assert events[-1].finish_reason == "length"
        writes = N_STREAMS * N_TOKENS / 5
        if ks.shards == 1:  # one round trip carried many streams' entries: far fewer reads than writes
            assert mux.reads < writes
        else:  # a reader per shard (16 for 24 streams): about a read per write, and no busy loop
            assert mux.reads < 2 * writes
    finally:
        await mux.stop()
    assert [await any_redis.exists(w) for w in mux.wake_streams] == [0] * ks.shards


async def test_newcomer_ends_a_read_in_flight(any_redis, any_keys):
    """A read blocks for a minute on a quiet stream; a new subscription must not wait for it."""
    ks = any_keys
    mux = TokenMux(any_redis, ks, block_ms=60_000)
    mux.start()
    try:
        mux.subscribe("mux-quiet")
        while not mux.reader_of("mux-quiet")._reading:
            await asyncio.sleep(0.01)
        # a newcomer of the same shard: the reader whose read is in flight
        late_id = next(f"mux-late-{i}" for i in range(1000)
                       if ks.request_shard(f"mux-late-{i}") == ks.request_shard("mux-quiet"))
        late = mux.subscribe(late_id)
        await _write(any_redis, ks, late_id, 0, 3, "stop")
        events = await _drain(late, 3, timeout_s=10.0)
        assert [e.index for e in events] == [0, 1, 2]
        # the read in flight was ended by a poke on the wake stream, not by its own timeout
        assert await any_redis.xlen(mux.reader_of(late_id).wake_stream) >= 1
    finally:
        await mux.stop()


async def test_slow_subscriber_is_bounded_and_resumes(any_redis, any_keys):
    """Undelivered entries past max_buffered stay in Redis; nothing is lost once the relay reads."""
    ks = any_keys
    mux = TokenMux(any_redis, ks, block_ms=100, count=4, max_buffered=8)
    mux.start()
    try:
        sub = mux.subscribe("mux-slow")
        await _write(any_redis, ks, "mux-slow", 0, 50, "length")
        await asyncio.sleep(0.5)  # the reader runs meanwhile; nobody takes the entries
        assert sub.buffered <= 8 + 4
        events = await _drain(sub, 50)
        assert [e.index for e in events] == list(range(50))
    finally:
        await mux.stop()


async def test_reads_what_the_fenced_decode_script_writes(any_redis, any_keys):
    """The decode pod's batched fenced write and the gateway's reader agree on the entry format;
    a request not owned by the writer is fenced off (nothing written for it)."""
    ks = any_keys
    pub = token_stream.OwnedPublisher(any_redis, ks, "mux-decode", ttl_s=60, maxlen=1000)
    await pub.load()
    await pub.own(GenerationRequest(request_id="mux-owned", prompt_ids=[1], max_tokens=4))
    pipe = any_redis.pipeline(transaction=False)
    lp = TokenLogprobs(-0.25, ((7, -0.25), (3, -2.5)))
    placed = pub.add_batch(pipe, [token_stream.TokenEntry("mux-owned", 1, 7, logprobs=lp.encode()),
                                  token_stream.TokenEntry("mux-other", 1, 9),
                                  token_stream.TokenEntry("mux-owned", 2, 8, "error", "boom", None, "x")])
    assert placed.results(await pipe.execute()) == [1, 0, 1]
    assert not await any_redis.hexists(pub.running("mux-owned"), "mux-owned")  # finished
    mux = TokenMux(any_redis, ks, block_ms=100)
    mux.start()
    try:
        events = await _drain(mux.subscribe("mux-owned"), 2)
        assert [(e.index, e.token_id, e.finish_reason, e.error) for e in events] == [
            (1, 7, None, None), (2, 8, "error", "boom")]
        assert events[0].logprobs == lp and events[1].logprobs is None  # the same codec both ways
        assert events[1].prompt_logprobs == b"x" and events[0].prompt_logprobs is None
        assert not await any_redis.exists(ks.token_stream("mux-other"))
    finally:
        await mux.stop()


async def test_one_request_relayed_twice(any_redis, any_keys):
    """A resumed request can be relayed on a second connection while the first still reads:
    each subscription gets every entry after its own cursor, once."""
    ks = any_keys
    mux = TokenMux(any_redis, ks, block_ms=100)
    mux.start()
    try:
        first = mux.subscribe("mux-twice")
        await _write(any_redis, ks, "mux-twice", 0, 4)
        early = await _drain(first, 4)
        second = mux.subscribe("mux-twice")  # from the start, as a resume replays
        await _write(any_redis, ks, "mux-twice", 4, 4, "length")
        a, b = await asyncio.gather(_drain(first, 4), _drain(second, 8))
        assert [e.index for e in early + a] == list(range(8))
        assert [e.index for e in b] == list(range(8))
    finally:
        await mux.stop()


async def test_the_fenced_write_sets_the_streams_ttl_every_16th_index_and_at_the_finish(any_redis, any_keys):
    """Not on every token (a third of a token's commands), but on index 0 (a decode pod that
    prefilled the prompt writes the stream first), every 16th, and with the finish."""
    ks = any_keys
    r = any_redis
    pub = token_stream.OwnedPublisher(r, ks, "ttl-decode", ttl_s=600, maxlen=1000, finished_ttl_s=60)
    await pub.load()
    await pub.own(GenerationRequest(request_id="ttl-req", prompt_ids=[1], max_tokens=40))
    stream = ks.token_stream("ttl-req")

    async def write(index: int, finish: str | None = None) -> None:
        pipe = r.pipeline(transaction=False)
        placed = pub.add_batch(pipe, [token_stream.TokenEntry("ttl-req", index, 7, finish)])
        assert placed.results(await pipe.execute()) == [1]

    await write(0)
    assert 590 < await r.ttl(stream) <= 600
    await r.persist(stream)
    for i in range(1, token_stream.EXPIRE_EVERY):
        await write(i)
    assert await r.ttl(stream) == -1  # no refresh in between
    await write(token_stream.EXPIRE_EVERY)
    assert 590 < await r.ttl(stream) <= 600
    await write(token_stream.EXPIRE_EVERY + 1, "length")
    assert 50 < await r.ttl(stream) <= 60


async def test_a_malformed_entry_fails_its_request_and_the_reader_goes_on(redis_client, caplog):
    """Issue 42 (5): one malformed entry (`i` not a number) written into a running request's token
    stream, and one with a field this gateway does not know in another's: the first request fails
    with a clear error naming the entry's key, the reader logs that key once and goes on, and
    every other request (the one with the unknown field among them) finishes."""
    from tandem_core.keys import KeySpace

    r, ks = redis_client, KeySpace(1)  # one shard: one reader for every stream
    mux = TokenMux(r, ks, block_ms=100)
    mux.start()
    try:
        rids = ["bad-0", "odd-1", "ok-2", "ok-3"]
        subs = {rid: mux.subscribe(rid) for rid in rids}
        for rid in rids:
            await _write(r, ks, rid, 0, 3)
        first = {rid: await _drain(subs[rid], 3) for rid in rids}
        assert all(len(v) == 3 for v in first.values())
        await r.xadd(ks.token_stream("bad-0"), {"i": "three", "t": "5"})
        await r.xadd(ks.token_stream("odd-1"), {"i": 3, "t": 103, "x-new-field": "from a newer pod"})
        for rid in rids[1:]:
            await _write(r, ks, rid, 4 if rid == "odd-1" else 3, 5 if rid == "odd-1" else 6, "length")
        rest = {rid: await _drain(subs[rid], 6, timeout_s=5.0) for rid in rids[1:]}
        for rid in rids[1:]:
            assert [e.index for e in rest[rid]] == list(range(3, 9)), f"{rid} did not finish: {rest[rid]}"
            assert rest[rid][-1].finish_reason == "length"
        bad = await _drain(subs["bad-0"], 1, timeout_s=5.0)
        assert bad and bad[-1].finish_reason == "error" and bad[-1].token_id == -1, bad
        assert ks.token_stream("bad-0") in (bad[-1].error or "") and "malformed" in (bad[-1].error or "")
        named = [rec for rec in caplog.records if ks.token_stream("bad-0") in rec.getMessage()]
        assert len(named) == 1, [rec.getMessage() for rec in caplog.records]
    finally:
        await mux.stop()


async def test_a_reader_task_that_ends_unexpectedly_is_started_again(redis_client):
    """Issue 42 (5): the token reader is supervised. Ended by an error its loop does not catch
    (here a subscription whose cursor is no stream id), it says so and is started again, and the
    other subscriptions read on."""
    from tandem_core.keys import KeySpace

    r, ks = redis_client, KeySpace(1)
    mux = TokenMux(r, ks, block_ms=100)
    mux.start()
    try:
        sub = mux.subscribe("sup-0")
        await _write(r, ks, "sup-0", 0, 2)
        assert len(await _drain(sub, 2)) == 2
        reader = mux.reader_of("sup-0")
        other = mux.subscribe("sup-1")
        broken = mux.subscribe("sup-1", after_id="not-an-id")  # its cursor compared with the other's: a ValueError
        for _ in range(50):
            if getattr(reader, "restarts", 0):  # (the supervisor counts them)
                break
            await asyncio.sleep(0.05)
        mux.unsubscribe(broken)
        mux.unsubscribe(other)
        await _write(r, ks, "sup-0", 2, 2, "length")
        assert [e.index for e in await _drain(sub, 2, timeout_s=5.0)] == [2, 3]
        assert reader.restarts >= 1
    finally:
        await mux.stop()
