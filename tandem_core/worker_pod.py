"""The skeleton every worker pod (prefill, decode) runs in, in this order:

1. `WorkerPod(...)`: the gRPC server and the stop signals (SIGTERM/SIGINT set `stop`).
2. `bind()`: the address other pods dial (`advertise_host:port`); the pod adds its services to
   `server`; `start()` serves.
3. `beat(info)`: heartbeats into the registry (`tandem_core.lifecycle.heartbeat_loop`), each
   carrying `draining`.
4. `ready()`: gRPC health SERVING, only once the engine is compiled and the pod may take work.
5. The pod's own loops run until `stop` is set; then `drain()`: NOT_SERVING and `draining`, so
   the gateway and the probes stop sending work while the pod finishes what it holds.
6. `close()`: the heartbeats stop (the registry entry expires), the server stops, Redis closes.
What a pod does between `ready` and `drain` is its own (prefill_svc/app.py, decode_svc/app.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from tandem_core import grpc_util, lifecycle
from tandem_core.bus import registry
from tandem_core.settings import WorkerSettings

log = logging.getLogger(__name__)


class WorkerPod:
    def __init__(self, s: WorkerSettings, r: aioredis.Redis, services: list[str]) -> None:
        self.s, self.r, self.services = s, r, services
        self.server = grpc_util.make_server(s.grpc.max_message_bytes)
        self.stop = asyncio.Event()
        self.draining = False
        self.address = ""
        self._health = None
        self._hb_stop = asyncio.Event()
        self._hb: asyncio.Task | None = None
        lifecycle.install_stop_signals(self.stop)

    def bind(self) -> str:
        """Listen (services may still be added until `start`); the address peers dial."""
        g = self.s.grpc
        port = grpc_util.bind(self.server, g.host, g.port, g)
        self._health = grpc_util.add_health(self.server, self.services)
        self.address = f"{g.advertise_host}:{port}"
        return self.address

    async def start(self) -> None:
        """Serve: health answers NOT_SERVING (the server and each service) until `ready`."""
        await grpc_util.set_serving(self._health, self.services, False)
        await self.server.start()

    def beat(self, info: Callable[[], registry.WorkerInfo], peers: lifecycle.PeerJudge,
             on_run_id: Callable[[str | None], None] | None = None) -> None:
        """Heartbeats from now until `close`; `peers` learns from each whether peers may be judged."""
        self._hb = asyncio.create_task(lifecycle.heartbeat_loop(
            self.r, info, self.s.heartbeat_interval_s, self._hb_stop, peers, on_run_id))

    async def ready(self) -> None:
        await grpc_util.set_serving(self._health, self.services, True)

    async def drain(self) -> None:
        """Stop taking work: NOT_SERVING, and `draining` in the next heartbeat."""
        self.draining = True
        await grpc_util.set_serving(self._health, self.services, False)

    async def close(self, grace_s: float) -> None:
        self._hb_stop.set()
        if self._hb is not None:
            await self._hb
        await self.server.stop(grace=grace_s)
        await self.r.aclose()
