"""OpenAI response shapes for both endpoints, streamed (SSE) and whole.

One SSE event per relayed token, `id: <token index>`, so a client that lost its connection can
resume with `Last-Event-ID` (see `resume.py`): the event for index i is the same on every
connection. After the last token: a usage chunk (if `stream_options.include_usage`) and
`data: [DONE]`, neither with an id. Errors after the headers are sent go in-band as
`data: {"error": {...}}` the way OpenAI does.

Chat chunks carry `delta.role` on the event of index 0 and `delta.content` on every event.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from starlette.requests import Request

from gateway.relay import Delta
from gateway.resume import StreamMeta
from gateway.service import GatewayService
from gateway.validation import Prepared
from tandem_core.errors import TandemError, WorkerFailed

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


def error_body(e: TandemError) -> dict:
    code = e.error_type if not isinstance(e, WorkerFailed) else "worker_error"
    return {"message": e.message, "type": e.error_type, "param": e.param, "code": code}


def usage(meta: StreamMeta, completion_tokens: int) -> dict:
    p = meta.prompt_tokens
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def _choice(meta: StreamMeta, d: Delta) -> dict:
    if meta.kind == "chat":
        delta = {"role": "assistant", "content": d.text} if d.index == 0 else {"content": d.text}
        return {"index": 0, "delta": delta, "finish_reason": d.finish_reason, "logprobs": None}
    return {"index": 0, "text": d.text, "finish_reason": d.finish_reason, "logprobs": None}


def chunk(meta: StreamMeta, d: Delta | None, usage_: dict | None = None) -> dict:
    """One streamed chunk: a token's delta, or (d None) the usage chunk with no choices."""
    obj = "chat.completion.chunk" if meta.kind == "chat" else "text_completion"
    c = {"id": meta.request_id, "object": obj, "created": meta.created, "model": meta.model,
         "choices": [] if d is None else [_choice(meta, d)]}
    if meta.include_usage:
        c["usage"] = usage_
    return c


def whole(meta: StreamMeta, text: str, finish: str | None, completion_tokens: int) -> dict:
    """The non-streamed response body."""
    if meta.kind == "chat":
        obj = "chat.completion"
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
    else:
        obj = "text_completion"
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": meta.request_id, "object": obj, "created": meta.created, "model": meta.model,
            "choices": [choice], "usage": usage(meta, completion_tokens)}


def event(data: dict | str, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}data: {payload}\n\n".encode()


async def sse_events(svc: GatewayService, prep: Prepared, start: int = 0) -> AsyncIterator[bytes]:
    """The request's events from token index `start` on, then usage (if asked) and [DONE]."""
    meta: StreamMeta = prep.meta
    n = 0
    try:
        async for d in svc.stream(prep):
            n = d.completion_tokens
            if d.index >= start:
                yield event(chunk(meta, d), d.index)
        if meta.include_usage:
            yield event(chunk(meta, None, usage(meta, n)))
    except TandemError as e:
        yield event({"error": error_body(e)})
    except Exception as e:  # noqa: BLE001 - logged with the traceback, reported in-band
        log.exception("relay failed request_id=%s", prep.request.request_id)
        yield event({"error": {"message": f"internal error: {type(e).__name__}", "type": "internal_error",
                               "param": None, "code": "internal_error"}})
    yield event("[DONE]")


async def _collect(svc: GatewayService, prep: Prepared) -> tuple[str, str | None, int]:
    text, finish, n = [], None, 0
    async for d in svc.stream(prep):
        text.append(d.text)
        finish, n = d.finish_reason, d.completion_tokens
    return "".join(text), finish, n


async def collect_unless_disconnected(
    request: Request, svc: GatewayService, prep: Prepared
) -> tuple[str, str | None, int] | None:
    """The whole completion, or None if the client hung up first (then the relay is cancelled:
    it sets the cancel key, or for a resumable request starts the grace period)."""
    task = asyncio.ensure_future(_collect(svc, prep))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client disconnected request_id=%s", prep.request.request_id)
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
