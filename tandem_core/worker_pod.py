"""The skeleton every worker pod (prefill, decode) runs in, in this order:

1. `WorkerPod(...)`: the gRPC server and the stop signals (SIGTERM/SIGINT set `stop`).
2. `bind()`: the address other pods dial (`advertise_host:port`), and with `grpc.health_port` a
   plaintext server answering grpc.health.v1 only (the probes' port when `port` requires mTLS);
   the pod adds its services to `server`; `start()` serves.
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
        self.health_server = None  # the plaintext health-only server (`grpc.health_port`), if any
        self.health_port = 0
        self._hb_stop = asyncio.Event()
        self._hb: asyncio.Task | None = None
        self.failed: list[str] = []  # supervised tasks that died (`supervise`): the pod exits non-zero
        self._marking: set[asyncio.Task] = set()
        lifecycle.install_stop_signals(self.stop)

    def supervise(self, task: asyncio.Task, what: str) -> asyncio.Task:
        """Watch a long-lived task of the pod: if it dies of an error, the pod must not live on
        beside it (heartbeating with free slots, claiming nothing). It is said loudly, health goes
        NOT_SERVING at once, `stop` is set (the pod drains, hands back what it holds and exits
        non-zero: `failed`), and its supervisor (Kubernetes, the local launcher) restarts it."""
        def ended(t: asyncio.Task) -> None:
            if t.cancelled() or t.exception() is None:
                return
            err = t.exception()
            self.failed.append(f"{what}: {type(err).__name__}: {err}")
            log.error("%s failed: %r; stopping the pod (it drains, exits non-zero and is restarted)", what, err,
                      exc_info=err)
            self.stop.set()
            if self._health is not None:
                mark = asyncio.ensure_future(grpc_util.set_serving(self._health, self.services, False))
                self._marking.add(mark)
                mark.add_done_callback(self._marking.discard)

        task.add_done_callback(ended)
        return task

    def bind(self) -> str:
        """Listen (services may still be added until `start`); the address peers dial."""
        g = self.s.grpc
        port = grpc_util.bind(self.server, g.host, g.port, g)
        if g.health_port:  # probes speak no TLS: health (only) in plaintext on a port of its own
            self.health_server, self.health_port = grpc_util.health_server(g.host, g.health_port)
        self._health = grpc_util.add_health(self.server, self.services, also=self.health_server)
        self.address = f"{g.advertise_host}:{port}"
        return self.address

    async def start(self) -> None:
        """Serve: health answers NOT_SERVING (the server and each service) until `ready`."""
        await grpc_util.set_serving(self._health, self.services, False)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    def beat(self, info: Callable[[], registry.WorkerInfo], peers: lifecycle.PeerJudge,
             on_run_id: Callable[[str | None], None] | None = None) -> None:
        """Heartbeats from now until `close`; `peers` learns from each whether peers may be judged."""
        self._hb = self.supervise(asyncio.create_task(lifecycle.heartbeat_loop(
            self.r, info, self.s.heartbeat_interval_s, self._hb_stop, peers, on_run_id)), "the heartbeat loop")

    async def ready(self) -> None:
        await grpc_util.set_serving(self._health, self.services, True)

    async def drain(self) -> None:
        """Stop taking work: NOT_SERVING, and `draining` in the next heartbeat."""
        self.draining = True
        await grpc_util.set_serving(self._health, self.services, False)

    async def close(self, grace_s: float) -> None:
        self._hb_stop.set()
        if self._hb is not None:
            await asyncio.gather(self._hb, return_exceptions=True)  # (a failure was said by `supervise`)
        await self.server.stop(grace=grace_s)
        if self.health_server is not None:
            await self.health_server.stop(None)
        await self.r.aclose()
