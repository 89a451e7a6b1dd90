"""Where a decision goes, and where the planner reads the replicas that run now.

- `Publish` (mode off): nothing is scaled; the decision is only published (gauges, /keda, which
  KEDA can follow). The replicas "running" are the last decision, first the live pods.
- `LocalFollow` (mode local): the decision is written to Redis (`keys.planner_decision_key`);
  `tandem local --planner` starts and drains worker processes to match it.
- `KubeScale` (mode kubernetes): the Deployments' scale subresource, read every interval (so a
  person's `kubectl scale` is seen) and patched when the decision differs, only while this
  planner holds the Lease.
"""
from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis

from planner.decide import ROLES, Decision
from planner.kube import LeaseKeeper
from tandem_core import keys

log = logging.getLogger(__name__)


class Publish:
    leader = True

    def __init__(self) -> None:
        self.replicas: dict[str, int] | None = None

    async def current(self, live: dict[str, int]) -> dict[str, int]:
        if self.replicas is None:
            self.replicas = {r: max(1, live.get(r, 0)) for r in ROLES}
        return dict(self.replicas)

    async def apply(self, d: Decision, current: dict[str, int]) -> None:
        self.replicas = {r: d.replicas(r) for r in ROLES}

    async def refresh_leader(self) -> bool:
        return True


class LocalFollow(Publish):
    def __init__(self, r: aioredis.Redis, pool: str) -> None:
        super().__init__()
        self.r, self.key = r, keys.planner_decision_key(pool)

    async def current(self, live: dict[str, int]) -> dict[str, int]:
        got = await self.r.hgetall(self.key)
        if got:
            got = {(k.decode() if isinstance(k, bytes) else k): v for k, v in got.items()}
            return {r: int(got[r]) for r in ROLES}
        return await super().current(live)

    async def apply(self, d: Decision, current: dict[str, int]) -> None:
        await super().apply(d, current)
        await self.r.hset(self.key, mapping={"prefill": d.prefill, "decode": d.decode, "ts": time.time(),
                                             "reason": "; ".join(d.notes)[:500]})


class KubeScale:
    def __init__(self, api, namespace: str, deployments: dict[str, str], lease: LeaseKeeper) -> None:
        missing = [r for r in ROLES if not deployments.get(r)]
        if missing:
            raise ValueError(f"mode kubernetes needs the Deployment names: set TANDEM_PLANNER_{missing[0].upper()}"
                             "__DEPLOYMENT (the chart sets them)")
        self.api, self.namespace, self.deployments, self.lease = api, namespace, deployments, lease

    @property
    def leader(self) -> bool:
        return self.lease.leader

    async def refresh_leader(self) -> bool:
        try:
            return await self.lease.refresh()
        except Exception as e:  # noqa: BLE001 - an unreachable API server: stop acting until the Lease is ours again
            self.lease.leader = False
            log.warning("lease %s/%s not refreshed (%s): not scaling", self.namespace, self.lease.name, e)
            return False

    async def current(self, live: dict[str, int]) -> dict[str, int]:
        return {r: await self.api.read_scale(self.namespace, self.deployments[r]) for r in ROLES}

    async def apply(self, d: Decision, current: dict[str, int]) -> None:
        """Patch the roles whose decision differs from `current` (read this tick)."""
        for r in ROLES:
            if d.replicas(r) != current[r]:
                await self.api.patch_scale(self.namespace, self.deployments[r], d.replicas(r))
                log.info("scaled %s/%s %d -> %d", self.namespace, self.deployments[r], current[r], d.replicas(r))
