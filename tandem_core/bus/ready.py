"""The ready streams: a prefill pod's notice that a request's KV waits for a decode slot (the KV
itself stays on the prefill pod). The prefill pod writes it inside its fenced commit
(`bus.entry_fence`); decode pods claim it with `bus.groups.claim`, as many as they have free slots.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from tandem_core.keys import KeySpace
from tandem_core.types import GenerationRequest


@dataclass
class ReadyNotice:
    """A prefill result waiting for a decode slot; the KV itself stays on the prefill pod."""

    request: GenerationRequest
    address: str  # prefill pod's KV gRPC address host:port
    capability: str  # per-request token the pull must present
    kv_bytes: int
    prefill_worker: str
    first_token: int

    def to_json(self) -> str:
        d = {"request": self.request.to_dict(), "address": self.address, "capability": self.capability,
             "kv_bytes": self.kv_bytes, "prefill_worker": self.prefill_worker, "first_token": self.first_token}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> "ReadyNotice":
        d = json.loads(s)
        d["request"] = GenerationRequest.from_dict(d["request"])
        return cls(**d)


def add_ready(pipe, ks: KeySpace, pool: str, notice: ReadyNotice, maxlen: int) -> None:
    """Queue the ready XADD, in the request's shard, on a pipeline or transaction (the prefill
    pod's fenced commit, bus.entry_fence); the caller rings the doorbell (`bus.groups.ring`) once
    it is written. A request the gateway steered to a decode pod (`decode_pod`) goes to that pod's
    per-pod ready stream, and the pod's id joins the shard's set in the same commit, so a stream
    nobody knows of never holds an entry."""
    req = notice.request
    rid, shard = req.request_id, ks.request_shard(req.request_id)
    stream = ks.ready_stream(pool, shard)
    if req.decode_pod:
        stream = ks.pod_ready_stream(pool, req.decode_pod, shard)
        pipe.sadd(ks.pod_ready_set(pool, shard), req.decode_pod)
    pipe.xadd(stream, {"rid": rid, "notice": notice.to_json()}, maxlen=maxlen, approximate=True)


def decode_streams(ks: KeySpace, pool: str) -> list[str]:
    """What decode pods read, every shard: the ready notices, then the direct (unprefilled) prompts."""
    return [f(pool, shard) for shard in ks.all_shards() for f in (ks.ready_stream, ks.direct_stream)]


async def pod_ready_streams(r: aioredis.Redis, ks: KeySpace, pool: str) -> list[PodStream]:
    """Every per-pod ready stream that may hold entries (the members of each shard's set)."""
    pipe = r.pipeline(transaction=False)
    for shard in ks.all_shards():
        pipe.smembers(ks.pod_ready_set(pool, shard))
    out = []
    for shard, members in zip(ks.all_shards(), await pipe.execute()):
        for m in sorted(_s(x) for x in members):
            out.append(PodStream(m, shard, ks.pod_ready_stream(pool, m, shard)))
    return out


async def ready_backlog(r: aioredis.Redis, ks: KeySpace, pool: str) -> int:
    """Ready notices waiting for a decode slot (or pulled and not yet acked), every shard, the
    per-pod streams included."""
    pods = await pod_ready_streams(r, ks, pool)
    pipe = r.pipeline(transaction=False)
    for shard in ks.all_shards():
        pipe.xlen(ks.ready_stream(pool, shard))
    for p in pods:
        pipe.xlen(p.stream)
    return int(sum(await pipe.execute()))


@dataclass(frozen=True)
class PodStream:
    """One decode pod's per-pod ready stream in one shard."""

    owner: str  # the decode pod's worker id
    shard: int
    stream: str


# Delete a dead pod's per-pod ready stream and its set entry only if the stream is empty (a
# steered XADD, which re-adds the set entry with it, lands before or after: never lost).
_FORGET_POD = """
if redis.call('EXISTS', KEYS[2]) == 1 and redis.call('XLEN', KEYS[2]) > 0 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[1], ARGV[1])
return 1
"""


async def forget_pod_ready(r: aioredis.Redis, ks: KeySpace, pool: str, owner: str, shard: int) -> bool:
    """Forget a dead decode pod's per-pod ready stream of `shard` once it is empty; True if gone."""
    return bool(await r.eval(_FORGET_POD, 2, ks.pod_ready_set(pool, shard), ks.pod_ready_stream(pool, owner, shard),
                             owner))


def _s(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)
