"""A prefill pod runs the claimed prompts of one length bucket together, through a real prefill
worker, a real Redis and the real tiny model: prompts claimed in one read share one engine call
(up to `prefill_batch_tokens`), each still gets its own token 0 (the one its prefill alone gives),
its own held KV, ready notice and ack; a bad prompt in the batch fails alone with its own error;
and a budget of one bucket runs them one call each."""
from __future__ import annotations

import pytest

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from prefill_svc.worker import PrefillWorker
from tandem_core import keys

KS = keys.KeySpace(1)
from tandem_core.bus import admission, groups, token_stream
from tandem_core.scheduling import PriorityRotation
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import FINISH_ERROR, GenerationRequest, SamplingParams
from tandem_engine import load_engine


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=1, max_len=64, prefill_buckets=(16, 64))


def worker_for(redis_url, r, engine, pool: str, **kw) -> PrefillWorker:
    s = PrefillSettings(redis=RedisConfig(url=redis_url), engine=EngineConfig(model="tiny", max_len=64), pool=pool,
                        recover_interval_s=0.1, claim_block_ms=50, **kw)
    return PrefillWorker(s, engine, r, KS, KVStore(1 << 30, 60), "127.0.0.1:1", f"prefill-{pool}")


async def run_round(r, w: PrefillWorker, reqs: list[GenerationRequest]) -> dict[str, list]:
    await groups.ensure_groups(r, KS, w.s.pool)
    for req in reqs:
        await admission.enqueue_request(r, KS, w.s.pool, req, 1000)
    await w._ensure_groups()
    await w.claim_round(PriorityRotation(KS, w.s.pool, w.s.priority_high_weight))
    return {req.request_id: [token_stream.token_event(eid, f)
                             for eid, f in await r.xrange(KS.token_stream(req.request_id))] for req in reqs}


def prompts(engine, count: int, seed: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(0, engine.info.vocab_size, int(rng.integers(17, 65))).tolist() for _ in range(count)]


def greedy_alone(engine, ids) -> int:
    return engine.prefill(ids, SamplingParams()).first_token


async def test_prompts_claimed_together_share_one_engine_call(redis_url, any_redis, engine):
    r, pool = any_redis, "batch-one-call"
    w = worker_for(redis_url, r, engine, pool)
    ps = prompts(engine, 4, seed=1)
    reqs = [GenerationRequest(f"b{i}", p, 8) for i, p in enumerate(ps)]
    events = await run_round(r, w, reqs)
    assert w.prefiller.engine_calls == 1, "four prompts of one bucket, claimed together, took several engine calls"
    assert w.prefiller.prefilled == 4
    for req in reqs:
        (ev,) = events[req.request_id]
        assert (ev.index, ev.finish_reason) == (0, None)
        assert ev.token_id == greedy_alone(engine, req.prompt_ids)
        assert w.store.get(req.request_id) is not None  # held for its decode pod
    stream = KS.admission_stream(pool, reqs[0].priority, KS.request_shard(reqs[0].request_id))
    assert await r.xlen(stream) == 0  # every entry acked


async def test_a_bad_prompt_in_a_batch_fails_alone(redis_url, any_redis, engine):
    r, pool = any_redis, "batch-bad"
    w = worker_for(redis_url, r, engine, pool)
    ps = prompts(engine, 3, seed=2)
    reqs = [GenerationRequest(f"g{i}", p, 8) for i, p in enumerate(ps)]
    bad_ids = [1] * 30 + [engine.info.vocab_size + 7]  # the 64 bucket, as the others: in their batch
    reqs.insert(1, GenerationRequest("bad", bad_ids, 8))
    events = await run_round(r, w, reqs)
    assert w.prefiller.engine_calls == 1  # the four shared a call, which failed: then one at a time
    (bad,) = events["bad"]
    assert bad.finish_reason == FINISH_ERROR and "prompt token ids" in bad.error
    assert w.store.get("bad") is None
    for req in reqs:
        if req.request_id == "bad":
            continue
        (ev,) = events[req.request_id]
        assert ev.finish_reason is None and ev.token_id == greedy_alone(engine, req.prompt_ids)


async def test_a_budget_of_one_prompt_runs_one_call_each(redis_url, any_redis, engine):
    r, pool = any_redis, "batch-budget"
    w = worker_for(redis_url, r, engine, pool, prefill_batch_tokens=64)  # one 64-token bucket a call
    ps = prompts(engine, 3, seed=3)
    reqs = [GenerationRequest(f"u{i}", p, 8) for i, p in enumerate(ps)]
    events = await run_round(r, w, reqs)
    assert w.prefiller.engine_calls == 3
    for req in reqs:
        assert events[req.request_id][0].token_id == greedy_alone(engine, req.prompt_ids)
