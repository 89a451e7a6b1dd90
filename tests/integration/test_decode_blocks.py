"""A decode pod on a paged engine counts its capacity in KV blocks (decode_svc/blocks.py): real
Redis, real gRPC KV server, real engines (a paged one decodes; a slot-layout one prefills the
ready notices and gives the reference tokens).

1. Claims stop at the block budget, not the row count: 8 rows, but blocks for 6 requests.
2. A pool that runs out mid-generation hands the newest request back (resumed from its streamed
   tokens; here the same pod, colocated, prefills it again) and every request still ends with
   exactly the greedy tokens of an unconstrained run: none lost, none written twice.
3. The slot layout has no block budget at all: the pod behaves as before (tests/integration/
   test_decode_claims.py covers its claims, which this leaves alone).
"""
from __future__ import annotations

import asyncio

import pytest

from decode_svc.blocks import BlockBudget
from decode_svc.bridge import Bridge
from decode_svc.io import DecodeIO
from decode_svc.loop import EngineLoop
from decode_svc.requests import RequestTable
from decode_svc.settings import DecodeSettings
from prefill_svc.kv_store import KVStore
from prefill_svc.service import KVTransferServicer
from tandem_core import grpc_util, keys
from tandem_core.bus import admission, groups, ready
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine
from tandem_proto import kv_pb2_grpc

KS = keys.KeySpace(1)
ROWS = 8
MAX_LEN = 64
BLOCK = 8
BUCKETS = (16, 32, 64)


def _paged(blocks: int):
    return load_engine("tiny", slots=ROWS, max_len=MAX_LEN, prefill_buckets=BUCKETS,
                       kv_block_size=BLOCK, kv_blocks=blocks)


@pytest.fixture(scope="module")
def reference():
    """The prefill pod's engine, and the single-slot reference run."""
    return load_engine("tiny", slots=1, max_len=MAX_LEN, prefill_buckets=BUCKETS)


def _greedy(eng, prompt: list[int], n: int) -> list[int]:
    """Tokens 0..n-1 of one request alone on a slot-layout engine (no EOS stop: ignore_eos)."""
    prefix = eng.prefill(prompt, SamplingParams())
    out = [prefix.first_token]
    state = eng.insert(prefix, eng.init_state(), 0, SamplingParams())
    while len(out) < n:
        state, toks = eng.generate(state, 1)
        out.append(int(toks[0]))
    eng.free(state, 0)
    return out


async def _kv_server(store):
    server = grpc_util.make_server(8 << 20)
    kv_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(store, 1 << 16, lambda _r: None), server)
    port = grpc_util.bind(server, "127.0.0.1", 0)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _tokens(r, rid: str) -> tuple[list[tuple[int, int]], bool]:
    entries = await r.xrange(KS.token_stream(rid))
    return [(int(f[b"i"]), int(f[b"t"])) for _id, f in entries if int(f[b"t"]) >= 0], any(
        b"f" in f for _id, f in entries)


class _Pod:
    """A decode pod's parts (as decode_svc/app.py wires them) around one engine."""

    def __init__(self, s: DecodeSettings, r, engine, worker_id: str = "decode-blocks") -> None:
        self.table = RequestTable(s.slots)
        self.bridge = Bridge(s.slots, 64, asyncio.get_running_loop())
        self.blocks = BlockBudget.of(engine, s.kv_reserve_steps or None)
        self.eloop = EngineLoop(engine, self.table, self.bridge, blocks=self.blocks)
        self.io = DecodeIO(s, r, KS, self.table, self.eloop, self.bridge, worker_id)
        self.stop, self.done = asyncio.Event(), asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self):
        await self.io.claims.ensure_own_groups()  # (its per-pod ready streams, as the app does at start)
        self.eloop.start()
        self.tasks = [asyncio.create_task(self.io.claims.claim_loop(self.stop)),
                      asyncio.create_task(self.io.publisher.publish_loop(self.done))]
        return self

    async def __aexit__(self, *exc):
        self.stop.set()
        await self.tasks[0]
        self.eloop.stop()
        self.done.set()
        await self.tasks[1]
        await self.io.puller.close()
        assert self.eloop.error is None, self.eloop.error


async def test_claims_stop_at_the_block_budget_not_the_row_count(redis_url, redis_client, reference):
    """12 blocks of 8 positions; 12 requests of a 3-token prompt and 8 tokens (at most 11 + 3
    positions of a multi-step call: 2 blocks each). The reserve is 1 block a row (4 steps), so a
    claim counts 1 + 1 blocks a request: at most 12 // 2 = 6 requests are on the pod at once,
    though it has 8 rows."""
    engine = _paged(12)
    r, pool, n, max_tokens = redis_client, "blocks-claims", 12, 8
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    for i in range(n):
        req = GenerationRequest(f"blk-{i}", [256, 65 + i, 66], max_tokens, SamplingParams(), ignore_eos=True)
        payload = reference.export_prefix(reference.prefill(req.prompt_ids, req.sampling))
        held = store.put(req.request_id, payload)
        pipe = r.pipeline(transaction=False)
        ready.add_ready(pipe, KS, pool, ready.ReadyNotice(req, address, held.capability, payload.nbytes, "p0",
                                                          payload.first_token), 1000)
        groups.ring(pipe, KS, pool, keys.DECODE_GROUP)
        await pipe.execute()
    s = DecodeSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=MAX_LEN),
                       pool=pool, slots=ROWS, claim_block_ms=50)
    budget = 12 // (1 + 1)
    peak_table = peak_redis = 0
    try:
        async with _Pod(s, r, engine) as pod:
            assert pod.blocks is not None and pod.blocks.per_row == 1
            for _ in range(600):
                peak_table = max(peak_table, pod.table.used + pod.table.pending)
                peak_redis = max(peak_redis, (await r.xpending(KS.ready_stream(pool, 0), keys.DECODE_GROUP))["pending"])
                done = [(await _tokens(r, f"blk-{i}"))[1] for i in range(n)]
                if all(done):
                    break
                await asyncio.sleep(0.02)
            assert all(done), f"only {sum(done)}/{n} requests finished"
            assert pod.eloop.stats.handed_back_for_blocks == 0
            assert engine.kv_blocks_free() == engine.kv_blocks_total  # every block came back
    finally:
        await server.stop(None)
    assert 1 <= peak_table <= budget < ROWS, f"{peak_table} requests on a pod with blocks for {budget}"
    assert peak_redis <= budget, f"claimed {peak_redis} ready entries with blocks for {budget}"
    for i in range(n):
        got, _ = await _tokens(r, f"blk-{i}")
        assert [i for i, _t in got] == list(range(1, max_tokens))
    assert store.held_bytes == 0


async def test_a_pool_that_runs_out_hands_the_newest_back_and_no_token_is_lost(redis_url, redis_client, reference,
                                                                                caplog):
    """12 blocks of 8 positions (96) for 4 requests that each grow to 5 + 40 = 45 positions (6
    blocks): they all start (prompts of 1 block), then the pool runs out as they grow, and the
    newest are handed back (to the admission stream: this colocated pod prefills them again from
    prompt + streamed tokens) until the rest fit. Every request ends with exactly the reference
    run's 40 tokens, each index written once."""
    engine = _paged(12)
    r, pool, n, max_tokens = redis_client, "blocks-handback", 4, 40
    await groups.ensure_groups(r, KS, pool)
    prompts = {f"grow-{i}": [256, 70 + i, 71 + i, 72, 73] for i in range(n)}
    want = {rid: _greedy(reference, p, max_tokens) for rid, p in prompts.items()}
    s = DecodeSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=MAX_LEN),
                       pool=pool, slots=ROWS, colocated=True, claim_block_ms=20, prefill_chunk_tokens=0)
    caplog.set_level("WARNING", logger="decode_svc.loop")
    async with _Pod(s, r, engine) as pod:
        for rid, p in prompts.items():
            await admission.enqueue(r, KS, pool, GenerationRequest(rid, p, max_tokens, SamplingParams(),
                                                                   ignore_eos=True), 1000)
        for _ in range(1500):
            done = [(await _tokens(r, rid))[1] for rid in prompts]
            if all(done):
                break
            await asyncio.sleep(0.02)
        assert all(done), f"only {sum(done)}/{n} requests finished"
        handed = pod.eloop.stats.handed_back_for_blocks
        assert handed >= 1, "the pool never ran out: the test does not test the hand-back"
        assert pod.io.handback.handed_back == handed and not pod.io.handback.owed
        assert engine.kv_blocks_free() == engine.kv_blocks_total
    # All four went into rows in stream order (1 block each fits at once); the first row short of a
    # block (at ~24 positions each) hands back the one inserted last.
    first = next(rec.getMessage() for rec in caplog.records if "handing back the newest" in rec.getMessage())
    assert first.endswith("['grow-3']"), first
    for rid in prompts:
        got, _ = await _tokens(r, rid)
        assert [i for i, _t in got] == list(range(max_tokens)), f"{rid}: indices {[i for i, _t in got]}"
        assert [t for _i, t in got] == want[rid], f"{rid}: tokens differ from the unconstrained run"
