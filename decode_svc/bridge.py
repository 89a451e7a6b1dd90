"""The one bridge between the decode pod's engine thread and its event loop.

Work goes in on `inserts` (pulled KV, prompts to prefill here) and tokens come out on `outputs`
(one batch per engine call: one step's tokens, or a multi-step call's), both bounded queues. The
engine thread never touches an asyncio object: it wakes the loop through `call_soon_threadsafe`
(a slot was freed; tokens are ready), and the loop never blocks on a queue: it waits on a future
and takes what is there without blocking.

A wake costs both threads a system call (the loop's self-pipe), so the engine thread wakes the
loop only when a waiter is parked (`_Waker`): while the publisher is still writing the previous
step, a new step is simply queued and taken by its next pass. The waiter is parked before the
queue is looked at once more, and the engine thread queues before it looks for a waiter, so one
of the two always sees the other (the GIL orders them): no step waits for the timeout.

Bounds: `inserts` holds at least `slots` items and every item holds a seat in the request table,
so a put from the loop never finds it full; `outputs` holds `output_queue_size` batches, and when
the publisher falls behind the engine thread blocks on it (back-pressure, not memory).
"""
from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_svc.items import Preempted


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _Waker:
    """One coroutine's wait on the event loop for a wake from another thread (or its timeout)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        self._waiter: asyncio.Future | None = None
        self.woken = 0  # wakes sent (the other thread found a waiter)

    def wake(self) -> None:
        """From any thread: wake the parked waiter, if one is parked."""
        w = self._waiter
        if w is not None and self._loop is not None:
            self.woken += 1
            self._loop.call_soon_threadsafe(_wake, w)

    async def wait(self, timeout_s: float, ready: Callable[[], bool]) -> None:
        """Park until woken or `timeout_s`, unless `ready()` (looked at once parked) says there
        is something to do already."""
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        try:
            if ready():
                return
            timer = loop.call_later(timeout_s, _wake, w)
            try:
                await w
            finally:
                timer.cancel()
        finally:
            self._waiter = None


class Bridge:
    def __init__(self, insert_queue_size: int, output_queue_size: int,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.inserts: queue.Queue = queue.Queue(maxsize=insert_queue_size)
        self.outputs: queue.Queue = queue.Queue(maxsize=output_queue_size)
        self._loop = loop
        self._freed = _Waker(loop)  # the claim loop, waiting for a free slot
        self._output = _Waker(loop)  # the publisher, waiting for tokens
        # the publisher's last sign of life (a batch taken, a write retried), monotonic: the
        # engine thread's blocked `put_output` gives up only when this is `timeout_s` old
        self.publisher_seen = time.monotonic()

    # ------------------------------------------------------------ engine thread
    def wake_claims(self) -> None:
        """A slot was freed (or the thread died): the claim loop may claim again."""
        self._freed.wake()

    def put_output(self, batch: list | Preempted, timeout_s: float) -> None:
        """One engine call's tokens; blocks while the publisher is behind; wakes the publisher if
        it waits. queue.Full only once the publisher has shown no sign of life (`publisher_alive`)
        for `timeout_s`: a publisher retrying a write through a Redis outage (`publish_retries`,
        about a minute) is behind, not dead, and an engine thread that gave up sooner stopped the
        pod and spent an attempt of every running request (issue 42)."""
        while True:
            try:
                self.outputs.put(batch, timeout=min(timeout_s, 1.0))
                break
            except queue.Full:
                if time.monotonic() - self.publisher_seen >= timeout_s:
                    raise
        self._output.wake()

    def get_insert(self, block_s: float):
        """The next item for a slot, or None (waits up to `block_s` when the pod is idle)."""
        if not block_s:  # every step while a slot is free: no queue.Empty raised for nothing
            return self.inserts.get_nowait() if self.inserts.qsize() else None  # (the only taker)
        try:
            return self.inserts.get(timeout=block_s)
        except queue.Empty:
            return None

    # ------------------------------------------------------------ event loop
    def publisher_alive(self) -> None:
        """The publisher is at work (it took a batch, or retries one): see `put_output`."""
        self.publisher_seen = time.monotonic()

    def put_insert(self, item) -> None:
        self.inserts.put_nowait(item)

    def take_outputs(self, max_batches: int):
        """Up to `max_batches` queued batches' tokens, in order, without blocking (the loop is
        the only taker: what `qsize` counts is there). A batch that is not a list (a `Preempted`:
        requests to hand back) comes alone, and only once the tokens queued before it are taken."""
        q = self.outputs
        n = min(q.qsize(), max_batches)
        if n == 1:
            return q.get_nowait()  # the engine's own list (it keeps no reference)
        got: list = []
        for _ in range(n):
            if type(q.queue[0]) is not list:  # (a peek: the loop is the only taker)
                return got or q.get_nowait()
            got += q.get_nowait()
        return got

    async def wait_output(self, timeout_s: float) -> None:
        """Until tokens are queued (or `timeout_s`)."""
        if self.outputs.empty():
            await self._output.wait(timeout_s, lambda: not self.outputs.empty())

    async def wait_slot_freed(self, timeout_s: float) -> None:
        """Until the engine thread frees a slot after this call began (or `timeout_s`)."""
        await self._freed.wait(timeout_s, lambda: False)
