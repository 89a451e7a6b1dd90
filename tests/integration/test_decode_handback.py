"""Every task a decode pod starts has an owner: a failure in a KV pull task or a step's publish
ends with the request-table seat freed and the request handed back for recovery (out of the pod's
running hash, enqueued again from what was streamed) or finished, its stream entry acked — never a
held seat, never a request owned by a pod that no longer works on it (issue 31).

Real Redis, a real gRPC KV server and the real tiny engine, as tests/integration/test_decode_claims.py
sets them up; the failure is injected at a named await with the fault hook (tandem_core/faults.py):
`error` raises an error nothing retries, `down` raises redis-py's ConnectionError (Redis looks
down) so the retry paths run out first.
"""
from __future__ import annotations

import asyncio

import pytest

from decode_svc.bridge import Bridge
from decode_svc.io import DecodeIO
from decode_svc.loop import EngineLoop
from decode_svc.recover import recover_loop
from decode_svc.requests import RequestTable
from decode_svc.settings import DecodeSettings
from prefill_svc.kv_store import KVStore
from prefill_svc.service import KVTransferServicer
from tandem_core import faults, grpc_util, keys
from tandem_core.bus import groups, ready
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine
from tandem_proto import kv_pb2_grpc

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)

SLOTS = 2
MAX_TOKENS = 12
WID = "decode-handback"


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=SLOTS, max_len=64, prefill_buckets=(16,))


@pytest.fixture(autouse=True)
def _no_faults_after():
    yield
    faults.configure("")


class Pod:
    """One decode pod's I/O side and engine thread over a real Redis, started and stopped here."""

    def __init__(self, r, engine, redis_url: str, pool: str, **settings) -> None:
        self.s = DecodeSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=64),
                                pool=pool, slots=SLOTS, claim_block_ms=50, recover_interval_s=0.2,
                                worker_id=WID, **settings)
        self.table = RequestTable(SLOTS)
        self.bridge = Bridge(SLOTS, settings.get("output_queue_size", 64), asyncio.get_running_loop())
        self.eloop = EngineLoop(engine, self.table, self.bridge)
        self.io = DecodeIO(self.s, r, KS, self.table, self.eloop, self.bridge, WID)
        self.stop, self.done = asyncio.Event(), asyncio.Event()

    async def __aenter__(self) -> Pod:
        await self.io.owned.load()
        self.eloop.start()
        self.tasks = [asyncio.create_task(self.io.claims.claim_loop(self.stop)),
                      asyncio.create_task(self.io.publisher.publish_loop(self.done)),
                      asyncio.create_task(recover_loop(self.io, self.done))]
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        await self.tasks[0]
        self.eloop.stop()
        self.done.set()
        await asyncio.gather(*self.tasks[1:], return_exceptions=True)
        await self.io.puller.close()


async def _kv_server(store):
    server = grpc_util.make_server(8 << 20)
    kv_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(store, 1 << 16, lambda _r: None), server)
    port = grpc_util.bind(server, "127.0.0.1", 0)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _publish_ready(r, engine, store, address, pool, rid: str, max_tokens: int = MAX_TOKENS) -> GenerationRequest:
    req = GenerationRequest(rid, [256, 65, 66], max_tokens, SamplingParams(), ignore_eos=True)
    payload = engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling))
    held = store.put(req.request_id, payload)
    notice = ready.ReadyNotice(req, address, held.capability, payload.nbytes, "p0", payload.first_token)
    pipe = r.pipeline(transaction=False)  # as the prefill pod writes it (without its fence)
    ready.add_ready(pipe, KS, pool, notice, 1000)
    groups.ring(pipe, KS, pool, keys.DECODE_GROUP)
    await pipe.execute()
    return req


async def _state(r, pod: Pod, pool: str, rid: str) -> dict:
    """What the pod and Redis say about `rid` now."""
    shard = KS.request_shard(rid)
    resumed = [GenerationRequest.from_json(f[b"req"]) for _id, f in
               await r.xrange(KS.admission_stream(pool, "high", shard))]
    tokens = await r.xrange(KS.token_stream(rid))
    return {
        "seats": sum(pod.table.stages().values()),  # records: claimed, pulling, queued, running
        "owned": await r.hexists(KS.running_key(WID, shard), rid),
        "unacked": (await r.xpending(KS.ready_stream(pool, 0), keys.DECODE_GROUP))["pending"],
        "resumed": [q for q in resumed if q.request_id == rid],
        "finished": any(b"f" in f for _id, f in tokens),
        "indices": [int(f[b"i"]) for _id, f in tokens],
    }


async def _until(r, pod, pool, rid, settled, rounds: int = 300) -> dict:
    """Poll until `settled(state)` (a bound on the wait, not a timing assertion)."""
    for _ in range(rounds):
        st = await _state(r, pod, pool, rid)
        if settled(st):
            return st
        await asyncio.sleep(0.05)
    return st


@pytest.mark.parametrize("fault", ["decode.own@1", "decode.pull@1"])
async def test_a_failed_pull_task_frees_its_seat_and_hands_the_request_back(
        redis_url, redis_client, engine, fault):
    """An error nothing expected (not gRPC's, not the request's), in the ownership write or before
    the pull: before issue 31 the task died with "Task exception was never retrieved", its seat held
    for the pod's life and its ready entry never acked; the request waited until its deadline."""
    r, pool = redis_client, "handback-pull"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    faults.configure(fault)
    try:
        async with Pod(r, engine, redis_url, pool) as pod:
            req = await _publish_ready(r, engine, store, address, pool, "pull-fails")
            st = await _until(r, pod, pool, req.request_id,
                              lambda st: st["resumed"] and st["seats"] == 0 and st["unacked"] == 0)
            assert faults.raised[fault.split("@")[0]] == 1, "the fault never fired: the test proves nothing"
            assert st["seats"] == 0, f"the failed pull still holds a seat: {pod.table.stages()}"
            assert not st["owned"], "the pod still owns a request it is not working on"
            assert st["unacked"] == 0, "the ready entry was never acked"
            assert len(st["resumed"]) == 1 and st["resumed"][0].attempt == 1, \
                f"the request was not handed back for recovery once: {st['resumed']}"
            # and the pod goes on serving: the next request runs to its end
            nxt = await _publish_ready(r, engine, store, address, pool, "after")
            st = await _until(r, pod, pool, nxt.request_id, lambda st: st["finished"])
            assert st["finished"] and st["indices"] == list(range(1, MAX_TOKENS))
    finally:
        await server.stop(None)


async def test_a_failed_pull_whose_hand_back_is_owed_keeps_its_entry_pending(redis_url, redis_client, engine):
    """A pull fails and its hand-back cannot be written either (owed, in this pod's memory). Its
    ready entry must stay pending until the owed resume is written: acked at once (as before), a
    crash of the pod in between (CI's fault-site run: an engine step failed just then) left the
    request neither owned nor pending, so nothing recovered it and the client waited out its
    deadline after the first token. Once the hand-back goes through, the entry is acked."""
    r, pool = redis_client, "handback-owed"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    faults.configure("decode.pull@1,decode.handback@1-3")  # three recovery rounds fail to hand it back
    try:
        async with Pod(r, engine, redis_url, pool) as pod:
            req = await _publish_ready(r, engine, store, address, pool, "handback-owed")
            for _ in range(300):
                if faults.raised.get("decode.handback", 0) >= 2:
                    break
                await asyncio.sleep(0.02)
            st = await _state(r, pod, pool, req.request_id)
            assert faults.raised["decode.pull"] == 1 and faults.raised["decode.handback"] >= 2, faults.raised
            assert pod.io.handback.owed_resumes, "the hand-back was not owed: the test proves nothing"
            assert st["unacked"] == 1, "the entry was acked while its request's resume was only owed"
            assert not st["resumed"] and not st["owned"] and st["seats"] == 0, st
            st = await _until(r, pod, pool, req.request_id, lambda st: st["resumed"] and st["unacked"] == 0)
            assert len(st["resumed"]) == 1 and st["unacked"] == 0, st
            assert not pod.io.handback.owed, (pod.io.handback.owed_resumes, pod.io.handback.owed_acks)
    finally:
        await server.stop(None)


async def test_a_pulled_request_is_owned_and_acked_in_one_call(redis_url, redis_client, engine):
    """A pulled request's ownership and its ready entry's ack are one script call (claims.py
    `_own`): Redis's MONITOR sees no HSET or XACK of the pod's own, only inside the script, and
    the request runs to its end owned, its entry acked."""
    import redis.asyncio as aioredis

    r, pool = redis_client, "handback-one-call"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    watcher = aioredis.Redis.from_url(redis_url, socket_timeout=600)  # it may sit idle while the pod starts
    seen: list[dict] = []
    started = asyncio.Event()

    async def watch() -> None:
        async with watcher.monitor() as m:
            started.set()
            async for c in m.listen():
                seen.append(c)

    task = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(started.wait(), 10)
        async with Pod(r, engine, redis_url, pool) as pod:
            req = await _publish_ready(r, engine, store, address, pool, "one-call")
            st = await _until(r, pod, pool, req.request_id,
                              lambda st: st["finished"] and st["unacked"] == 0 and st["seats"] == 0)
        assert st["finished"] and st["indices"] == list(range(1, MAX_TOKENS)), st["indices"]
        assert st["unacked"] == 0 and not st["resumed"]
        await r.get("one-call-sentinel")  # once the monitor has seen this, it has seen the pod's commands
        for _ in range(600):
            if any("one-call-sentinel" in c["command"] for c in seen):
                break
            await asyncio.sleep(0.05)
        assert any("one-call-sentinel" in c["command"] for c in seen), \
            f"the monitor saw {len(seen)} commands: {task.done() and task.exception()!r}"
        mine = [c["command"].split()[0].upper() for c in seen if c.get("client_type") != "lua"]
        in_script = [c["command"].split()[0].upper() for c in seen if c.get("client_type") == "lua"]
        assert "HSET" not in mine and "XACK" not in mine, mine
        assert in_script.count("XACK") == 1 and "HSET" in in_script, in_script
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.aclose()
        await server.stop(None)


async def test_a_running_request_is_cancelled_by_its_steps_write(redis_url, redis_client, engine):
    """No cancel poll runs here (this Pod starts no `cancel_loop`): the step that writes a running
    request's token finds its cancel key (the publisher's script looks it up), and the engine ends
    it with a `cancelled` finish, its seat freed, instead of decoding to max_tokens. One step per
    write and one step queued: the engine runs at most a few steps ahead of the writes (it blocks
    on the bridge), so the cancel lands long before 40 tokens, however fast the engine."""
    from tandem_core.bus import cancel

    r, pool = redis_client, "handback-cancel"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    try:
        async with Pod(r, engine, redis_url, pool, output_queue_size=1, publish_coalesce_steps=1) as pod:
            await cancel.request_cancel(r, KS, "cancel-running", 60)  # the client left before its first step
            req = await _publish_ready(r, engine, store, address, pool, "cancel-running", max_tokens=40)
            st = await _until(r, pod, pool, req.request_id, lambda st: st["finished"] and st["seats"] == 0)
            tokens = await r.xrange(KS.token_stream(req.request_id))
            finishes = [f[b"f"] for _id, f in tokens if b"f" in f]
            assert finishes == [b"cancelled"], (finishes, st["indices"])
            assert len(st["indices"]) < 20, st["indices"]
            assert st["unacked"] == 0 and not st["owned"] and not st["resumed"]
            assert pod.eloop.stats.cancelled == 1
    finally:
        await server.stop(None)


@pytest.mark.parametrize("fails", [1, 2])
async def test_an_ack_that_fails_is_owed_not_lost(redis_url, redis_client, engine, fails):
    """The request is owned and its ready entry acked in one call (claims.py `_own`); when that
    call fails, the request is owned alone and its entry acked after (fails=1); when that ack
    fails too (fails=2), the request runs to its end and the ack is written by the next recovery
    round (before issue 31 the task died there and the entry stayed pending and marked busy for
    the pod's life)."""
    r, pool = redis_client, f"handback-ack-{fails}"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    faults.configure(f"decode.ack@1-{fails}")
    try:
        async with Pod(r, engine, redis_url, pool) as pod:
            req = await _publish_ready(r, engine, store, address, pool, f"ack-fails-{fails}")
            st = await _until(r, pod, pool, req.request_id,
                              lambda st: st["finished"] and st["unacked"] == 0 and st["seats"] == 0)
            assert faults.raised["decode.ack"] == fails
            assert st["finished"] and st["indices"] == list(range(1, MAX_TOKENS)), st["indices"]
            assert st["unacked"] == 0, "the failed ack was never written again"
            assert st["seats"] == 0 and not st["owned"] and not st["resumed"]
    finally:
        await server.stop(None)


async def test_a_publish_that_gives_up_hands_its_requests_back(redis_url, redis_client, engine):
    """Redis refuses a step's writes past `publish_retries`: the step's requests stop here and go
    back for recovery, out of this pod's running hash, and nothing of theirs is written behind the
    gap. Before issue 31 the step was dropped with "these requests resume elsewhere or time out",
    but the pod still owned them, so nothing resumed them: the relay waited on the gap until the
    deadline."""
    r, pool = redis_client, "handback-publish"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    faults.configure("decode.publish@3-200:down")  # the 3rd write on: Redis looks down to the publisher only
    try:
        # one step per write (no coalescing), so the 3rd write is the 3rd step's, whatever the timing
        async with Pod(r, engine, redis_url, pool, publish_retries=2, publish_coalesce_steps=1) as pod:
            req = await _publish_ready(r, engine, store, address, pool, "publish-fails")
            st = await _until(r, pod, pool, req.request_id,
                              lambda st: st["resumed"] and st["seats"] == 0 and not st["owned"])
            assert faults.raised["decode.publish"] >= 2, \
                (st, pod.table.stages(), pod.eloop.stats, pod.eloop.error, faults.calls("decode.publish"))
            assert st["resumed"], "the request whose tokens were dropped was never handed back"
            assert not st["owned"], "the pod still owns a request whose tokens it dropped"
            assert st["seats"] == 0, f"its seat is still held: {pod.table.stages()}"
            again = st["resumed"][0]
            written = st["indices"]
            # resumed from the contiguous tokens written (none of index 0 here: the test's prefill
            # wrote no token 0), and no later index was written behind the gap
            assert again.start_index == 0 and again.attempt == 1
            assert written == list(range(1, 1 + len(written))), f"tokens written behind a gap: {written}"
            assert not st["finished"]
    finally:
        await server.stop(None)


async def test_entries_claimed_before_a_later_claim_fails_are_started(redis_url, redis_client, engine):
    """The claim pass reads the ready streams, then the direct streams; Redis goes away between the
    two. The ready entry already claimed is this pod's in Redis: it must be started now. Before
    issue 31 the pass was dropped whole, and the entry waited, pending to a live consumer, for the
    stale reclaim (`stale_pending_s`, 60 s by default: the prefill pod's KV lease is 60 s too).
    The stale reclaim is set out of reach here, so only the fix finishes the request."""
    r, pool = redis_client, "handback-claim"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    try:
        req = await _publish_ready(r, engine, store, address, pool, "claimed-then-down")
        faults.configure("decode.claim@2:down")  # the first pass: ready (call 1) claims it, direct (2) fails
        async with Pod(r, engine, redis_url, pool, stale_pending_s=3600) as pod:
            st = await _until(r, pod, pool, req.request_id, lambda st: st["finished"] and st["unacked"] == 0)
            assert faults.raised["decode.claim"] == 1
            assert st["finished"] and st["indices"] == list(range(1, MAX_TOKENS)), st
            assert st["unacked"] == 0 and st["seats"] == 0 and not st["resumed"]
    finally:
        await server.stop(None)


async def _direct_pending(r, pool: str, rid: str) -> int:
    return (await r.xpending(KS.direct_stream(pool, KS.request_shard(rid)), keys.DECODE_GROUP))["pending"]


async def test_a_short_prompt_whose_ownership_write_fails_is_handed_back_at_once(redis_url, redis_client, engine):
    """A short prompt (the direct stream: this pod prefills it) whose running-hash write fails: the
    request is handed back for recovery at once and its entry acked. Before, the entry stayed
    pending to this live pod until the stale reclaim (`stale_pending_s`), set out of reach here."""
    from tandem_core.bus import admission

    r, pool = redis_client, "handback-own-direct"
    await groups.ensure_groups(r, KS, pool)
    faults.configure("decode.own@1")
    req = GenerationRequest("own-direct", [256, 65, 66], MAX_TOKENS, SamplingParams(), ignore_eos=True)
    async with Pod(r, engine, redis_url, pool, direct_prefill=True, stale_pending_s=3600) as pod:
        await admission.enqueue_request(r, KS, pool, req, 1000, direct=True)
        st = await _until(r, pod, pool, req.request_id, lambda st: st["resumed"] and st["seats"] == 0)
        pending = await _direct_pending(r, pool, req.request_id)
        for _ in range(100):  # the ack follows the hand-back
            if not pending:
                break
            await asyncio.sleep(0.05)
            pending = await _direct_pending(r, pool, req.request_id)
        assert faults.raised["decode.own"] == 1, "the fault never fired: the test proves nothing"
        assert len(st["resumed"]) == 1 and st["resumed"][0].attempt == 1, st["resumed"]
        assert st["seats"] == 0 and not st["owned"], (pod.table.stages(), st)
        assert pending == 0, "the direct entry was never acked: it waits for the stale reclaim"


async def test_an_unreadable_entry_is_acked_as_a_dead_letter(redis_url, redis_client, engine, caplog):
    """An entry no request can be read from (a writer's bug, a version skew): acked and logged with
    its fields, and the pod goes on. Before, it stayed pending and failed again on every reclaim."""
    r, pool = redis_client, "handback-dead-letter"
    await groups.ensure_groups(r, KS, pool)
    stream = KS.direct_stream(pool, 0)
    async with Pod(r, engine, redis_url, pool, direct_prefill=True) as pod:
        await r.xadd(stream, {"rid": "garbled", "req": b"{not json"})
        for _ in range(200):
            if pod.io.claims.dead_letters and not (await r.xpending(stream, keys.DECODE_GROUP))["pending"]:
                break
            await asyncio.sleep(0.05)
        assert pod.io.claims.dead_letters == 1
        assert (await r.xpending(stream, keys.DECODE_GROUP))["pending"] == 0, "the unreadable entry was never acked"
        assert "dead letter" in caplog.text and "{not json" in caplog.text
        # issue 42 (6): its request is answered with a clear error, not left to its client's timeout
        ends = [f for _id, f in await r.xrange(KS.token_stream("garbled")) if b"f" in f]
        assert ends and ends[-1][b"f"] == b"error" and b"cannot be read" in ends[-1].get(b"e", b""), \
            f"the dead letter's request got no answer: its client waits out its timeout ({ends})"
        assert sum(pod.table.stages().values()) == 0 and pod.table.reserved == 0 if hasattr(pod.table, "reserved") \
            else sum(pod.table.stages().values()) == 0
        # and the pod goes on: a good short prompt after it runs to its end
        good = GenerationRequest("after-dead-letter", [256, 65, 66], MAX_TOKENS, SamplingParams(), ignore_eos=True)
        from tandem_core.bus import admission
        await admission.enqueue_request(r, KS, pool, good, 1000, direct=True)
        st = await _until(r, pod, pool, good.request_id, lambda st: st["finished"])
        assert st["finished"]


async def test_a_delivery_whose_claim_reply_was_lost_is_taken_again_at_once(redis_url, redis_client, engine):
    """The lease failure after a Redis restart (issue 31): the decode pod's XREADGROUP ran, but its
    reply was lost with the dying connection, so the ready entry is pending to this live pod, which
    never saw it. Only the stale reclaim (`stale_pending_s`, 60 s by default) took it back, and the
    prefill pod's KV lease (60 s, begun before the entry was written) always ended first: "KV was
    not pulled by a decode pod within its lease". Here the delivery is made as the pod's consumer
    (what the lost reply leaves in Redis) and the pod's first claim fails as on a dying connection;
    the stale reclaim is out of reach, so only taking its own entries again at once finishes it."""
    r, pool = redis_client, "handback-lost-reply"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    try:
        req = await _publish_ready(r, engine, store, address, pool, "lost-reply")
        got = await r.xreadgroup(keys.DECODE_GROUP, WID, {KS.ready_stream(pool, 0): ">"}, count=1)
        assert got and len(got[0][1]) == 1  # delivered to the pod's consumer; the pod never saw it
        faults.configure("decode.claim@1:down")
        async with Pod(r, engine, redis_url, pool, stale_pending_s=3600) as pod:
            st = await _until(r, pod, pool, req.request_id, lambda st: st["finished"] and st["unacked"] == 0,
                              rounds=1200)  # a bound on the wait on a busy machine, not a timing assertion
            assert faults.raised["decode.claim"] == 1, "the claim never failed: the test proves nothing"
            assert st["finished"] and st["indices"] == list(range(1, MAX_TOKENS)), st
            assert st["unacked"] == 0 and st["seats"] == 0 and not st["resumed"]
            assert len(store) == 0, "the KV is still held: it was never pulled"
    finally:
        await server.stop(None)


async def test_a_steal_pass_that_fails_after_claiming_starts_what_it_claimed(redis_url, redis_client, engine,
                                                                              monkeypatch):
    """Issue 42 (3): the steal pass claims other pods' unread steered entries stream by stream; a
    read failing after the first stream's claim (injected at the second stream's look) dropped the
    whole pass's result, so the entry claimed first sat pending to this live pod (outside
    `retake_own`'s sources) until the stale reclaim, while its KV lease ran out. Both requests
    must run to their end."""
    from tandem_core.bus import steal

    r, pool = redis_client, "handback-steal"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    reqs = []
    for other in ("pod-away-1", "pod-away-2"):  # steered to two other pods that never read: two streams
        req = GenerationRequest(f"steal-{other}", [256, 65, 66], MAX_TOKENS, SamplingParams(), ignore_eos=True,
                                decode_pod=other)
        payload = engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling))
        held = store.put(req.request_id, payload)
        pipe = r.pipeline(transaction=False)
        ready.add_ready(pipe, KS, pool, ready.ReadyNotice(req, address, held.capability, payload.nbytes, "p0",
                                                           payload.first_token), 1000)
        await pipe.execute()
        reqs.append(req)
    looks = {"n": 0}
    real_unread = steal.Stealer._unread

    async def unread(self, stream, count):  # the first look after a claim (the next stream's) fails, once
        if self.stolen and not looks["n"]:
            looks["n"] += 1
            raise ConnectionError("injected: the steal pass's read of its second stream failed")
        return await real_unread(self, stream, count)

    monkeypatch.setattr(steal.Stealer, "_unread", unread)
    try:
        async with Pod(r, engine, redis_url, pool, affinity_wait_ms=1) as pod:
            for req in reqs:
                st = await _until(r, pod, pool, req.request_id, lambda st: st["finished"])
                assert st["finished"] and st["indices"] == list(range(1, MAX_TOKENS)), \
                    f"{req.request_id} never ran: {st}, pod: {pod.table.stages()}"
            assert looks["n"] == 1, "the injected failure never fired: the test proves nothing"
    finally:
        await server.stop(None)


async def test_the_engine_thread_waits_as_long_as_the_publisher_retries(redis_url, redis_client, engine):
    """Issue 42 (6): through a Redis outage the publisher retries a step's write for about a minute
    (`publish_retries`), but the engine thread gave up its blocked `put_output` after
    `output_timeout_s` (30 s) and died: an outage between the two restarted the pod and spent an
    attempt of every running request. The engine thread must wait while the publisher is still
    retrying (here an outage of 4 s of retries against an output timeout of 3 s, a queue of one)."""
    r, pool = redis_client, "handback-outage"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    faults.configure("decode.publish@2-8:down")  # seven tries in a row: about 4 s of the publisher's backoff
    try:
        async with Pod(r, engine, redis_url, pool, publish_coalesce_steps=1, output_queue_size=1) as pod:
            pod.eloop.output_timeout_s = 3.0  # (longer than one pause of the publisher's backoff, 1.5 s at most here)
            pod.eloop.steps_per_dispatch = 1  # a call per step, a batch per call: the queue fills at once
            req = await _publish_ready(r, engine, store, address, pool, "outage", max_tokens=40)
            st = await _until(r, pod, pool, req.request_id, lambda st: st["finished"] or pod.eloop.error, rounds=400)
            assert pod.eloop.error is None, f"the engine thread died during an outage the publisher rode out: " \
                                            f"{pod.eloop.error!r}"
            assert faults.raised["decode.publish"] == 7, "the outage never happened: the test proves nothing"
            assert st["finished"] and st["indices"] == list(range(1, 40)) and not st["resumed"], st
    finally:
        await server.stop(None)


async def test_a_hand_back_owed_too_long_fails_its_request_clearly(redis_url, redis_client, engine):
    """Issue 42 (6): a hand back that every recovery round fails to write (an error that repeats,
    not only Redis down) was owed for ever: its client waited out its deadline. Owed past
    `give_up_after_s`, the request is failed with a clear error (out of the running hash, its
    finish written) and its entry acked."""
    r, pool = redis_client, "handback-owed-forever"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    faults.configure("decode.pull@1,decode.handback@1+")  # every hand back fails, for ever
    try:
        async with Pod(r, engine, redis_url, pool) as pod:
            pod.io.handback.give_up_after_s = 1.0
            req = await _publish_ready(r, engine, store, address, pool, "owed-forever")
            st = await _until(r, pod, pool, req.request_id,
                              lambda st: st["finished"] and st["unacked"] == 0 and not pod.io.handback.owed)
            assert faults.raised["decode.handback"] >= 2, "the hand back never failed: the test proves nothing"
            ends = [f for _id, f in await r.xrange(KS.token_stream(req.request_id)) if b"f" in f]
            assert ends and ends[-1][b"f"] == b"error" and b"giving up" in ends[-1][b"e"], \
                f"the request got no clear error: {ends}, owed {pod.io.handback.owed_resumes}"
            assert st["unacked"] == 0 and not st["owned"] and not st["resumed"] and not pod.io.handback.owed, st
    finally:
        await server.stop(None)


async def test_a_dead_colocated_pods_admission_claims_are_recovered_once(redis_url, redis_client, engine):
    """Issue 42 (2): colocated decode pods claim admission entries under the prefill group, and
    no prefill pod is there to reclaim a dead one's. A pod killed between its claim and its
    ownership write stranded the request (until its first-token timeout); one killed after left
    the entry pending for ever (the backlog the gateway's 429 and the planner read). A live
    colocated pod must recover both, each request resumed once, and ack both entries."""
    from tandem_core.bus import admission

    r, pool, dead = redis_client, "handback-colocated", "decode-colocated-dead"
    await groups.ensure_groups(r, KS, pool)
    stream = KS.admission_stream(pool, "normal", 0)
    before = GenerationRequest("coloc-before-own", [256, 65, 66], MAX_TOKENS, SamplingParams(), ignore_eos=True)
    after = GenerationRequest("coloc-after-own", [256, 67, 68], MAX_TOKENS, SamplingParams(), ignore_eos=True)
    for req in (before, after):
        await admission.enqueue_request(r, KS, pool, req, 1000)
    got = await groups.claim(r, [stream], keys.PREFILL_GROUP, dead, 2, None)  # the dead pod's claim
    assert len(got) == 2
    await r.hset(KS.running_key(dead, 0), after.request_id, after.to_json())  # it owned one, then died
    async with Pod(r, engine, redis_url, pool, colocated=True, reclaim_min_idle_ms=1) as pod:
        pod.io.peers.since = pod.io.peers.clock() - 3600  # (its heartbeats would have made peers judgeable)
        states = {}
        for req in (before, after):
            states[req.request_id] = await _until(r, pod, pool, req.request_id, lambda st: st["finished"])
        pending = (await r.xpending(stream, keys.PREFILL_GROUP))["pending"]
        for req in (before, after):
            st = states[req.request_id]
            assert st["finished"] and st["indices"] == list(range(MAX_TOKENS)), f"{req.request_id} never ran: {st}"
            assert len(st["resumed"]) <= 1, f"{req.request_id} resumed twice: {st['resumed']}"
        assert pending == 0, "the dead pod's admission entries are still pending"
        assert not await r.hexists(KS.running_key(dead, 0), after.request_id)


async def test_a_steal_claim_whose_reply_was_lost_is_taken_again_at_once(redis_url, redis_client, engine,
                                                                          monkeypatch):
    """Issue 42 (3): the steal pass's XREADGROUP runs in Redis but its reply is lost with the
    connection (injected: the real command, then a ConnectionError). The entry is pending to this
    live pod, which never saw it, and not in `retake_own`'s sources: it waited for the stale reclaim
    (60 s) while its KV lease ran. The stream is now looked at again at once."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from tandem_core import redis_client as rc

    r, pool = redis_client, "handback-steal-lost"
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    req = GenerationRequest("steal-lost-reply", [256, 65, 66], MAX_TOKENS, SamplingParams(), ignore_eos=True,
                            decode_pod="pod-away-3")
    payload = engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling))
    held = store.put(req.request_id, payload)
    pipe = r.pipeline(transaction=False)
    ready.add_ready(pipe, KS, pool, ready.ReadyNotice(req, address, held.capability, payload.nbytes, "p0",
                                                       payload.first_token), 1000)
    await pipe.execute()
    lost = {"n": 0}
    real = rc.xreadgroup

    async def xreadgroup(client, group, consumer, stream, count):
        got = await real(client, group, consumer, stream, count)
        if "pod-away-3" in stream and not lost["n"] and got:
            lost["n"] += 1
            raise RedisConnectionError("injected: the steal claim ran, its reply lost with the connection")
        return got

    monkeypatch.setattr(rc, "xreadgroup", xreadgroup)
    try:
        async with Pod(r, engine, redis_url, pool, affinity_wait_ms=1) as pod:
            st = await _until(r, pod, pool, req.request_id, lambda st: st["finished"])
            assert lost["n"] == 1, "the injected failure never fired: the test proves nothing"
            assert st["finished"] and st["indices"] == list(range(1, MAX_TOKENS)), \
                f"the stolen entry whose reply was lost never ran: {st}"
    finally:
        await server.stop(None)


@pytest.fixture(scope="module")
def chunking_engine():
    """The tiny model with chunks of 8: a prompt over 8 tokens is seated while a stream runs."""
    return load_engine("tiny", slots=SLOTS, max_len=64, prefill_buckets=(16, 64), prefix_chunk=8)


async def test_a_seated_prompt_is_handed_back_by_a_drain_and_runs_once_elsewhere(redis_url, redis_client,
                                                                                  chunking_engine):
    """A colocated pod drains (its deadline passed) while a long prompt is seated in a row, its
    chunks beside a running stream's steps and no token of it out yet: both requests are handed
    back, and a pod started after serves each once, every index once."""
    from decode_svc.app import _drain
    from tandem_core.bus import admission

    r, pool = redis_client, "handback-seated"
    await groups.ensure_groups(r, KS, pool)
    running = GenerationRequest("seated-beside", [256, 65, 66], 40, SamplingParams(), ignore_eos=True)
    long = GenerationRequest("seated-long", [256] + list(range(70, 100)), 8, SamplingParams(), ignore_eos=True)
    faults.configure("decode.step@1+:sleep40")  # each call 40 ms: the long prompt's 4 chunks take 160
    async with Pod(r, chunking_engine, redis_url, pool, colocated=True) as pod:
        pod.eloop.prefill_chunk_tokens = 8
        await admission.enqueue_request(r, KS, pool, running, 1000)
        st = await _until(r, pod, pool, running.request_id, lambda st: len(st["indices"]) >= 3)
        assert len(st["indices"]) >= 3 and not st["finished"], st
        await admission.enqueue_request(r, KS, pool, long, 1000)
        for _ in range(200):
            if any(a.seated for a in pod.table.snapshot()):
                break
            await asyncio.sleep(0.005)
        seated = [a.req.request_id for a in pod.table.snapshot() if a.seated]
        assert seated == [long.request_id], f"the long prompt was never seated: {pod.table.snapshot()}"
        assert not (await _state(r, pod, pool, long.request_id))["indices"], "its first token is out already"
        await _drain(pod.io, 0)
    faults.configure("")
    for req in (running, long):
        st = await _state(r, pod, pool, req.request_id)
        assert len(st["resumed"]) == 1, f"{req.request_id} not handed back once: {st['resumed']}"
    async with Pod(r, chunking_engine, redis_url, pool, colocated=True, reclaim_min_idle_ms=1) as after:
        for req in (running, long):
            st = await _until(r, after, pool, req.request_id, lambda st: st["finished"])
            # every index once: a second run of it would have written some index again
            assert st["finished"] and sorted(st["indices"]) == list(range(req.max_tokens)), \
                f"{req.request_id}: {await r.xrange(KS.token_stream(req.request_id))}"
        stream = KS.admission_stream(pool, "normal", 0)
        for _ in range(100):  # (a bound on the wait: the recovery rounds run every 0.2 s)
            pending = await r.xpending_range(stream, keys.PREFILL_GROUP, "-", "+", 10)
            if not pending:
                break
            await asyncio.sleep(0.05)
        assert not pending, f"the drained pod's admission entries are still pending: {pending}"
