"""HTTP front end: the OpenAI-compatible completions and chat completions APIs, stream resume,
models, health, metrics, admin.

Bodies are read here with a byte limit (413) and parsed strictly (`schemas.py`), so every
malformed request gets a 4xx naming the field. Errors leave through one exception handler (see
`app.py`) in OpenAI's `{"error": {...}}` shape. Response shapes live in `sse.py`.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from gateway import resume
from gateway.metrics import CONTENT_TYPE
from gateway.schemas import ChatBody, CompletionBody, parse_body
from gateway.service import GatewayService, RequestNotFound
from gateway.sse import collect_unless_disconnected, error_body, sse_events, whole
from gateway.validation import CompletionParams, Prepared
from tandem_core.errors import InvalidRequest

__all__ = ["router", "error_body"]

log = logging.getLogger(__name__)
router = APIRouter()
_BIG_CHAT_CHARS = 8192  # render longer conversations off the event loop
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def get_service(request: Request) -> GatewayService:
    return request.app.state.gateway


Service = Annotated[GatewayService, Depends(get_service)]
Auth = Annotated[str | None, Header(alias="Authorization")]


class BodyTooLarge(InvalidRequest):
    http_status = 413
    error_type = "request_too_large"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body is {declared} bytes, larger than the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"request body is larger than the limit of {limit} bytes")
    return bytes(body)


# ---------------------------------------------------------------- completions and chat


@router.post("/v1/completions")
async def completions(request: Request, svc: Service, authorization: Auth = None) -> Response:
    key = svc.check_api_key(authorization)
    body: CompletionBody = parse_body(await read_body(request, svc.settings.max_body_bytes), CompletionBody)
    prep = await svc.prepare(body.to_params())
    return await _respond(request, svc, prep, body, "completion", key)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, svc: Service, authorization: Auth = None) -> Response:
    key = svc.check_api_key(authorization)
    body: ChatBody = parse_body(await read_body(request, svc.settings.max_body_bytes), ChatBody)
    params = body.to_params()
    messages = body.chat_messages()
    if sum(len(m["content"]) for m in messages) > _BIG_CHAT_CHARS:
        params.prompt = await asyncio.to_thread(svc.chat_template.render, messages)
    else:
        params.prompt = svc.chat_template.render(messages)
    prep = await _prepare_chat(svc, params)
    return await _respond(request, svc, prep, body, "chat", key)


async def _prepare_chat(svc: GatewayService, params: CompletionParams) -> Prepared:
    """Like `prepare`, with prompt errors reported against `messages` (what the client sent)."""
    params.request_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        return await svc.prepare(params)
    except InvalidRequest as e:
        if e.param != "prompt":
            raise
        raise type(e)(e.message.replace("prompt", "messages (after the chat template)", 1),
                      param="messages") from e


async def _respond(request: Request, svc: GatewayService, prep: Prepared, body: CompletionBody | ChatBody,
                   kind: str, key: str) -> Response:
    rid = prep.request.request_id
    prep.resumable = body.resumable
    prep.meta = resume.StreamMeta(kind, rid, int(time.time()), prep.model, prep.prompt_tokens, body.include_usage)
    await svc.submit(prep, fresh_id=True, api_key=key)
    if body.stream:
        return StreamingResponse(sse_events(svc, prep), media_type="text/event-stream",
                                 headers={**_SSE_HEADERS, "X-Request-Id": rid})
    collected = await collect_unless_disconnected(request, svc, prep)
    if collected is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(whole(prep.meta, *collected), headers={"X-Request-Id": rid})


@router.get("/v1/requests/{request_id}/stream")
async def resume_stream(
    request_id: str, svc: Service, authorization: Auth = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    from_index: Annotated[str | None, Query(alias="from")] = None,
) -> Response:
    """Resume a `"resumable": true` request's SSE stream after the event `Last-Event-ID` (or from
    token index `?from=N`); the events are the same as the first connection's, none repeated."""
    key = svc.check_api_key(authorization)
    start = resume.start_index(last_event_id, from_index)
    if not _REQUEST_ID.match(request_id):
        raise RequestNotFound(f"request id {request_id[:64]!r} is not a valid request id", param="request_id")
    prep = await svc.reattach(request_id, key)
    return StreamingResponse(sse_events(svc, prep, start), media_type="text/event-stream",
                             headers={**_SSE_HEADERS, "X-Request-Id": request_id})


# ---------------------------------------------------------------- models, health, metrics, admin


@router.get("/v1/models")
async def models(svc: Service, authorization: Auth = None) -> dict:
    svc.check_api_key(authorization)
    return {
        "object": "list",
        "data": [{"id": svc.model_name, "object": "model", "created": 0, "owned_by": "tandem",
                  "max_model_len": svc.settings.max_context_len}],
    }


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(svc: Service) -> JSONResponse:
    if await svc.ready():
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not ready", "reason": "Redis is unreachable"}, status_code=503)


@router.get("/metrics")
async def metrics(svc: Service) -> Response:
    await svc.refresh_load()
    return PlainTextResponse(svc.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/admin/cluster")
async def cluster(svc: Service, authorization: Auth = None) -> dict:
    svc.check_admin_key(authorization)
    return await svc.cluster()
