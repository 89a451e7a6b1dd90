"""The n choices of one request (n > 1) relayed as one stream of Deltas.

Each choice has its own token stream (`<request_id>~<i>`, see `GenerationRequest.choice`), so
each is relayed by its own `relay` generator exactly as a single request is (order, duplicates,
stop strings, deadlines, its cancel key when it ends early). This module runs them side by side
and interleaves their Deltas in arrival order, tagged with the choice index; `completion_tokens`
counts every choice. The merged stream ends when every choice has finished; an error in one
ends them all (the others are cancelled and set their cancel keys), and so does the caller
going away. The queue between them is bounded: a slow client slows every choice's relay.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from gateway.relay import Delta

_DONE = object()


async def merge(choices: list[AsyncIterator[Delta]], queue_bound: int = 256) -> AsyncIterator[Delta]:
    q: asyncio.Queue = asyncio.Queue(maxsize=queue_bound)

    async def pump(i: int, gen: AsyncIterator[Delta]) -> None:
        try:
            async for d in gen:
                await q.put((i, d))
            await q.put((i, _DONE))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await q.put((i, e))
        finally:
            await gen.aclose()

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(choices)]
    counts = [0] * len(choices)
    left = len(choices)
    try:
        while left:
            i, item = await q.get()
            if item is _DONE:
                left -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            counts[i] = item.completion_tokens
            yield dataclasses.replace(item, choice=i, completion_tokens=sum(counts))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
