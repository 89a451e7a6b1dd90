"""HTTP front end: the OpenAI-compatible completions API, models, health, metrics, admin.

Bodies are read here with a byte limit (413) and parsed with pydantic models that forbid unknown
fields, so every malformed request gets a 400 naming the field. Errors leave through one
exception handler (see `app.py`) in OpenAI's `{"error": {...}}` shape.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from gateway.metrics import CONTENT_TYPE
from gateway.relay import Delta
from gateway.service import GatewayService
from gateway.validation import CompletionParams, Prepared
from tandem_core.errors import InvalidRequest, TandemError, WorkerFailed

log = logging.getLogger(__name__)
router = APIRouter()
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CompletionBody(BaseModel):
    """POST /v1/completions (OpenAI) plus two extensions: `ignore_eos` and `priority`."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[str] | list[int]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: StrictBool = False
    priority: Literal["normal", "high"] | None = None

    def to_params(self) -> CompletionParams:
        if self.n != 1:
            raise InvalidRequest(f"n must be 1 (one completion per request), got {self.n}", param="n")
        prompt, ids = self.prompt, None
        if isinstance(prompt, list):
            if not prompt:
                raise InvalidRequest("prompt is empty: send a non-empty string", param="prompt")
            if all(isinstance(x, int) for x in prompt):
                prompt, ids = None, list(prompt)
            elif len(prompt) == 1:
                prompt = prompt[0]
            else:
                raise InvalidRequest(
                    f"prompt must be a string, a list of one string or a list of token ids; got a list of "
                    f"{len(prompt)} strings", param="prompt",
                )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return CompletionParams(
            prompt=prompt, prompt_ids=ids, model=self.model, max_tokens=self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=stop, ignore_eos=self.ignore_eos, priority=self.priority,
        )


def get_service(request: Request) -> GatewayService:
    return request.app.state.gateway


Service = Annotated[GatewayService, Depends(get_service)]
Auth = Annotated[str | None, Header(alias="Authorization")]


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


class BodyTooLarge(InvalidRequest):
    http_status = 413
    error_type = "request_too_large"


def parse_body(raw: bytes) -> CompletionBody:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return CompletionBody.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from e


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _validation_error(e: ValidationError) -> InvalidRequest:
    err = e.errors(include_url=False)[0]
    loc = [x for x in err.get("loc", ()) if isinstance(x, str) and x not in _UNION_TAGS and "[" not in x]
    field = ".".join(loc) or "body"
    if err.get("type") == "extra_forbidden":
        return InvalidRequest(f"unknown field {field!r}", param=field)
    if err.get("type") == "missing":
        return InvalidRequest(f"field {field!r} is required", param=field)
    return InvalidRequest(f"invalid value for {field!r}: {err.get('msg')}", param=field)


# ---------------------------------------------------------------- completions


@router.post("/v1/completions")
async def completions(request: Request, svc: Service, authorization: Auth = None) -> Response:
    svc.check_api_key(authorization)
    body = parse_body(await read_body(request, svc.settings.max_body_bytes))
    params = body.to_params()
    prep = await svc.prepare(params)
    await svc.submit(prep, fresh_id=True)
    created = int(time.time())
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(svc, prep, created, usage), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": prep.request.request_id},
        )
    collected = await _collect_unless_disconnected(request, svc, prep)
    if collected is None:
        return Response(status_code=499)  # nobody is listening; the relay set the cancel key
    text, finish, n = collected
    return JSONResponse(
        {
            "id": prep.request.request_id, "object": "text_completion", "created": created, "model": prep.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(prep, n),
        },
        headers={"X-Request-Id": prep.request.request_id},
    )


async def _collect(svc: GatewayService, prep: Prepared) -> tuple[str, str | None, int]:
    text, finish, n = [], None, 0
    async for d in svc.stream(prep):
        text.append(d.text)
        finish, n = d.finish_reason, d.completion_tokens
    return "".join(text), finish, n


async def _collect_unless_disconnected(
    request: Request, svc: GatewayService, prep: Prepared
) -> tuple[str, str | None, int] | None:
    """The whole completion, or None if the client hung up first (then the relay is cancelled,
    which sets the request's cancel key so workers free the slot)."""
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


def _usage(prep: Prepared, completion_tokens: int) -> dict:
    p = prep.prompt_tokens
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def _chunk(prep: Prepared, created: int, choices: list, usage: dict | None, with_usage: bool) -> dict:
    c = {"id": prep.request.request_id, "object": "text_completion", "created": created, "model": prep.model,
         "choices": choices}
    if with_usage:
        c["usage"] = usage
    return c


def _event(data: dict | str, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}data: {payload}\n\n".encode()


async def _sse(svc: GatewayService, prep: Prepared, created: int, with_usage: bool) -> AsyncIterator[bytes]:
    """One SSE event per relayed token (id = token index), then usage (if asked) and [DONE]."""
    n = 0
    try:
        async for d in svc.stream(prep):
            n = d.completion_tokens
            yield _event(_chunk(prep, created, [_choice(d)], None, with_usage), d.index)
        if with_usage:
            yield _event(_chunk(prep, created, [], _usage(prep, n), True))
    except TandemError as e:
        # Headers are gone: report in-band the way OpenAI does (the client raises APIError).
        yield _event({"error": error_body(e)})
    except Exception as e:  # noqa: BLE001 - logged with the traceback, reported in-band
        log.exception("relay failed request_id=%s", prep.request.request_id)
        yield _event({"error": {"message": f"internal error: {type(e).__name__}", "type": "internal_error",
                                "param": None, "code": "internal_error"}})
    yield _event("[DONE]")


def _choice(d: Delta) -> dict:
    return {"index": 0, "text": d.text, "finish_reason": d.finish_reason, "logprobs": None}


def error_body(e: TandemError) -> dict:
    code = e.error_type if not isinstance(e, WorkerFailed) else "worker_error"
    return {"message": e.message, "type": e.error_type, "param": e.param, "code": code}


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
    return PlainTextResponse(svc.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/admin/cluster")
async def cluster(svc: Service, authorization: Auth = None) -> dict:
    svc.check_admin_key(authorization)
    return await svc.cluster()
