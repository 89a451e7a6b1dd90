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
    it is written."""
    rid = notice.request.request_id
    pipe.xadd(ks.ready_stream(pool, ks.request_shard(rid)), {"rid": rid, "notice": notice.to_json()},
              maxlen=maxlen, approximate=True)


def decode_streams(ks: KeySpace, pool: str) -> list[str]:
    """What decode pods read, every shard: the ready notices, then the direct (unprefilled) prompts."""
    return [f(pool, shard) for shard in ks.all_shards() for f in (ks.ready_stream, ks.direct_stream)]


async def ready_backlog(r: aioredis.Redis, ks: KeySpace, pool: str) -> int:
    """Ready notices waiting for a decode slot (or pulled and not yet acked), every shard."""
    pipe = r.pipeline(transaction=False)
    for shard in ks.all_shards():
        pipe.xlen(ks.ready_stream(pool, shard))
    return int(sum(await pipe.execute()))
