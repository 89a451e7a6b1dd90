"""The decode pod's step write (`OwnedPublisher.write`, tandem_core/bus/token_stream.py): on one
Redis it packs a step's script calls and acks itself and sends them on a connection of its own
(`_Wire`); on a Redis Cluster it queues them on a pipeline (`add_batch`). Both must write the same
entries and return the same 1 / 2 / 0 per item as the pipeline did, and the connection must never
hand one round trip's reply to the next (a cancel or a dropped connection in between), nor stay on
an error. Real Redis; the redis-py internals `_Wire` reads (`Connection._writer`) are held to the
pinned versions here too."""
from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import NoScriptError

from tandem_core.bus import conn, groups, token_stream
from tandem_core.keys import KeySpace
from tandem_core.settings import RedisConfig
from tandem_core.types import GenerationRequest, TokenLogprobs, encode_prompt_logprobs

TTL, MAXLEN, FINISHED_TTL = 300, 1000, 30
LP = TokenLogprobs(-0.25, ((7, -0.25), (9, -1.5))).encode()
PROMPT_LP = encode_prompt_logprobs([None, TokenLogprobs(-2.0, ((5, -2.0),))])


def _items(rid: str) -> list[token_stream.TokenEntry]:
    """Every kind of entry: the prompt's logprobs (-1), a token with logprobs, plain tokens (16
    refreshes the TTL), a finish with an error."""
    return [token_stream.TokenEntry(rid, -1, -1, prompt_logprobs=PROMPT_LP),
            token_stream.TokenEntry(rid, 0, 11, logprobs=LP),
            token_stream.TokenEntry(rid, 1, 12),
            token_stream.TokenEntry(rid, 16, 2**31 - 1),
            token_stream.TokenEntry(rid, 17, -1, "error", "KV pull failed: re-prefill gave up")]


async def _entries(r, ks: KeySpace, rid: str) -> list[dict]:
    return [f for _id, f in await r.xrange(ks.token_stream(rid))]


async def _setup(r, ks: KeySpace, tag: str) -> tuple[token_stream.OwnedPublisher, list[str]]:
    """A publisher, four owned requests (one of them cancelled by its client) and one not owned."""
    pub = token_stream.OwnedPublisher(r, ks, "decode-wire", TTL, MAXLEN, FINISHED_TTL)
    await pub.load()
    rids = [f"{tag}-{i}" for i in range(5)]
    await pub.own(*[GenerationRequest(rid, [1, 2], 32) for rid in rids[:4]])
    await r.set(ks.cancel_key(rids[3]), 1)
    return pub, rids


def _batch(rids: list[str]) -> list[token_stream.TokenEntry]:
    """Step-major, as the engine thread emits a multi-step call: each request's items in order."""
    per = [_items(rid) for rid in rids]
    return [per[k][j] for j in range(len(per[0])) for k in range(len(per))]


async def test_write_matches_the_pipeline(any_redis, any_keys):
    r, ks = any_redis, any_keys
    pub, piped = await _setup(r, ks, "piped")
    _, wired = await _setup(r, ks, "wired")
    pipe = r.pipeline(transaction=False)
    placed = pub.add_batch(pipe, _batch(piped), cancels=True)
    want = placed.results(await pipe.execute())
    got = await pub.write(_batch(wired), cancels=True)
    assert got == want
    # fenced off (not owned: 0), cancelled (2 until its finish), the rest written (1)
    assert want[:5] == [1, 1, 1, 2, 0] and want[-5:] == [1, 1, 1, 1, 0]
    for a, b in zip(piped, wired):
        assert await _entries(r, ks, a) == await _entries(r, ks, b)
        ta, tb = await r.ttl(ks.token_stream(a)), await r.ttl(ks.token_stream(b))
        assert (ta > 0) == (tb > 0) and abs(ta - tb) <= 2, (a, ta, b, tb)
    assert await _entries(r, ks, wired[0]) == [
        {b"i": b"-1", b"t": b"-1", b"p": PROMPT_LP.encode()}, {b"i": b"0", b"t": b"11", b"l": LP.encode()},
        {b"i": b"1", b"t": b"12"}, {b"i": b"16", b"t": b"2147483647"},
        {b"i": b"17", b"t": b"-1", b"f": b"error", b"e": b"KV pull failed: re-prefill gave up"}]
    assert await _entries(r, ks, wired[4]) == []
    assert 0 < await r.ttl(ks.token_stream(wired[0])) <= FINISHED_TTL  # the finish set the finished TTL
    assert not await r.hexists(pub.running(wired[0]), wired[0])  # and ended the ownership


@pytest.fixture
async def plain(redis_url):
    """A client built as the decode pod builds it (a blocking pool), on 4 key shards: a step's
    write is then several script calls, and acks, in one packed write."""
    r = conn.connect(RedisConfig(url=redis_url))
    await r.flushdb()
    try:
        yield r, KeySpace(4)
    finally:
        await r.aclose()


async def test_several_shards_and_acks_in_one_write(plain):
    r, ks = plain
    pub, rids = await _setup(r, ks, "shards")
    assert len({ks.request_shard(rid) for rid in rids}) > 1
    stream = ks.direct_stream("wire", 0)
    await groups.ensure_group(r, stream, groups.DECODE_GROUP)
    ids = [await r.xadd(stream, {"req": "x"}) for _ in range(2)]
    await r.xreadgroup(groups.DECODE_GROUP, "decode-wire", {stream: ">"}, count=2)
    got = await pub.write(_batch(rids), [(stream, groups.DECODE_GROUP, i) for i in ids], cancels=True)
    assert got[:5] == [1, 1, 1, 2, 0] and got[-5:] == [1, 1, 1, 1, 0]
    assert await r.xlen(stream) == 0 and (await r.xpending(stream, groups.DECODE_GROUP))["pending"] == 0
    assert [f[b"i"] for f in await _entries(r, ks, rids[2])] == [b"-1", b"0", b"1", b"16", b"17"]
    assert pub._wire is not None and pub._wire.conn is not None  # it went over the wire, not a pipeline
    assert pub._wire.conn._writer is not None  # (the redis-py internal `_Wire._send` writes on)


async def test_a_reply_is_never_read_by_the_next_write(plain):
    """A write cancelled after it was sent, and one whose connection was killed: the next write
    reads its own reply (a stale one would say 0, not owned, for an owned request)."""
    r, ks = plain
    pub, rids = await _setup(r, ks, "stale")
    assert await pub.write([token_stream.TokenEntry(rids[0], 0, 5)]) == [1]  # the wire is connected
    sent = asyncio.create_task(pub.write([token_stream.TokenEntry(rids[4], 0, 5)]))  # not owned: [0]
    await asyncio.sleep(0)  # sent, its reply not read yet
    sent.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sent
    assert await pub.write([token_stream.TokenEntry(rids[0], 1, 6)]) == [1]
    client_id = (await pub._wire.call(token_stream._pack("CLIENT", "ID"), 1))[0]
    await r.client_kill_filter(_id=client_id)
    with pytest.raises(conn.REDIS_DOWN):
        await pub.write([token_stream.TokenEntry(rids[0], 2, 7)])
    assert await pub.write([token_stream.TokenEntry(rids[0], 3, 8)]) == [1]  # connected again
    assert [f[b"i"] for f in await _entries(r, ks, rids[0])] == [b"0", b"1", b"3"]


async def test_a_redis_without_the_script_raises_noscript_and_the_wire_stays_in_step(plain):
    r, ks = plain
    pub, rids = await _setup(r, ks, "noscript")
    stream = ks.direct_stream("wire", 0)
    await groups.ensure_group(r, stream, groups.DECODE_GROUP)
    entry = await r.xadd(stream, {"req": "x"})
    await r.xreadgroup(groups.DECODE_GROUP, "decode-wire", {stream: ">"}, count=1)
    await r.script_flush()
    with pytest.raises(NoScriptError):  # raised after the acks' replies were read too
        await pub.write([token_stream.TokenEntry(rids[0], 0, 5)], [(stream, groups.DECODE_GROUP, entry)])
    await pub.load()
    assert await pub.write([token_stream.TokenEntry(rids[4], 0, 5), token_stream.TokenEntry(rids[0], 0, 5)]) == [0, 1]
    assert await r.xlen(stream) == 0  # the ack went through with the refused script call


async def test_own_and_ack_and_commands_on_the_wire(plain, redis_url):
    """A pulled request's ownership and ack (a script Redis may have lost) and the cancel poll's
    MGET go on the same connection when it is free, and give what the client would."""
    from decode_svc.bridge import Bridge
    from decode_svc.io import DecodeIO
    from decode_svc.requests import RequestTable
    from decode_svc.settings import DecodeSettings

    r, ks = plain
    pub, rids = await _setup(r, ks, "own")
    stream = ks.ready_stream("wire", ks.request_shard("own-new"))
    await groups.ensure_group(r, stream, groups.DECODE_GROUP)
    entry = await r.xadd(stream, {"notice": "x"})
    await r.xreadgroup(groups.DECODE_GROUP, "decode-wire", {stream: ">"}, count=1)
    await r.script_flush()  # a restarted Redis: the script is loaded again on NOSCRIPT
    req = GenerationRequest("own-new", [1, 2], 8)
    assert pub.can_own_and_ack(req.request_id, stream)
    await pub.own_and_ack(req, stream, groups.DECODE_GROUP, entry)
    assert await r.hget(pub.running("own-new"), "own-new") == req.to_json().encode()
    assert await r.xlen(stream) == 0 and (await r.xpending(stream, groups.DECODE_GROUP))["pending"] == 0
    assert pub._wire.conn is not None  # it went over the wire
    io = DecodeIO(DecodeSettings(redis=RedisConfig(url=redis_url, shards=4)), r, ks, RequestTable(2), None,
                  Bridge(2, 8), "decode-wire")
    names: dict[str, bytes] = {}
    assert await io._cancelled(rids, names) == {rids[3]}  # the one whose client left (`_setup`)
    await r.set(ks.cancel_key(rids[0]), 1)
    assert await io._cancelled(rids, names) == {rids[0], rids[3]}


async def test_concurrent_callers_each_read_their_own_replies(plain):
    """Callers pipelined on the one connection (step writes, own-and-acks, polls at once) each get
    their own replies; a caller cancelled while others wait costs them a retryable error, never
    another's reply."""
    r, ks = plain
    pub, rids = await _setup(r, ks, "many")

    async def echo(i: int) -> bytes:
        return await pub.command("ECHO", f"reply-{i}")

    async def step(i: int) -> list[int]:
        return await pub.write([token_stream.TokenEntry(rids[i % 5], 100 + i, i)])

    got = await asyncio.gather(*[echo(i) if i % 2 else step(i) for i in range(40)])
    assert got == [f"reply-{i}".encode() if i % 2 else [0 if i % 5 == 4 else 1] for i in range(40)]
    tasks = [asyncio.create_task(echo(i)) for i in range(20)]
    await asyncio.sleep(0)  # all written, the first reading, the others waiting their turn
    tasks[10].cancel()
    fresh = [asyncio.create_task(echo(100 + i)) for i in range(5)]  # written on the connection made again
    for i, t in enumerate(tasks):
        try:
            assert await t == f"reply-{i}".encode()
        except asyncio.CancelledError:
            assert i == 10
        except conn.REDIS_DOWN:
            pass  # its reply was lost with the connection: the caller retries
    assert await asyncio.gather(*fresh) == [f"reply-{100 + i}".encode() for i in range(5)]
    assert await asyncio.gather(*[echo(i) for i in range(5)]) == [f"reply-{i}".encode() for i in range(5)]
