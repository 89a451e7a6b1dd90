"""The admission streams: the only writer (`enqueue`, the gateway's) and the backlog readers.

Streams (keys.py): per pool, priority and shard, a shared admission stream; per prefill pod a
per-pod stream of the same shape (cache-aware routing, gateway/prefix_route.py), whose owners are
listed in `KeySpace.pod_streams_set`; and a direct stream (decode pods prefill those themselves).
Prefill pods read them through `bus.groups.claim`.

A prompt routed to prefill pod P goes to `ks.pod_admission_stream(pool, priority, P)` instead of
the shared admission stream, and P's id joins the set `ks.pod_streams_set(pool)`. Both writes are
one script (`enqueue`): a prefill pod reclaiming a dead P removes it from the set only when its
streams are empty (atomically, `forget_pod_streams`), so an entry can never land in a stream nobody
will look for.

What the pods MUST do for this to hold (prefill_svc): read their own per-pod stream before the
shared stream of the same priority, with consumer group `prefill` created at id 0 (the gateway
XADDs without creating the group, so entries written before the group exists must still be
delivered); XDEL every entry they ack, so XLEN is the backlog, as on the shared streams; drain a
dead pod's per-pod streams and remove it from the set. And advertise it: the gateway routes to a
pod only when its heartbeat `extra` carries `"prefix_cache"` with `"enabled": true`, and `"pool"`
equal to the gateway's when present (gateway.prefix_route.prefix_route_pods), so pods that do not
read per-pod streams (an older version's, another pool's) never get entries there.

The admission backlog the gateway bounds (429), predicts time to first token from and reports
(`/admin/cluster`, `vllm:num_requests_waiting`) is the shared streams plus every per-pod stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import redis.asyncio as aioredis

from tandem_core import keys
from tandem_core.keys import PRIORITIES  # noqa: F401 - the admission priorities, for services
from tandem_core.keys import KeySpace
from tandem_core.bus.groups import ring
from tandem_core.types import GenerationRequest


async def enqueue_request(r: aioredis.Redis, ks: KeySpace, pool: str, req: GenerationRequest, maxlen: int,
                          direct: bool = False) -> bytes:
    """XADD to the admission stream of the request's priority, or to the direct stream (decode
    pods prefill those themselves)."""
    shard = ks.request_shard(req.request_id)
    stream = ks.direct_stream(pool, shard) if direct else ks.admission_stream(pool, req.priority, shard)
    pipe = r.pipeline(transaction=False)
    pipe.xadd(stream, {"rid": req.request_id, "req": req.to_json()}, maxlen=maxlen, approximate=True)
    ring(pipe, ks, pool, keys.DECODE_GROUP if direct else keys.PREFILL_GROUP)
    return (await pipe.execute())[0]


async def admission_backlog(r: aioredis.Redis, ks: KeySpace, pool: str) -> int:
    """Admission entries not yet finished by a prefill, over all priorities.

    Workers XDEL every entry they ack, so XLEN is exactly undelivered + delivered-but-unacked
    (XINFO GROUPS' `lag` is unusable after deletions, and absent before Redis 7).
    """
    pipe = r.pipeline(transaction=False)
    for shard in ks.all_shards():
        for prio in keys.PRIORITIES:
            pipe.xlen(ks.admission_stream(pool, prio, shard))
        pipe.xlen(ks.direct_stream(pool, shard))
    return int(sum(await pipe.execute()))


async def pod_stream_owners(r: aioredis.Redis, ks: KeySpace, pool: str) -> list[str]:
    """Worker ids that may have per-pod admission streams in any shard (KeySpace.pod_streams_set)."""
    pipe = r.pipeline(transaction=False)
    for shard in ks.all_shards():
        pipe.smembers(ks.pod_streams_set(pool, shard))
    return sorted({_s(x) for members in await pipe.execute() for x in members})


_FORGET_POD = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 and redis.call('XLEN', KEYS[i]) > 0 then return 0 end
end
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('SREM', KEYS[1], ARGV[1])
return 1
"""


async def forget_pod_streams(r: aioredis.Redis, ks: KeySpace, pool: str, worker_id: str) -> bool:
    """Delete a dead pod's per-pod admission streams and its set entry, shard by shard, only if
    every one of the shard is empty (one script per shard: a routed XADD, which re-adds the set
    entry with it, lands before or after). True when no shard has any left."""
    gone = True
    for shard in ks.all_shards():
        names = [ks.pod_admission_stream(pool, p, worker_id, shard) for p in keys.PRIORITIES]
        gone &= bool(await r.eval(_FORGET_POD, 1 + len(names), ks.pod_streams_set(pool, shard), *names, worker_id))
    return gone


@dataclass(frozen=True)
class Backlog:
    """Admission entries not yet finished by a prefill, by where they wait."""

    shared: dict[str, int] = field(default_factory=dict)  # priority -> XLEN of the shared stream
    direct: int = 0  # the direct stream (decode pods prefill those)
    pods: dict[str, dict[str, int]] = field(default_factory=dict)  # worker id -> priority -> XLEN

    @property
    def total(self) -> int:
        return sum(self.shared.values()) + self.direct + sum(sum(p.values()) for p in self.pods.values())

    def of_priority(self, priority: str) -> dict[str, int]:
        """worker id -> entries in its per-pod stream of `priority` (the router's busy check)."""
        return {pod: n.get(priority, 0) for pod, n in self.pods.items()}


async def read_backlog(r: aioredis.Redis, ks: KeySpace, pool: str, known_pods: Sequence[str] = ()) -> Backlog:
    """The shared streams' lengths, the set of pods with per-pod streams, and the per-pod lengths.

    One round trip when every member of the set is in `known_pods` (the live prefill pods, whose
    lengths are read speculatively beside SMEMBERS); a second one only for members not known,
    i.e. dead pods whose streams are not drained yet."""
    known = list(dict.fromkeys(known_pods))
    shards = ks.all_shards()
    pipe = r.pipeline(transaction=False)
    for prio in keys.PRIORITIES:
        for shard in shards:
            pipe.xlen(ks.admission_stream(pool, prio, shard))
    for shard in shards:
        pipe.xlen(ks.direct_stream(pool, shard))
    for shard in shards:
        pipe.smembers(ks.pod_streams_set(pool, shard))
    _add_xlens(pipe, ks, pool, known)
    res = await pipe.execute()
    n, m = len(keys.PRIORITIES), len(shards)
    shared = {p: sum(int(x) for x in res[i * m:(i + 1) * m]) for i, p in enumerate(keys.PRIORITIES)}
    direct = sum(int(x) for x in res[n * m:(n + 1) * m])
    members = {_s(x) for group in res[(n + 1) * m:(n + 2) * m] for x in group}
    pods = _by_pod(ks, known, res[(n + 2) * m:])
    unknown = sorted(members - set(known))
    if unknown:
        pipe = r.pipeline(transaction=False)
        _add_xlens(pipe, ks, pool, unknown)
        pods.update(_by_pod(ks, unknown, await pipe.execute()))
    # Known live pods outside the set have no per-pod streams yet (all zero): keep them out.
    pods = {p: v for p, v in pods.items() if p in members or any(v.values())}
    return Backlog(shared, direct, pods)


class BacklogReader:
    """`read_backlog` for each admission, but with more than one key shard at most every
    `sharded_ttl_s`: then a read is 4 XLENs per shard and 2 per shard per prefill pod (hundreds on
    a Redis Cluster with 16 shards), and the bounds it feeds (429, the TTFT prediction, the
    router's busy check) tolerate a tenth of a second."""

    def __init__(self, sharded_ttl_s: float = 0.1) -> None:
        self.sharded_ttl_s = sharded_ttl_s
        self._last: tuple[float, Backlog] | None = None

    async def read(self, r: aioredis.Redis, ks: KeySpace, pool: str, known_pods: Sequence[str] = ()) -> Backlog:
        if ks.shards == 1:
            return await read_backlog(r, ks, pool, known_pods)
        now = time.monotonic()
        if self._last is None or now - self._last[0] > self.sharded_ttl_s:
            self._last = (now, await read_backlog(r, ks, pool, known_pods))
        return self._last[1]


async def total_backlog(r: aioredis.Redis, ks: KeySpace, pool: str, known_pods: Sequence[str] = ()) -> int:
    """Every admission entry waiting: the shared, direct and per-pod streams."""
    return (await read_backlog(r, ks, pool, known_pods)).total


# XADD unless this request id was enqueued already (its marker), then the marker (the entry id) and,
# for a per-pod stream, the pod's set entry: one script, so a retry after a lost reply is a no-op.
_ENQUEUE = """
local seen = redis.call('GET', KEYS[2])
if seen then return seen end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'rid', ARGV[1], 'req', ARGV[2])
redis.call('SET', KEYS[2], id, 'EX', ARGV[4])
if #KEYS > 2 then redis.call('SADD', KEYS[3], ARGV[5]) end
return id
"""
MARKER_TTL_S = 120  # longer than any hold (redis_hold_s) plus the retries of one admission


async def enqueue(r: aioredis.Redis, ks: KeySpace, pool: str, req: GenerationRequest, maxlen: int, *,
                  pod: str | None = None, direct: bool = False) -> bytes:
    """XADD the request to pod `pod`'s per-pod stream (with SADD of its id to the set), to the
    direct stream, or to the shared admission stream of its priority; returns the entry id.
    Idempotent by request id for MARKER_TTL_S: a second call returns the first call's entry id and
    writes nothing (the gateway retries an enqueue whose reply a Redis outage swallowed)."""
    got = await r.eval(*_enqueue_args(ks, pool, req, maxlen, pod, direct))
    if ks.shards > 1:  # wake the idle readers (another slot: after the script)
        pipe = r.pipeline(transaction=False)
        ring(pipe, ks, pool, keys.DECODE_GROUP if direct else keys.PREFILL_GROUP)
        await pipe.execute()
    return got if isinstance(got, bytes) else str(got).encode()


async def enqueue_many(r: aioredis.Redis, ks: KeySpace, pool: str, items: list[tuple[GenerationRequest, str | None, bool]],
                       maxlen: int) -> list[bytes | Exception]:
    """`enqueue` of many requests ((request, pod, direct) each) in one pipeline: one connection
    and one round trip for all of them (then one for the doorbells, with more than one shard).
    Each item's entry id, or the error its script got; a connection error raises for all (each
    enqueue is idempotent by request id, so all may be sent again)."""
    pipe = r.pipeline(transaction=False)
    for req, pod, direct in items:
        pipe.eval(*_enqueue_args(ks, pool, req, maxlen, pod, direct))
    res = await pipe.execute(raise_on_error=False)
    if ks.shards > 1:  # wake the idle readers, each group once (after the scripts)
        pipe = r.pipeline(transaction=False)
        for group in sorted({keys.DECODE_GROUP if direct else keys.PREFILL_GROUP for _r, _p, direct in items}):
            ring(pipe, ks, pool, group)
        await pipe.execute()
    return [x if isinstance(x, (bytes, Exception)) else str(x).encode() for x in res]


def _enqueue_args(ks: KeySpace, pool: str, req: GenerationRequest, maxlen: int, pod: str | None, direct: bool) -> list:
    shard = ks.request_shard(req.request_id)  # the stream, the marker and the set share its tag
    extra: list[str] = []
    args: list[str] = []
    if direct:
        stream = ks.direct_stream(pool, shard)
    elif pod is None:
        stream = ks.admission_stream(pool, req.priority, shard)
    else:
        stream = ks.pod_admission_stream(pool, req.priority, pod, shard)
        extra, args = [ks.pod_streams_set(pool, shard)], [pod]
    return [_ENQUEUE, 2 + len(extra), stream, ks.admitted_key(req.request_id), *extra,
            req.request_id, req.to_json(), maxlen, MARKER_TTL_S, *args]


def _add_xlens(pipe, ks: KeySpace, pool: str, pods: list[str]) -> None:
    for pod in pods:
        for prio in keys.PRIORITIES:
            for shard in ks.all_shards():
                pipe.xlen(ks.pod_admission_stream(pool, prio, pod, shard))


def _by_pod(ks: KeySpace, pods: list[str], lens: list) -> dict[str, dict[str, int]]:
    """The replies `_add_xlens` queued, summed over shards: pod -> priority -> entries."""
    n, m = len(keys.PRIORITIES), ks.shards
    out = {}
    for i, pod in enumerate(pods):
        mine = lens[i * n * m:(i + 1) * n * m]
        out[pod] = {p: sum(int(x) for x in mine[j * m:(j + 1) * m]) for j, p in enumerate(keys.PRIORITIES)}
    return out


def _s(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


# ---- What Redis still knows of a request id (the gateway's duplicate, resend and readmit checks).
# A request's keys share its tag (one slot), so each check is one EXISTS.

async def started(r: aioredis.Redis, ks: KeySpace, request_id: str) -> bool:
    """Its token stream exists: a pod has written at least token 0 (or its finish)."""
    return bool(await r.exists(ks.token_stream(request_id)))


async def admitted_or_started(r: aioredis.Redis, ks: KeySpace, request_id: str) -> bool:
    """Its admission marker (MARKER_TTL_S) or its token stream exists: the id was enqueued."""
    return bool(await r.exists(ks.admitted_key(request_id), ks.token_stream(request_id)))


async def in_use(r: aioredis.Redis, ks: KeySpace, request_id: str) -> bool:
    """Any key of the id exists (marker, token stream, cancel key): a new request may not take it."""
    return bool(await r.exists(ks.token_stream(request_id), ks.cancel_key(request_id),
                               ks.admitted_key(request_id)))


def resume_record_key(ks: KeySpace, request_id: str) -> str:
    """A resumable request's record (gateway/resume.py reads and writes its fields)."""
    return ks.gateway_resume_key(request_id)
