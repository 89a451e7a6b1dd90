"""The one bridge between the decode pod's engine thread and its event loop.

Work goes in on `inserts` (pulled KV, prompts to prefill here) and tokens come out on `outputs`
(one batch per step), both bounded queues. The engine thread never touches an asyncio object: it
wakes the loop through `call_soon_threadsafe` (a slot was freed; a step's tokens are ready), and the
loop never blocks on a queue: it waits on its events and takes what is there without blocking.

Bounds: `inserts` holds at least `slots` items and every item holds a seat in the request table,
so a put from the loop never finds it full; `outputs` holds `output_queue_size` steps, and when the
publisher falls behind the engine thread blocks on it (back-pressure, not memory).
"""
from __future__ import annotations

import asyncio
import queue


class Bridge:
    def __init__(self, insert_queue_size: int, output_queue_size: int,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.inserts: queue.Queue = queue.Queue(maxsize=insert_queue_size)
        self.outputs: queue.Queue = queue.Queue(maxsize=output_queue_size)
        self._loop = loop
        self.slot_freed = asyncio.Event()
        self.output_ready = asyncio.Event()

    # ------------------------------------------------------------ engine thread
    def wake_claims(self) -> None:
        """A slot was freed (or the thread died): the claim loop may claim again."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.slot_freed.set)

    def put_output(self, batch: list, timeout_s: float) -> None:
        """One step's tokens; blocks while the publisher is behind (queue.Full after `timeout_s`)."""
        self.outputs.put(batch, timeout=timeout_s)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.output_ready.set)

    def get_insert(self, block_s: float):
        """The next item for a slot, or None (waits up to `block_s` when the pod is idle)."""
        try:
            return self.inserts.get(timeout=block_s) if block_s else self.inserts.get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------ event loop
    def put_insert(self, item) -> None:
        self.inserts.put_nowait(item)

    def take_outputs(self, max_batches: int) -> list:
        """Up to `max_batches` queued steps' tokens, in order, without blocking."""
        got: list = []
        for _ in range(max_batches):
            try:
                got += self.outputs.get_nowait()
            except queue.Empty:
                break
        return got

    async def wait_output(self, timeout_s: float) -> None:
        self.output_ready.clear()
        if self.outputs.empty():
            try:
                await asyncio.wait_for(self.output_ready.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                pass

    async def wait_slot_freed(self, timeout_s: float) -> None:
        self.slot_freed.clear()
        try:
            await asyncio.wait_for(self.slot_freed.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            pass
