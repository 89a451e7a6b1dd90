"""Process lifecycle shared by the workers: signals -> drain, heartbeats into the registry."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable

import redis.asyncio as aioredis

from tandem_core.bus import registry

log = logging.getLogger(__name__)


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT set `stop`: the service drains, then exits. A second signal is ignored
    (the drain has its own deadline)."""
    def on_signal(sig: signal.Signals) -> None:
        log.info("received %s: draining", sig.name)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


def heartbeat_ttl_s(interval_s: float) -> int:
    """How long a registry entry outlives its last beat."""
    return max(3, int(interval_s * 5))


class PeerJudge:
    """Whether this worker may read a peer's missing heartbeat as that peer's death.

    An entry expires `heartbeat_ttl_s` after its last beat. When Redis comes back from an outage
    longer than that, or restarts from an append-only file that lost the last beats, or fails over,
    every entry can be gone at once, live peers' included, until each beats again. A worker that
    took that for death would resume every live peer's requests (fenced off on the peer, but done
    twice, and a Redis blip would turn into a storm of resumes). So absence counts only once this
    worker has itself been talking to the same Redis (the same `run_id`) for a whole TTL without a
    failed beat: by then every live peer has beaten again. A freshly started worker waits a TTL too
    before it takes over anyone else's work (its own leftovers it recovers at once)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.since: float | None = None  # start of the current unbroken contact with Redis
        self.run_id: str | None = None

    def beat_ok(self, run_id: str | None) -> None:
        if self.since is None or run_id != self.run_id:
            if self.since is not None:
                log.warning("Redis restarted or failed over (run_id %s -> %s): peers count as dead only "
                            "after %gs", self.run_id, run_id, self.ttl_s)
            self.since, self.run_id = self.clock(), run_id
        self.run_id = run_id

    def beat_failed(self) -> None:
        self.since = None

    @property
    def trusted(self) -> bool:
        return self.since is not None and self.clock() - self.since >= self.ttl_s


async def heartbeat_loop(
    r: aioredis.Redis, info: Callable[[], registry.WorkerInfo], interval_s: float, stop: asyncio.Event,
    judge: PeerJudge | None = None, on_run_id: Callable[[str | None], None] | None = None,
) -> None:
    """Publish this worker's registry entry every `interval_s` until `stop`; deregister after.
    Each beat tells `judge` whether Redis answered, and which Redis (its run_id), and hands the
    run_id to `on_run_id` (which must not block: the decode pod's starts a reconcile task).

    Redis errors are logged and retried: a missed heartbeat must never kill the worker.
    """
    ttl = heartbeat_ttl_s(interval_s)
    wid = info().id
    while not stop.is_set():
        try:
            run_id = await registry.heartbeat(r, info(), ttl)
            if judge is not None:
                judge.beat_ok(run_id)
            if on_run_id is not None:
                on_run_id(run_id)
        except Exception as e:  # noqa: BLE001 - keep beating through Redis restarts
            if judge is not None:
                judge.beat_failed()
            log.warning("heartbeat failed: %s", e)
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except asyncio.TimeoutError:
            pass
    try:
        await registry.deregister(r, wid)
    except Exception as e:  # noqa: BLE001
        log.warning("deregister failed: %s", e)
