"""HTTP front end: the OpenAI-compatible completions, chat completions and Responses APIs, stream resume,
models, vLLM's /tokenize and /detokenize, health, metrics, admin.

POST bodies must be JSON (415 otherwise), are read here with a byte limit (413) and parsed
strictly (`schemas.py`, `jsonbody.py`), so every malformed request gets a 4xx naming the field;
/openapi.json documents the bodies and status codes (`openapi.py`). Errors leave through one
exception handler (see `app.py`) in OpenAI's `{"error": {...}}` shape. Response shapes live in
`sse.py`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from gateway import openapi, responses, resume
from gateway.chatformat import OutputSpec
from gateway.jsonbody import load_json, parse_body
from gateway.metrics import CONTENT_TYPE
from gateway.schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody, chat_messages
from gateway.service import GatewayService, RequestNotFound
from gateway.sse import collect_unless_disconnected, error_body, formatter, sse_events
from gateway.validation import CompletionParams, Prepared, check_model
from tandem_core.errors import InvalidRequest, ModelNotFound

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
# A client-chosen request id: sending the same POST again with it is safe (see `_respond`).
ClientId = Annotated[str | None, Header(alias="X-Request-Id")]


class BodyTooLarge(InvalidRequest):
    http_status = 413
    error_type = "request_too_large"


class UnsupportedMediaType(InvalidRequest):
    http_status = 415
    error_type = "unsupported_media_type"


def check_json(request: Request) -> None:
    """415 unless the body is declared JSON. A missing Content-Type is read as JSON (the strict
    parse still applies); `curl -d` without -H sends application/x-www-form-urlencoded."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise UnsupportedMediaType(
        f"Content-Type {declared[:64]!r} is not supported: send the body as JSON with "
        f"'Content-Type: application/json'", param="Content-Type",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed `limit` bytes (415 if it is not JSON)."""
    check_json(request)
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


@router.post("/v1/completions", responses={**openapi.completion_response(
    "with `stream: true` an SSE stream of `text_completion` chunks"), **openapi.errors(*openapi.GENERATE)},
    openapi_extra=openapi.json_body(CompletionBody))
async def completions(request: Request, svc: Service, authorization: Auth = None,
                      client_id: ClientId = None) -> Response:
    key = svc.auth.check_api_key(authorization)
    body: CompletionBody = parse_body(await read_body(request, svc.settings.max_body_bytes), CompletionBody)
    params = body.to_params()
    params.request_id = client_id
    prep = await svc.prepare(params)
    return await _respond(request, svc, prep, body, "completion", key, chosen_id=client_id is not None)


@router.post("/v1/chat/completions", responses={**openapi.completion_response(
    "with `stream: true` an SSE stream of `chat.completion.chunk` chunks"), **openapi.errors(*openapi.GENERATE)},
    openapi_extra=openapi.json_body(ChatBody))
async def chat_completions(request: Request, svc: Service, authorization: Auth = None,
                           client_id: ClientId = None) -> Response:
    key = svc.auth.check_api_key(authorization)
    body: ChatBody = parse_body(await read_body(request, svc.settings.max_body_bytes), ChatBody)
    prep, output = await _chat(svc, body, client_id or f"chatcmpl-{uuid.uuid4().hex}")
    return await _respond(request, svc, prep, body, "chat", key, output, chosen_id=client_id is not None)


async def _chat(svc: GatewayService, body: ChatBody, request_id: str) -> tuple[Prepared, OutputSpec]:
    """A chat body prepared (rendered in the model family's format, tokenized, checked), and how
    its output is parsed (reasoning, tool calls). Shared by /v1/chat/completions and /v1/responses."""
    fmt = svc.chat_format  # the model family's output format (gateway/chatformat.py)
    params = body.to_params(fmt.syntax)
    tools = body.tool_plan()
    params.prompt = await _render(svc, fmt.history(body.chat_messages()), tools.tools, body.template_kwargs())
    params.add_special_tokens = svc.chat_template.add_special_tokens
    params.skip_special_tokens = params.skip_special_tokens and not fmt.keeps_specials(tools.parse)  # markers
    if not params.ignore_eos:  # the family's end of turn, besides EOS
        params.stop_token_ids = [*params.stop_token_ids, *fmt.stop_token_ids]
    params.request_id = request_id
    return await _prepare_chat(svc, params), fmt.output(params.prompt, tools.parse)


@router.post("/v1/responses", responses={**openapi.response_object(), **openapi.errors(*openapi.GENERATE)},
             openapi_extra=openapi.json_body(responses.ResponsesBody))
async def create_response(request: Request, svc: Service, authorization: Auth = None) -> Response:
    """OpenAI's Responses API, stateless (gateway/responses.py): served by the chat path."""
    key = svc.auth.check_api_key(authorization)
    rbody = responses.parse(load_json(await read_body(request, svc.settings.max_body_bytes)))
    body = responses.to_chat(rbody)
    rid = f"resp_{uuid.uuid4().hex}"
    prep, output = await _chat(svc, body, rid)
    meta = resume.StreamMeta("chat", rid, int(time.time()), prep.model, prep.prompt_tokens, False,
                             **_output_fields(output))
    prep = dataclasses.replace(prep, resumable=False, meta=meta)
    att = await svc.admission.submit(prep, fresh_id=True, api_key=key)
    # the family's parser splits reasoning out (reasoning_content); the Shaper's own <think> split
    # covers a model whose template the parser does not know
    thinking = output.reasoning == "" and (prep.prompt_text or "").rstrip().endswith(responses.THINK_OPEN)
    shaper = responses.Shaper(rbody, rid, prep.model, prep.prompt_tokens, starts_thinking=thinking)
    fmt = formatter(att.prep, svc.token_text)
    if rbody.stream:
        return StreamingResponse(responses.events(svc.streaming.stream(att), fmt, shaper), media_type="text/event-stream",
                                 headers={**_SSE_HEADERS, "X-Request-Id": rid})
    deltas = svc.streaming.stream(att)
    collected = await collect_unless_disconnected(request, deltas, att.prep, svc.token_text,
                                                  responses.whole(deltas, fmt, shaper))
    if collected is None:
        return Response(status_code=499)
    return JSONResponse(collected, headers={"X-Request-Id": rid})


async def _render(svc: GatewayService, messages: list[dict], tools: list[dict] | None = None,
                  kwargs: dict | None = None) -> str:
    size = sum(len(m["content"]) for m in messages) + (len(tools) * 256 if tools else 0)
    if size > _BIG_CHAT_CHARS:
        return await asyncio.to_thread(svc.chat_template.render, messages, tools, kwargs)
    return svc.chat_template.render(messages, tools, kwargs)


async def _prepare_chat(svc: GatewayService, params: CompletionParams) -> Prepared:
    """Like `prepare`, with prompt errors reported against `messages` (what the client sent)."""
    try:
        return await svc.prepare(params)
    except InvalidRequest as e:
        if e.param != "prompt":
            raise
        raise type(e)(e.message.replace("prompt", "messages (after the chat template)", 1),
                      param="messages") from e


async def _respond(request: Request, svc: GatewayService, prep: Prepared, body: CompletionBody | ChatBody,
                   kind: str, key: str, output: OutputSpec | None = None, chosen_id: bool = False) -> Response:
    """Complete the request with what only HTTP knows (resumable, the stream's format), submit and
    answer. With a client-chosen id (`X-Request-Id`), a POST that reaches the gateway
    again after its client lost the first one unanswered is not run twice: a resumable request
    already admitted is replayed from its first event (`Streaming.resend`)."""
    rid = prep.request.request_id
    meta = resume.StreamMeta(kind, rid, int(time.time()), prep.model, prep.prompt_tokens, body.include_usage,
                             continuous_usage=prep.continuous_usage, logprobs=prep.logprobs,
                             echo=_echo_text(svc, prep) if prep.echo else None, **_output_fields(output))
    prep = dataclasses.replace(prep, resumable=body.resumable, meta=meta)
    att = await svc.streaming.resend(prep, key) if chosen_id else None
    if att is not None:
        log.info("request_id=%s sent again: replaying it from its first event", rid)
    else:
        att = await svc.admission.submit(prep, fresh_id=not chosen_id, api_key=key)
    if body.stream:
        return StreamingResponse(sse_events(svc.streaming.stream(att), att.prep, svc.token_text),
                                 media_type="text/event-stream", headers={**_SSE_HEADERS, "X-Request-Id": rid})
    collected = await collect_unless_disconnected(request, svc.streaming.stream(att), att.prep, svc.token_text)
    if collected is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(collected, headers={"X-Request-Id": rid})


def _output_fields(output: OutputSpec | None) -> dict:
    """A chat's OutputSpec as StreamMeta fields (stored with a resumable stream)."""
    return {} if output is None else {"tools": output.tools, "reasoning": output.reasoning,
                                      "reasoning_open": output.reasoning_open, "tool_parser": output.tool_parser}


def _echo_text(svc: GatewayService, prep: Prepared) -> str:
    """What echo writes before the output: the prompt as sent, or a token-id prompt decoded."""
    if prep.prompt_text is not None:
        return prep.prompt_text
    return svc.tokenizer.decode(prep.request.prompt_ids, skip_special_tokens=prep.skip_special_tokens)


@router.get("/v1/requests/{request_id}/stream", responses={
    200: openapi.sse_response("The remaining SSE events"),
    **openapi.errors(400, 401, 404, 503)})
async def resume_stream(
    request_id: str, svc: Service, authorization: Auth = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    from_index: Annotated[str | None, Query(alias="from")] = None,
) -> Response:
    """Resume a `"resumable": true` request's SSE stream after the event `Last-Event-ID` (or from
    token index `?from=N`); the events are the same as the first connection's, none repeated."""
    key = svc.auth.check_api_key(authorization)
    start = resume.start_index(last_event_id, from_index)
    if not _REQUEST_ID.match(request_id):
        raise RequestNotFound(f"request id {request_id[:64]!r} is not a valid request id", param="request_id")
    att = await svc.streaming.reattach(request_id, key)
    return StreamingResponse(sse_events(svc.streaming.stream(att), att.prep, svc.token_text, start),
                             media_type="text/event-stream", headers={**_SSE_HEADERS, "X-Request-Id": request_id})


# ---------------------------------------------------------------- models, health, metrics, admin


def _model_card(svc: GatewayService) -> dict:
    return {"id": svc.model_name, "object": "model", "created": 0, "owned_by": "tandem",
            "max_model_len": svc.settings.max_context_len}


@router.get("/v1/models", responses=openapi.errors(401))
async def models(svc: Service, authorization: Auth = None) -> dict:
    svc.auth.check_api_key(authorization)
    return {"object": "list", "data": [_model_card(svc)]}


@router.get("/v1/models/{model_id:path}", responses=openapi.errors(401, 404))
async def model(model_id: str, svc: Service, authorization: Auth = None) -> dict:
    """The served model under any of its names (`client.models.retrieve`); the card names it by
    its served name."""
    svc.auth.check_api_key(authorization)
    if not model_id:
        raise ModelNotFound(f"no model id given; this gateway serves {svc.model_name!r}", param="model")
    check_model(model_id, svc.settings, svc.info)
    return _model_card(svc)


# ---------------------------------------------------------------- vLLM's tokenizer endpoints


@router.post("/tokenize", responses=openapi.errors(*openapi.TOKENIZE), openapi_extra=openapi.json_body(TokenizeBody))
async def tokenize(request: Request, svc: Service, authorization: Auth = None) -> dict:
    """A prompt's token ids as /v1/completions encodes it, or a conversation's as
    /v1/chat/completions renders and encodes it."""
    svc.auth.check_api_key(authorization)
    body: TokenizeBody = parse_body(await read_body(request, svc.settings.max_body_bytes), TokenizeBody)
    check_model(body.model, svc.settings, svc.info)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send either prompt or messages", param="prompt")
    if body.tools is not None and body.messages is None:
        raise InvalidRequest("tools needs messages (they are rendered with the chat template)", param="tools")
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
        text = await _render(svc, svc.chat_format.history(chat_messages(body.messages)), tools,
                             body.chat_template_kwargs)
        add = svc.chat_template.add_special_tokens
    else:
        text, add = body.prompt, True
    add = add if body.add_special_tokens is None else body.add_special_tokens
    if len(text) > _BIG_CHAT_CHARS:
        ids = await asyncio.to_thread(svc.tokenizer.encode, text, add)
    else:
        ids = svc.tokenizer.encode(text, add_special_tokens=add)
    return {"count": len(ids), "max_model_len": svc.settings.max_context_len, "tokens": ids}


@router.post("/detokenize", responses=openapi.errors(*openapi.TOKENIZE),
             openapi_extra=openapi.json_body(DetokenizeBody))
async def detokenize(request: Request, svc: Service, authorization: Auth = None) -> dict:
    """Token ids -> text, special tokens included (as vLLM's /detokenize)."""
    svc.auth.check_api_key(authorization)
    body: DetokenizeBody = parse_body(await read_body(request, svc.settings.max_body_bytes), DetokenizeBody)
    check_model(body.model, svc.settings, svc.info)
    vocab = svc.info.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    if len(body.tokens) > _BIG_CHAT_CHARS:
        text = await asyncio.to_thread(svc.tokenizer.decode, body.tokens, False)
    else:
        text = svc.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return {"prompt": text}


# ---------------------------------------------------------------- health, metrics, admin


@router.get("/healthz")
@router.head("/healthz", include_in_schema=False)  # HEAD on the health routes: load balancers' probes
@router.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)  # vLLM's name for it
async def healthz() -> dict:
    return {"status": "ok"}


@router.head("/readyz", include_in_schema=False)
@router.get("/readyz", responses={503: {"description": "Redis has been unreachable for longer than redis_hold_s"}})
async def readyz(svc: Service) -> JSONResponse:
    state = await svc.report.ready()
    if state == "ready":
        return JSONResponse({"status": "ready"})
    if state == "degraded":  # still 200: new requests wait for Redis (gateway/hold.py)
        return JSONResponse({"status": "degraded", "reason": "Redis is unreachable; new requests wait for it",
                             "waiting_requests": svc.hold.holding})
    return JSONResponse({"status": "not ready", "reason": "Redis is unreachable"}, status_code=503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(svc: Service) -> Response:
    if svc.settings.metrics_port:  # served on its own port only, so a NetworkPolicy can keep it in
        return JSONResponse({"error": {"message": f"/metrics is served on port {svc.settings.metrics_port} "
                                                  "(metrics_port), not on the API port", "type": "not_found_error",
                                       "param": None, "code": "not_found_error"}}, status_code=404)
    await svc.report.refresh_load()
    return PlainTextResponse(svc.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/admin/cluster", responses=openapi.errors(401, 403, 503))
async def cluster(svc: Service, authorization: Auth = None) -> dict:
    svc.auth.check_admin_key(authorization)
    return await svc.report.cluster()
