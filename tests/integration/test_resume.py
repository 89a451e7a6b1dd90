"""Issue 42 (1): `recovery.resume` (tandem_core/bus/recovery.py) on a real Redis, one Redis and a
Redis Cluster. A resume is one step, whole or nothing: a retry after the connection died inside it
(the `recovery.resume` fault site: Redis looks down with the resume's writes made) enqueues the
request exactly once and leaves it unowned, never neither owned, queued nor finished. Two paths
noticing the same failure resume it once; a genuine second failure of the resumed request, from the
same index before any new token, is resumed again, not taken for "finished"."""
from __future__ import annotations

import pytest

from tandem_core import faults
from tandem_core.bus import conn, groups, recovery, token_stream
from tandem_core.types import GenerationRequest

POOL = "resume-test"
OWNER = "decode-resume"


@pytest.fixture(autouse=True)
def _no_faults_after():
    yield
    faults.configure("")


async def _setup(r, ks, rid: str) -> GenerationRequest:
    """A request that streamed tokens 0..2 and is owned by OWNER's running hash."""
    await groups.ensure_groups(r, ks, POOL)
    req = GenerationRequest(rid, [5, 6, 7], 16)
    pipe = r.pipeline(transaction=False)
    token_stream.add_tokens(pipe, ks, rid, 0, [11, 12, 13], None, 60, 1000)
    await pipe.execute()
    await r.hset(ks.running_key(OWNER, ks.request_shard(rid)), rid, req.to_json())
    return req


async def _resume(r, ks, req: GenerationRequest) -> str:
    return await recovery.resume(r, ks, POOL, req, max_attempts=3, maxlen=1000, token_ttl_s=60, token_maxlen=1000,
                                 why="test", owner=OWNER)


async def _queued(r, ks, rid: str) -> list[GenerationRequest]:
    stream = ks.admission_stream(POOL, "high", ks.request_shard(rid))
    return [q for q in (GenerationRequest.from_json(f[b"req"]) for _id, f in await r.xrange(stream))
            if q.request_id == rid]


async def test_a_resume_retried_after_the_connection_died_inside_it_enqueues_once(any_redis, any_keys):
    r, ks = any_redis, any_keys
    req = await _setup(r, ks, "resume-flap")
    faults.configure("recovery.resume@1:down")
    with pytest.raises(conn.REDIS_DOWN):
        await _resume(r, ks, req)
    assert faults.raised["recovery.resume"] == 1, "the fault never fired: the test proves nothing"
    outcome = await _resume(r, ks, req)  # the retry (handback.py's retry_redis, the next recovery round)
    queued = await _queued(r, ks, req.request_id)
    assert [(q.start_index, q.attempt) for q in queued] == [(3, 1)], \
        f"after a retry ({outcome!r}) the request is queued {len(queued)} times: it must be exactly once"
    assert not await r.hexists(ks.running_key(OWNER, ks.request_shard(req.request_id)), req.request_id)


async def test_the_same_failure_resumes_once_and_a_second_failure_resumes_again(any_redis, any_keys):
    r, ks = any_redis, any_keys
    req = await _setup(r, ks, "resume-twice")
    assert await _resume(r, ks, req) == "resumed"
    assert await _resume(r, ks, req) == "finished"  # the same failure noticed by a second path
    (again,) = await _queued(r, ks, req.request_id)
    assert (again.start_index, again.attempt) == (3, 1)
    # the resumed request is owned by another pod, which fails too before its first new token
    await r.hset(ks.running_key(OWNER, ks.request_shard(req.request_id)), req.request_id, again.to_json())
    assert await _resume(r, ks, again) == "resumed", "a genuine second failure from the same index was dropped"
    assert [(q.start_index, q.attempt) for q in await _queued(r, ks, req.request_id)] == [(3, 1), (3, 2)]
    assert await _resume(r, ks, again) == "finished"
    assert len(await _queued(r, ks, req.request_id)) == 2


async def test_a_duplicate_resume_leaves_the_resumed_instance_owned_on_the_same_pod(any_redis, any_keys):
    """Two paths notice one failure; the resumed request lands on the same decode pod before the
    second path's resume runs: that duplicate must not take the new instance's running field out
    (it would run owned by nobody, and a death of that pod would resume nothing)."""
    r, ks = any_redis, any_keys
    req = await _setup(r, ks, "resume-same-pod")
    running = ks.running_key(OWNER, ks.request_shard(req.request_id))
    assert await _resume(r, ks, req) == "resumed"
    assert not await r.hexists(running, req.request_id)  # the failed instance's field went with the resume
    (again,) = await _queued(r, ks, req.request_id)
    await r.hset(running, req.request_id, again.to_json())  # the same pod claimed the resumed request
    assert await _resume(r, ks, req) == "finished"  # the second path, late, for the first failure
    held = await r.hget(running, req.request_id)
    assert held is not None and GenerationRequest.from_json(held).attempt == 1, \
        "a duplicate resume took the resumed instance's running field out"
    assert len(await _queued(r, ks, req.request_id)) == 1


async def test_a_malformed_token_entry_does_not_stop_a_resume(any_redis, any_keys):
    """Issue 42 (5): every reader of a token stream goes past an entry it cannot read. The
    resume's own read (`streamed_tokens`, also the prefill pod's lease and reclaim checks) raised
    on it: the hand back failed every round, and a prefill pod's claim round (its lease check)
    failed with it, the pod stopped and was restarted into the same entry."""
    r, ks = any_redis, any_keys
    req = await _setup(r, ks, "resume-garbled")
    await r.xadd(ks.token_stream(req.request_id), {"i": "three", "t": "x"})
    assert await recovery.streamed_tokens(r, ks, req.request_id) == ([11, 12, 13], False)
    assert await _resume(r, ks, req) == "resumed"
