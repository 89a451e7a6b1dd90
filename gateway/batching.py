"""Admission's Redis work shared between concurrent requests, so a gateway's connections do not grow
with its requests (issue 31: 3,000 streams at once within `redis.max_connections`, 64).

Every connection of a gateway comes from one bounded pool (tandem_core/redis_client.py); a
command past the bound waits for one. With thousands of admissions at once, each holding a
connection from its send until its task runs again to read the reply (long on a busy event
loop), that wait grew past the pool's timeout (`socket_timeout_s`), which reads as "Redis is
unreachable" (measured: 90 of 3,000 such 503s with 64 connections). So:

- `SingleFlight`: concurrent reads of the same thing (the backlog, the registry view) share the
  one in flight; a caller that arrives while it runs gets its answer (at most one round trip
  old, as fresh as a read of its own that queued for a connection would be).
- `EnqueueBatcher`: one writer task sends every waiting admission's enqueue script in one
  pipeline (tandem_core/bus/admission.py `enqueue_many`), one batch at a time: one connection
  for all the enqueues of a burst. An error of one script is that request's; a connection error
  is every request's of the batch (each enqueue is idempotent by request id: the hold's retry
  cannot enqueue twice). A caller that gave up (cancelled) before its batch was formed is left
  out of it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import redis.asyncio as aioredis

from tandem_core import faults
from tandem_core.bus import KeySpace, admission
from tandem_core.types import GenerationRequest

T = TypeVar("T")
log = logging.getLogger(__name__)


class SingleFlight(Generic[T]):
    """`await flight(key, fn)`: `fn()`, unless a call for `key` is in flight: then its result."""

    def __init__(self) -> None:
        self._flying: dict[object, asyncio.Future] = {}
        self.calls = 0  # calls made (the rest shared one): for tests and benchmarks

    async def __call__(self, key: object, fn: Callable[[], Awaitable[T]]) -> T:
        fut = self._flying.get(key)
        if fut is None:
            self.calls += 1
            fut = asyncio.ensure_future(fn())
            self._flying[key] = fut
            fut.add_done_callback(lambda f, k=key: self._landed(k, f))
        return await asyncio.shield(fut)  # one caller cancelled does not cancel the others' read

    def _landed(self, key: object, fut: asyncio.Future) -> None:
        if self._flying.get(key) is fut:
            del self._flying[key]
        if not fut.cancelled():
            fut.exception()  # retrieved here too: every caller may have gone


class EnqueueBatcher:
    """Admissions' enqueues, sent by one task in pipelines of at most `max_batch`."""

    def __init__(self, redis: Callable[[], aioredis.Redis], ks: KeySpace, pool: str, maxlen: int,
                 max_batch: int = 256) -> None:
        self.redis, self.ks, self.pool, self.maxlen, self.max_batch = redis, ks, pool, maxlen, max_batch
        self._waiting: list[tuple[GenerationRequest, str | None, bool, asyncio.Future]] = []
        self._writer: asyncio.Task | None = None
        self.batches = 0  # pipelines sent (a metric for tests and benchmarks)

    async def enqueue(self, req: GenerationRequest, pod: str | None, direct: bool) -> bytes:
        """The request's admission entry id (tandem_core/bus/admission.py `enqueue`), or its error."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((req, pod, direct, fut))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write(), name="admission-writer")
        return await fut

    async def _write(self) -> None:
        while self._waiting:
            batch = [w for w in self._waiting[:self.max_batch] if not w[3].done()]
            del self._waiting[:self.max_batch]
            if not batch:
                continue
            self.batches += 1
            try:
                faults.hit("gateway.enqueue")
                results = await admission.enqueue_many(self.redis(), self.ks, self.pool, [w[:3] for w in batch], self.maxlen)
            except BaseException as e:
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            for (*_, fut), res in zip(batch, results):
                if fut.done():
                    continue
                if isinstance(res, Exception):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)
