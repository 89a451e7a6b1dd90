"""A request handed back for KV blocks (tandem_core/bus/recovery.py `preempt`) spends no attempt
for its first `free_preempts` hand-backs; each one past them spends one, so a request that keeps
being the newest on full paged pods ends with a clear error after max_attempts more instead of
going round for ever. Real Redis."""
from __future__ import annotations

from tandem_core import keys
from tandem_core.bus import recovery
from tandem_core.types import GenerationRequest, SamplingParams

KS = keys.KeySpace(1)
POOL = "cap"


async def _hand_back(r, req: GenerationRequest, free: int) -> tuple[str, GenerationRequest | None]:
    """Own `req` as pod d0 would, hand it back; the request the admission stream got (None if none)."""
    await r.hset(KS.running_key("d0", KS.request_shard(req.request_id)), req.request_id, req.to_json())
    before = await r.xlen(KS.admission_stream(POOL, "high", 0))
    outcome = await recovery.preempt(r, KS, POOL, req, owner="d0", maxlen=100, max_attempts=2, token_ttl_s=60,
                                     token_maxlen=100, why="KV blocks ran out", free_preempts=free)
    entries = await r.xrange(KS.admission_stream(POOL, "high", 0))
    again = GenerationRequest.from_json(entries[-1][1][b"req"]) if len(entries) > before else None
    return outcome, again


async def test_hand_backs_past_the_free_ones_spend_attempts_and_then_fail_clearly(redis_client):
    r = redis_client
    req = GenerationRequest("cap-1", [1, 2, 3], 50, SamplingParams())
    seen = []
    for _ in range(6):
        outcome, again = await _hand_back(r, req, free=3)
        seen.append((outcome, req.preempted, req.attempt))
        if again is None:
            break
        req = again
    # three free hand-backs, then attempts 1 and 2, then past max_attempts (2): a clear failure
    assert [s[0] for s in seen] == ["resumed"] * 5 + ["failed"], seen
    assert [(p, a) for _o, p, a in seen] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (5, 2)], seen
    last = await r.xrange(KS.token_stream("cap-1"))
    assert any(b"e" in f or b"f" in f for _id, f in last), last  # the request ended with an error written
