"""`tandem local --planner`: the launcher plays the part Kubernetes plays for the chart. The
planner (mode local) writes the replicas it wants to `keys.planner_decision_key(pool)`; about
once a second the launcher reads it and starts workers, or retires the newest ones: SIGTERM, so
each drains as a pod does on a scale-down (a prefill pod keeps its held KV until pulled, a decode
pod finishes its requests) and is not restarted when it exits."""
from __future__ import annotations

import logging
import time

import redis
from redis.exceptions import RedisError

from tandem_core import keys

log = logging.getLogger("tandem.local")
ROLES = ("prefill", "decode")


class PlannerFollower:
    def __init__(self, cluster, redis_url: str, pool: str = "default", every_s: float = 1.0) -> None:
        self.cluster, self.every_s = cluster, every_s
        self.key = keys.planner_decision_key(pool)
        self.r = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self._next = 0.0

    def start(self, prefill: int, decode: int) -> None:
        """What runs now is the planner's starting point (a decision left by an earlier run is replaced)."""
        self.r.hset(self.key, mapping={"prefill": prefill, "decode": decode, "ts": time.time(),
                                       "reason": "started by tandem local"})

    def follow(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        try:
            got = {k.decode(): v.decode() for k, v in self.r.hgetall(self.key).items()}
        except RedisError as e:
            log.debug("planner decision not read: %s", e)
            return
        sup = self.cluster.sup
        for role in ROLES:
            if role not in got:
                continue
            want, active = int(got[role]), sup.active(role)
            if want != len(active):
                log.info("planner: %s %d -> %d%s", role, len(active), want,
                         f" ({got['reason']})" if got.get("reason") else "")
            for _ in range(want - len(active)):
                self.cluster.spawn_worker(role)
            for c in list(reversed(active))[:max(0, len(active) - want)]:
                sup.retire(c.name)
