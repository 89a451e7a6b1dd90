"""Process lifecycle shared by the workers: signals -> drain, heartbeats into the registry."""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable

import redis.asyncio as aioredis

from tandem_core import streams

log = logging.getLogger(__name__)


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT set `stop`: the service drains, then exits. A second signal is ignored
    (the drain has its own deadline)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (log.info("received %s: draining", signal.Signals(s).name), stop.set()))


async def heartbeat_loop(
    r: aioredis.Redis, info: Callable[[], streams.WorkerInfo], interval_s: float, stop: asyncio.Event
) -> None:
    """Publish this worker's registry entry every `interval_s` until `stop`; deregister after.

    Redis errors are logged and retried: a missed heartbeat must never kill the worker.
    """
    ttl = max(3, int(interval_s * 5))
    wid = info().id
    while not stop.is_set():
        try:
            await streams.heartbeat(r, info(), ttl)
        except Exception as e:  # noqa: BLE001 - keep beating through Redis restarts
            log.warning("heartbeat failed: %s", e)
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except asyncio.TimeoutError:
            pass
    try:
        await streams.deregister(r, wid)
    except Exception as e:  # noqa: BLE001
        log.warning("deregister failed: %s", e)
