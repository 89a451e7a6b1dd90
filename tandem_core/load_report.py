"""What the gateways saw of the load, in Redis, for the planner (planner/signals.py).

Each gateway replica writes its cumulative counts every few seconds: requests admitted and their
prompt tokens (all, and those routed to prefill pods: short prompts may be prefilled on decode
pods, tandem_core/scheduling.py), requests finished and their output tokens, and the sums and counts of its TTFT and
ITL histograms. A reader turns the counts of every replica into increments over its own interval
(`Increments`), so replicas can come and go, restart (their counts start again at 0) or miss a
report without the planner seeing a jump. Keys: `keys.gateway_load_key(id)` (a hash, expiring
after `ttl_s`) and the sorted set `keys.GATEWAYS` (id -> last report time), pruned by readers.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import redis.asyncio as aioredis

from tandem_core import keys

FIELDS = ("admitted", "prompt_tokens", "admitted_remote", "prompt_tokens_remote", "finished", "output_tokens",
          "ttft_sum", "ttft_count", "itl_sum", "itl_count")  # remote: prefilled on a prefill pod


async def publish(r: aioredis.Redis, gateway_id: str, pid: int, counts: dict[str, float], ttl_s: int,
                  now: float | None = None) -> None:
    now = time.time() if now is None else now
    fields = {f: float(counts.get(f, 0.0)) for f in FIELDS}
    pipe = r.pipeline(transaction=False)
    pipe.hset(keys.gateway_load_key(gateway_id), mapping={**fields, "pid": pid, "ts": now})
    pipe.expire(keys.gateway_load_key(gateway_id), ttl_s)
    pipe.zadd(keys.GATEWAYS, {gateway_id: now})
    await pipe.execute()


async def read(r: aioredis.Redis) -> list[dict]:
    """Every live gateway's last report: {"id", "pid", "ts", FIELDS...}; expired ones are pruned."""
    ids = [x.decode() if isinstance(x, bytes) else str(x) for x in await r.zrange(keys.GATEWAYS, 0, -1)]
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)
    for gid in ids:
        pipe.hgetall(keys.gateway_load_key(gid))
    out, dead = [], []
    for gid, h in zip(ids, await pipe.execute()):
        if not h:
            dead.append(gid)
            continue
        h = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in h.items()}
        out.append({"id": gid, "pid": int(h.get("pid", 0)), "ts": h.get("ts", 0.0),
                    **{f: h.get(f, 0.0) for f in FIELDS}})
    if dead:
        await r.zrem(keys.GATEWAYS, *dead)
    return out


class Increments:
    """Increments of cumulative counts between two reads, summed over every reporter.

    The last values per id are kept; the increment is value - last. A count going down, or a new
    pid, means the reporter restarted: its whole count is new. A reporter seen for the first time
    contributes nothing (its count covers time before this reader's interval) unless `count_new`.
    At most `max_ids` ids are remembered (least recently seen forgotten)."""

    def __init__(self, fields: tuple[str, ...] = FIELDS, max_ids: int = 4096, count_new: bool = False) -> None:
        self.fields, self.max_ids, self.count_new = fields, max_ids, count_new
        self._last: OrderedDict[str, dict] = OrderedDict()

    def step(self, reports: list[dict]) -> dict[str, float]:
        """Summed increments, plus `span_s`: the mean time between the two reports each increment
        came from (by the reporters' own `ts`; 0 when none has two), so a rate is increments /
        span_s whatever the phase of the reports against the reader's interval."""
        out = dict.fromkeys(self.fields, 0.0)
        spans = []
        for rep in reports:
            rid = rep.get("id")
            if rid is None:
                continue
            now: dict[str, Any] = {f: max(0.0, float(rep.get(f) or 0)) for f in self.fields}
            now["pid"] = rep.get("pid")
            last = self._last.pop(rid, None)
            if last is None:
                if self.count_new:
                    for f in self.fields:
                        out[f] += now[f]
            elif last["pid"] != now["pid"] or any(now[f] < last[f] for f in self.fields):
                for f in self.fields:  # restarted: every count began again at 0
                    out[f] += now[f]
            else:
                for f in self.fields:
                    out[f] += now[f] - last[f]
                if rep.get("ts") and last.get("ts"):
                    spans.append(float(rep["ts"]) - last["ts"])
            now["ts"] = float(rep.get("ts") or 0.0)
            self._last[rid] = now
        while len(self._last) > self.max_ids:
            self._last.popitem(last=False)
        out["span_s"] = sum(spans) / len(spans) if spans else 0.0
        return out
