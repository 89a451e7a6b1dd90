"""Resuming a request after a failure, from what Redis already holds.

A request's token stream is the source of truth for what the client has been promised: tokens
0..k are there, in order. A request that lost its KV or its decode slot (prefill pod gone before
the pull, decode pod killed, drain deadline) resumes as a new admission entry whose prompt is the
original prompt plus tokens 0..k and whose `start_index` is k+1. With greedy sampling (or a seed)
the continuation is the same tokens an unbroken run would give; the gateway drops any index it
has already relayed, so the client sees one unbroken stream.
"""
from __future__ import annotations

import dataclasses
import logging

import redis.asyncio as aioredis

from tandem_core import faults, keys
from tandem_core.keys import KeySpace
from tandem_core.bus import cancel, groups, token_stream
from tandem_core.types import FINISH_ERROR, GenerationRequest

log = logging.getLogger(__name__)


async def streamed_tokens(r: aioredis.Redis, ks: KeySpace, request_id: str) -> tuple[list[int], bool]:
    """The contiguous tokens 0..k in the request's token stream, and whether it has finished."""
    entries = await r.xrange(ks.token_stream(request_id))
    got: dict[int, int] = {}
    finished = False
    for eid, f in entries:
        try:
            i, t = int(f[b"i"]), int(f[b"t"])
        except (KeyError, ValueError) as e:  # a bad entry costs no reader (the gateway fails its request)
            log.warning("skipping malformed token stream entry %r of %s (%s: %s)", eid,
                        ks.token_stream(request_id), type(e).__name__, e)
            continue
        if b"f" in f:
            finished = True
        if t >= 0 and i not in got:
            got[i] = t
    out: list[int] = []
    while len(out) in got:
        out.append(got[len(out)])
    return out, finished


# A resume in one step (`resume`): KEYS[1] the resume marker of (request, index), KEYS[2] the
# owner's running hash (KEYS[1] again when there is no owner), KEYS[3] the admission stream, all in
# the request's slot; ARGV: request id, the resume's attempt, marker TTL, maxlen, the resumed
# request's JSON, '1' when KEYS[2] is an owner's hash. The marker holds the attempt it resumed: two
# paths noticing the same failure carry the same attempt and only the first enqueues (0: a
# duplicate); a second failure of the resumed request, from the
# same index before any new token, carries the next attempt and is resumed again. (A marker of an
# older release holds '1': it still refuses a duplicate of a first resume.) The owner's field goes
# only while it holds the failed instance (an attempt below the resume's): a duplicate arriving
# after the resumed instance landed on the same pod leaves that instance owned (its field taken
# out, nothing would resume it if that pod died too). cjson reads the field (a resume is rare); a
# field it cannot read goes, as before.
_RESUME = """
local done = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if ARGV[6] == '1' then
  local held = redis.call('HGET', KEYS[2], ARGV[1])
  local ok, req = pcall(cjson.decode, held or '{}')
  if held and (not ok or (tonumber(req['attempt'] or 0) or 0) < tonumber(ARGV[2])) then
    redis.call('HDEL', KEYS[2], ARGV[1])
  end
end
if done >= tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'rid', ARGV[1], 'req', ARGV[5])
return 1
"""


async def resume(r: aioredis.Redis, ks: KeySpace, pool: str, original: GenerationRequest, *, max_attempts: int,
                 maxlen: int, token_ttl_s: int, token_maxlen: int, why: str, owner: str | None = None,
                 marker_ttl_s: int = 120) -> str:
    """Re-enqueue `original` from the tokens streamed so far.

    `owner`: the decode worker whose running hash holds the request; its field is removed in the
    same script as the re-enqueue (`_RESUME`), so the request is never owned twice nor by nobody,
    and a retry after a lost reply finds the whole resume done or none of it.
    Returns "finished" (nothing to do, or this failure was resumed already), "resumed", or
    "failed" (attempts exhausted: the request gets a clear error instead of looping forever).
    `marker_ttl_s`: how long a resume from one index, at one attempt, refuses a duplicate.
    """
    tokens, finished = await streamed_tokens(r, ks, original.request_id)
    shard = ks.request_shard(original.request_id)  # every key below shares its tag (one slot)
    if finished or await cancel.cancelled(r, ks, [original.request_id]):
        if owner:
            await r.hdel(ks.running_key(owner, shard), original.request_id)
        return "finished"
    attempt = original.attempt + 1
    if len(tokens) >= original.max_tokens or attempt > max_attempts:
        return await _give_up(r, ks, original, tokens, attempt, why, owner, token_ttl_s, token_maxlen)
    base = original.prompt_ids[: len(original.prompt_ids) - original.start_index]
    # (priority high: it has waited once already; decode_pod None: any decode pod, the one it was
    # steered to may be the one that failed)
    again = dataclasses.replace(original, prompt_ids=base + tokens, start_index=len(tokens), attempt=attempt,
                                priority="high", decode_pod=None)
    # One script: the marker, the owner's field out and the re-enqueue, whole or not at all, so a
    # retry after a connection that died inside it finds all of it done or none of it.
    marker, running = ks.resume_marker(original.request_id, len(tokens)), ""
    if owner:
        running = ks.running_key(owner, shard)
    done = await r.eval(_RESUME, 3, marker, running or marker, ks.admission_stream(pool, again.priority, shard),
                        original.request_id, attempt, marker_ttl_s, maxlen, again.to_json(), "1" if owner else "")
    faults.hit("recovery.resume")  # (a test aid: the connection dies here, the script's writes made, its reply lost)
    if ks.shards > 1:  # after the script: the bell is in another slot (rung again by a retry: harmless)
        bell = r.pipeline(transaction=False)
        groups.ring(bell, ks, pool, keys.PREFILL_GROUP)
        await bell.execute()
    if not done:  # resumed from this index at this attempt already: two paths noticed one failure
        return "finished"
    log.info("resumed request_id=%s from index %d (attempt %d): %s", original.request_id, len(tokens), attempt, why)
    return "resumed"


async def _give_up(r: aioredis.Redis, ks: KeySpace, original: GenerationRequest, tokens: list[int], attempt: int, why: str,
                   owner: str | None, token_ttl_s: int, token_maxlen: int) -> str:
    """Finish the request in place: "length" when every token is already out (only the finish
    entry was lost), else a clear error once its attempts are spent."""
    done = len(tokens) >= original.max_tokens
    pipe = r.pipeline(transaction=True)
    if owner:
        pipe.hdel(ks.running_key(owner, ks.request_shard(original.request_id)), original.request_id)
    token_stream.add_tokens(pipe, ks, original.request_id, len(tokens), [], "length" if done else FINISH_ERROR,
                            token_ttl_s, token_maxlen,
                            error=None if done else f"request failed {attempt - 1} times ({why}); giving up")
    await pipe.execute()
    return "finished" if done else "failed"


# Hand a request back for the owner's own reason (its KV ran out): only while `owner` still owns it
# (its field in the owner's running hash), taken out of that hash and enqueued again in one step.
_PREEMPT = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'rid', ARGV[1], 'req', ARGV[3])
return 1
"""


async def preempt(r: aioredis.Redis, ks: KeySpace, pool: str, original: GenerationRequest, *, owner: str,
                  maxlen: int, max_attempts: int, token_ttl_s: int, token_maxlen: int, why: str,
                  counted: bool = False, free_preempts: int | None = None) -> str:
    """Re-enqueue `original`, which decode pod `owner` runs and stops running of its own accord
    (its paged KV ran out: decode_svc/loop.py `_make_room`), from the tokens streamed so far.

    Unlike `resume` this is no failure: the attempt is not counted (unless `counted`: the request
    did not fit even alone; or it was handed back more than `free_preempts` times already, so a
    request that keeps being the newest on full pods ends, after max_attempts more, with a clear
    error instead of going round for ever), and no resume marker is set or read, since a request may be handed
    back from the same index more than once (it went into a row and out again before its first new
    token) and a marker would take the second for a duplicate and drop it. What stops a second
    resume here is ownership: the owner's running-hash field is taken and the entry written in one
    script, or nothing is written ("gone": someone else has it now). The caller MUST have written
    every token it streamed for the request before this (resuming from fewer only repeats indices
    the gateway drops; from more is impossible). Returns "resumed", "finished", "failed" or "gone"."""
    tokens, finished = await streamed_tokens(r, ks, original.request_id)
    shard = ks.request_shard(original.request_id)
    running = ks.running_key(owner, shard)
    if finished or await cancel.cancelled(r, ks, [original.request_id]):
        await r.hdel(running, original.request_id)
        return "finished"
    preempted = original.preempted + 1
    if free_preempts is not None and preempted > free_preempts:
        counted = True
    attempt = original.attempt + (1 if counted else 0)
    if len(tokens) >= original.max_tokens or attempt > max_attempts:
        return await _give_up(r, ks, original, tokens, attempt, why, owner, token_ttl_s, token_maxlen)
    base = original.prompt_ids[: len(original.prompt_ids) - original.start_index]
    # (decode_pod None: the pod it was steered to had no blocks for it)
    again = dataclasses.replace(original, prompt_ids=base + tokens, start_index=len(tokens), attempt=attempt,
                                preempted=preempted, priority="high", decode_pod=None)  # it has waited once already
    stream = ks.admission_stream(pool, again.priority, shard)
    if not await r.eval(_PREEMPT, 2, running, stream, original.request_id, maxlen, again.to_json()):
        return "gone"
    if ks.shards > 1:  # after the script: the bell is in another slot
        bell = r.pipeline(transaction=False)
        groups.ring(bell, ks, pool, keys.PREFILL_GROUP)
        await bell.execute()
    log.info("handed back request_id=%s from index %d (attempt %d): %s", original.request_id, len(tokens),
             attempt, why)
    return "resumed"
