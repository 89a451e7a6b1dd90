"""One contract for every writer of a token stream (tandem_core/bus/token_stream.py): the decode
pod's fenced script (`OwnedPublisher.add_batch`, fenced and unfenced), the prefill pod's fenced
commit of its token 0 (`add_tokens` and `add_prompt_logprobs` queued on `EntryWrites`, committed by
`EntryFence`), and `add_tokens` on a plain pipeline (the writer the gateway's tests drive the relay
with). Each writes the same entries; the reader (`token_event`, and the gateway's TokenMux) must
see the same events and the same expiry from all of them, on one Redis and on a Redis Cluster. A
test double is trusted only because it passes this same test."""
from __future__ import annotations

import asyncio

import pytest

from gateway.tokens import TokenMux
from tandem_core import keys
from tandem_core.bus import entry_fence, token_stream
from tandem_core.types import TokenLogprobs, encode_prompt_logprobs

TTL, FINISHED_TTL, MAXLEN = 300, 30, 1000
LP = TokenLogprobs(-0.25, ((7, -0.25), (9, -1.5)))
PROMPT_LP = encode_prompt_logprobs([None, TokenLogprobs(-2.0, ((5, -2.0),))])
# (index, token, finish, error, logprobs): a prompt-logprobs entry comes first, at index -1
TOKENS = [(0, 11, None, None, LP), (1, 12, None, None, None), (2, 13, "stop", None, LP)]
ERROR = [(0, -1, "error", "KV pull failed: re-prefill gave up", None)]


async def _owned(r, ks, rid, entries, prompt_lp, fenced):
    pub = token_stream.OwnedPublisher(r, ks, "decode-contract", TTL, MAXLEN, FINISHED_TTL)
    await pub.load()
    if fenced:
        await pub.own(_req(rid))
    # as the engine thread emits them (decode_svc/loop.py): the prompt's logprobs its own item at -1
    items = [token_stream.TokenEntry(rid, -1, -1, prompt_logprobs=prompt_lp)] if prompt_lp else []
    items += [token_stream.TokenEntry(rid, i, t, f, e, lp.encode() if lp else None) for i, t, f, e, lp in entries]
    pipe = r.pipeline(transaction=False)
    placed = pub.add_batch(pipe, items, fenced=fenced)
    assert placed.results(await pipe.execute()) == [1] * len(items)


def _queue(w, ks, rid, entries, prompt_lp):
    """The prefill pod's queueing (prefill_svc/prefill.py): the prompt's logprobs, then the tokens."""
    if prompt_lp:
        token_stream.add_prompt_logprobs(w, ks, rid, prompt_lp, TTL, MAXLEN)
    start = entries[0][0]
    toks = [t for _, t, _, _, _ in entries if t >= 0]
    finish, error = entries[-1][2], entries[-1][3]
    token_stream.add_tokens(w, ks, rid, start, toks, finish, TTL, MAXLEN, error=error, finished_ttl_s=FINISHED_TTL,
                            logprobs=[lp for *_, lp in entries])


async def _prefill(r, ks, rid, entries, prompt_lp):
    stream = ks.admission_stream("contract", "normal", ks.request_shard(rid))  # the request's slot
    await r.xgroup_create(stream, keys.PREFILL_GROUP, id="0", mkstream=True)
    entry_id = await r.xadd(stream, {"rid": rid})
    await r.xreadgroup(keys.PREFILL_GROUP, "prefill-contract", {stream: ">"}, count=1)
    w = entry_fence.EntryWrites()
    _queue(w, ks, rid, entries, prompt_lp)
    assert await entry_fence.EntryFence(r, keys.PREFILL_GROUP, "prefill-contract").commit(stream, entry_id, w)


async def _pipeline(r, ks, rid, entries, prompt_lp):
    pipe = r.pipeline(transaction=False)
    _queue(pipe, ks, rid, entries, prompt_lp)
    await pipe.execute()


def _req(rid):
    from tandem_core.types import GenerationRequest

    return GenerationRequest(rid, [1, 2], 8)


WRITERS = {"decode-fenced": lambda r, ks, *a: _owned(r, ks, *a, fenced=True),
           "decode-unfenced": lambda r, ks, *a: _owned(r, ks, *a, fenced=False),
           "prefill-commit": _prefill, "pipeline": _pipeline}


def _expected(entries, prompt_lp):
    out = []
    if prompt_lp:
        out.append(token_stream.TokenEvent(-1, -1, prompt_logprobs=prompt_lp.encode()))
    out += [token_stream.TokenEvent(i, t, f, e, logprobs=lp) for i, t, f, e, lp in entries]
    return out


def _plain(events):
    return [(e.index, e.token_id, e.finish_reason, e.error, e.logprobs, e.prompt_logprobs) for e in events]


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("case", ["tokens", "error"])
async def test_every_writer_writes_what_the_reader_reads(any_redis, any_keys, writer, case):
    ks = any_keys
    r = any_redis
    rid = f"contract-{writer}-{case}"
    entries, prompt_lp = (TOKENS, PROMPT_LP) if case == "tokens" else (ERROR, None)
    await WRITERS[writer](r, ks, rid, entries, prompt_lp)
    raw = await r.xrange(ks.token_stream(rid))
    assert _plain(token_stream.token_event(eid, f) for eid, f in raw) == _plain(_expected(entries, prompt_lp))
    ttl = await r.ttl(ks.token_stream(rid))
    assert 0 < ttl <= FINISHED_TTL, f"{writer}: a finished stream keeps {FINISHED_TTL}s, not {ttl}"


@pytest.mark.parametrize("writer", list(WRITERS))
async def test_the_gateway_reader_sees_the_same_events(any_redis, any_keys, writer):
    ks = any_keys
    r = any_redis
    rid = f"contract-mux-{writer}"
    mux = TokenMux(r, ks, block_ms=200)
    mux.start()
    try:
        sub = mux.subscribe(rid)
        await WRITERS[writer](r, ks, rid, TOKENS, PROMPT_LP)
        got, end = [], asyncio.get_running_loop().time() + 20
        while len(got) < len(TOKENS) + 1 and asyncio.get_running_loop().time() < end:
            got += await sub.get(0.5)
        assert _plain(got) == _plain(_expected(TOKENS, PROMPT_LP))
    finally:
        await mux.stop()


async def test_an_unfinished_stream_keeps_the_running_ttl(any_redis, any_keys):
    """Before the finish, every writer leaves the stream the running TTL (set on index 0)."""
    ks = any_keys
    r = any_redis
    for writer, fn in WRITERS.items():
        rid = f"contract-open-{writer}"
        await fn(r, ks, rid, TOKENS[:2], None)
        ttl = await r.ttl(ks.token_stream(rid))
        assert FINISHED_TTL < ttl <= TTL, f"{writer}: ttl {ttl}"


async def test_own_and_ack_owns_first_and_never_acks_alone(any_redis, any_keys):
    """A pulled request is owned and its ready entry acked in one script call (decode_svc/claims.py
    `_own`): after it the request is in the pod's running hash and the entry neither pending nor
    in the stream; when the call fails (here the running hash's key holds a string), nothing of
    it is written: the entry stays pending, to be acked only once the request is owned."""
    r, ks = any_redis, any_keys
    pub = token_stream.OwnedPublisher(r, ks, "decode-own-ack", TTL, MAXLEN, FINISHED_TTL)
    for rid, broken in (("own-ack-ok", False), ("own-ack-broken", True)):
        stream = ks.ready_stream(f"contract-{rid}", ks.request_shard(rid))  # the request's slot
        await r.xgroup_create(stream, keys.DECODE_GROUP, id="0", mkstream=True)
        entry_id = await r.xadd(stream, {"notice": "{}"})
        await r.xreadgroup(keys.DECODE_GROUP, "decode-own-ack", {stream: ">"}, count=1)
        assert pub.can_own_and_ack(rid, stream)
        if broken:
            await r.set(pub.running(rid), "not a hash")
            with pytest.raises(Exception, match="WRONGTYPE"):
                await pub.own_and_ack(_req(rid), stream, keys.DECODE_GROUP, entry_id)
            assert (await r.xpending(stream, keys.DECODE_GROUP))["pending"] == 1, "acked without being owned"
            assert await r.xlen(stream) == 1
            continue
        await pub.own_and_ack(_req(rid), stream, keys.DECODE_GROUP, entry_id)
        assert await r.hget(pub.running(rid), rid) == _req(rid).to_json().encode()
        assert (await r.xpending(stream, keys.DECODE_GROUP))["pending"] == 0
        assert await r.xlen(stream) == 0


async def test_a_step_write_reports_the_requests_cancelled_by_their_client(any_redis, any_keys):
    """`add_batch(cancels=True)` looks each written item's cancel key up (the one the gateway sets,
    `cancel.request_cancel`) in the same script call: 2 = written and cancelled, 1 = written; a
    finishing item is not looked up; without `cancels` nothing is (on a Redis Cluster too: the
    cancel key shares the request's slot)."""
    from tandem_core.bus import cancel

    r, ks = any_redis, any_keys
    pub = token_stream.OwnedPublisher(r, ks, "decode-cancels", TTL, MAXLEN, FINISHED_TTL)
    await pub.load()
    rids = [f"cancels-{i}" for i in range(6)]
    await pub.own(*[_req(rid) for rid in rids])
    for rid in rids[::2]:
        await cancel.request_cancel(r, ks, rid, 60)
    items = [token_stream.TokenEntry(rid, 1, 7) for rid in rids]
    pipe = r.pipeline(transaction=False)
    placed = pub.add_batch(pipe, items, cancels=True)
    assert placed.results(await pipe.execute()) == [2, 1, 2, 1, 2, 1]
    pipe = r.pipeline(transaction=False)
    placed = pub.add_batch(pipe, [token_stream.TokenEntry(rid, 2, 8) for rid in rids])
    assert placed.results(await pipe.execute()) == [1] * 6
    pipe = r.pipeline(transaction=False)
    placed = pub.add_batch(pipe, [token_stream.TokenEntry(rid, 3, 9, "length") for rid in rids], cancels=True)
    assert placed.results(await pipe.execute()) == [1] * 6
    for rid in rids:
        assert [int(f[b"i"]) for _id, f in await r.xrange(ks.token_stream(rid))] == [1, 2, 3]
