"""Enqueueing again the admissions a Redis restart or failover lost.

Redis with `appendfsync everysec`, or a replica that Sentinel promotes, can come back with the
state of a moment up to a second or two before the failure: a prefix of the writes (see
decode_svc/resync.py for the workers' side). An admission entry written in that last stretch is
gone, and with it the only trace of the request outside this gateway; its client would wait for
a first token until the deadline. The gateway knows what it admitted, so it puts those back.

`Readmitter` keeps the admission of every request this replica is relaying (the request, where
it was routed, when), and watches Redis's `run_id` (it changes on a restart and on a failover).
On a change it waits `grace_s`: within a heartbeat the decode pods write their journal again,
which re-creates the token stream of every request they hold. Then every request without a
token stream is enqueued again (a token 0 the client already has does not count: the prefill
pod's commit of it may be what was lost), with the same script as the first time
(tandem_core/bus/admission.py `enqueue`), which is a no-op while the request's marker survives. The
marker is written by the same script as the entry, so it survived exactly when the entry did (a
prefix keeps both or neither): a surviving admission is never enqueued twice, and a lost one is
enqueued once. Requests older than the marker's TTL are left alone (their marker can no longer
tell) and forgotten. A request a decode pod is pulling when Redis changes has no token stream yet
and may be enqueued again, then decoded twice (the client sees each index once, the first
written; the same tokens when greedy or seeded).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from tandem_core.bus import admission, conn, registry
from tandem_core.bus import KeySpace
from tandem_core.retry import Backoff, retry
from tandem_core.types import GenerationRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admission:
    req: GenerationRequest
    pod: str | None
    direct: bool
    at: float  # monotonic time of the first enqueue


class Readmitter:
    RETRY_S = 0.25  # how soon to look again after a failed look (Redis down, a stale connection)

    def __init__(self, redis: Callable[[], aioredis.Redis], ks: KeySpace, pool: str, maxlen: int,
                 interval_s: float = 1.0, grace_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._redis, self.ks, self.pool, self.maxlen = redis, ks, pool, maxlen
        self.interval_s, self.grace_s, self.clock = interval_s, grace_s, clock
        self.open: dict[str, Admission] = {}  # request id -> its admission, while relayed here
        self.run_id: str | None = None
        self.readmitted = 0  # admissions enqueued again, ever

    def add(self, req: GenerationRequest, pod: str | None, direct: bool) -> None:
        self.open[req.request_id] = Admission(req, pod, direct, self.clock())

    def discard(self, request_id: str) -> None:
        self.open.pop(request_id, None)

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: look at Redis's run_id every `interval_s`, readmit on a change."""
        failing = False
        while not stop.is_set():
            wait = self.interval_s
            try:
                await self.check()
                failing = False
            except Exception as e:  # noqa: BLE001 - Redis down: look again soon
                if not failing:
                    log.info("run_id check or readmission failed: %s; looking again every %gs", e, self.RETRY_S)
                failing, wait = True, min(wait, self.RETRY_S)
                await self._close_idle()  # those of before a restart would each fail once more
            try:
                await asyncio.wait_for(stop.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass

    async def _close_idle(self) -> None:
        try:
            pool = getattr(self._redis(), "connection_pool", None)  # (a cluster client: per node, its own)
            if pool is not None:
                await pool.disconnect(inuse_connections=False)
        except Exception:  # noqa: BLE001 - best effort
            pass

    async def check(self) -> int:
        """Readmit if Redis changed since the last look; how many were enqueued again."""
        run_id = await registry.server_id(self._redis()) or ""
        self._forget_old()
        if not run_id or run_id == self.run_id:
            return 0
        if self.run_id is None:
            self.run_id = run_id
            return 0
        await asyncio.sleep(self.grace_s)
        n = await self._readmit_soon(run_id)  # a failure leaves run_id: the next look redoes it
        self.run_id = run_id
        return n

    async def _readmit_soon(self, run_id: str, tries: int = 3) -> int:
        """`readmit`, tried again at once when it fails on Redis (tandem_core/retry.py, REDIS_DOWN
        only, `tries` in all). Each idle pooled connection from before the restart fails once when
        first used, so they are closed before each retry (the ones in use fail and reconnect on
        their own); waiting for the next look, and its grace, would cost the requests it puts back
        seconds more."""
        return await retry(lambda: self.readmit(run_id), "readmission after a Redis change", transient=conn.REDIS_DOWN,
                           attempts=tries, backoff=Backoff.fixed(0.1), log=log,
                           on_retry=lambda _e, _n: self._close_idle())

    def _forget_old(self) -> None:
        """Admissions whose relay never ended here (a client gone before its stream began)."""
        oldest = self.clock() - admission.MARKER_TTL_S
        for rid in [rid for rid, a in self.open.items() if a.at < oldest]:
            del self.open[rid]

    async def readmit(self, run_id: str) -> int:
        r, n = self._redis(), 0
        oldest = self.clock() - (admission.MARKER_TTL_S - 10)  # the marker still answers for these
        for rid, adm in list(self.open.items()):
            if adm.at < oldest or await admission.admitted_or_started(r, self.ks, rid):
                continue  # too old to tell, begun, or its entry survived
            await admission.enqueue(r, self.ks, self.pool, adm.req, self.maxlen, pod=adm.pod, direct=adm.direct)
            n += 1
            log.warning("request_id=%s: its admission was lost with Redis's last writes; enqueued again", rid)
        self.readmitted += n
        log.warning("Redis changed (run_id %s -> %s): %d of %d open requests enqueued again", self.run_id, run_id, n,
                    len(self.open))
        return n
