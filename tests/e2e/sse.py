"""The e2e tests' reader of the gateway's server-sent events: each `data:` chunk with the `id:` of
its event (a stream's token index, what a resuming client sends back as `from`), so the tests that
check every index arrives exactly once read a stream the same way."""
from __future__ import annotations

import json
from typing import AsyncIterator

import httpx


async def sse_chunks(resp: httpx.Response) -> AsyncIterator[tuple[int | None, dict]]:
    """(event id or None, parsed chunk) for every `data:` line but the closing `[DONE]`."""
    event_id = None
    async for line in resp.aiter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: ") and line != "data: [DONE]":
            yield event_id, json.loads(line[6:])
