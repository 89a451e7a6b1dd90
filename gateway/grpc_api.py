"""gRPC front end: `tandem.v1.Tandem/Generate`, with the same semantics as /v1/completions.

The servicer converts the proto into `CompletionParams` (the same sampling, n and logprobs fields
as HTTP; echo is HTTP-only) and streams one `GenerateResponse` per relayed token through the
shared `GatewayService`; with n > 1 each carries its `choice_index`, with logprobs its `logprob`
and `top_logprobs`; the last response of each choice carries finish_reason and prompt_tokens. Errors map to status codes in one place (`grpc_util.abort_with`). A client cancel
cancels this coroutine, and the relay then sets the request's cancel key.
"""
from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator

import grpc

from gateway.service import GatewayService
from gateway.validation import CompletionParams
from tandem_core import grpc_util
from tandem_core.errors import InvalidRequest, TandemError
from tandem_core.tokenizer import Tokenizer
from tandem_proto import generate_pb2, generate_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name  # tandem.v1.Tandem


def to_params(req: generate_pb2.GenerateRequest) -> CompletionParams:
    """Proto3 zero values mean "unset": max_tokens 0 -> default, top_p 0 -> off, temperature 0 ->
    greedy, penalties 0 -> off, n 0 -> 1; `optional` fields (seed, repetition_penalty, logprobs,
    skip_special_tokens, speculative) are unset when absent."""
    s = req.sampling
    has_sampling = req.HasField("sampling")
    return CompletionParams(
        prompt=(req.prompt or None) if not req.prompt_token_ids else None,
        prompt_ids=list(req.prompt_token_ids) if req.prompt_token_ids else None,
        model=req.model or None,
        max_tokens=req.max_tokens if req.max_tokens != 0 else None,
        temperature=float(s.temperature) if has_sampling else 0.0,
        top_p=float(s.top_p) if has_sampling and s.top_p != 0 else None,
        top_k=int(s.top_k) if has_sampling else None,
        seed=int(s.seed) if has_sampling and s.HasField("seed") else None,
        stop=list(req.stop),
        priority=req.priority or None,
        ignore_eos=req.ignore_eos,
        request_id=req.request_id or None,
        n=req.n or None,
        presence_penalty=float(s.presence_penalty) if s.presence_penalty else None,
        frequency_penalty=float(s.frequency_penalty) if s.frequency_penalty else None,
        repetition_penalty=float(s.repetition_penalty) if s.HasField("repetition_penalty") else None,
        logit_bias={int(t): float(b) for t, b in s.logit_bias.items()} or None,
        min_tokens=int(s.min_tokens) if s.min_tokens else None,
        stop_token_ids=list(req.stop_token_ids),
        logprobs=int(req.logprobs) if req.HasField("logprobs") else None,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        speculative=req.speculative if req.HasField("speculative") else True,
    )


def to_response(rid: str, d, prompt_tokens: int, tokenizer: Tokenizer) -> generate_pb2.GenerateResponse:
    """One relayed token (a relay Delta) as a GenerateResponse; the last one of each choice carries
    finish_reason and prompt_tokens. Reads `choice` and `logprobs` where the Delta has them."""
    last = d.finish_reason is not None
    out = generate_pb2.GenerateResponse(
        request_id=rid, index=d.index, token_id=d.token_id, text=d.text, finish_reason=d.finish_reason or "",
        prompt_tokens=prompt_tokens if last else 0, choice_index=getattr(d, "choice", 0),
    )
    lp = getattr(d, "logprobs", None)
    if lp is not None:
        out.logprob = lp.logprob
        out.top_logprobs.extend(
            generate_pb2.TopLogprob(token_id=t, logprob=v, text=tokenizer.token_bytes(t).decode("utf-8", "replace"))
            for t, v in lp.top
        )
    return out


class TandemServicer(generate_pb2_grpc.TandemServicer):
    def __init__(self, svc: GatewayService) -> None:
        self.svc = svc

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        rid = request.request_id
        try:
            key = self.svc.auth.check_api_key(_metadata(context, "authorization"))
            if request.prompt and request.prompt_token_ids:
                raise InvalidRequest("send either prompt or prompt_token_ids, not both", param="prompt")
            prep = await self.svc.prepare(to_params(request))
            rid = prep.request.request_id
            att = await self.svc.admission.submit(prep, fresh_id=not request.request_id, api_key=key)
            async for d in self.svc.streaming.stream(att):
                yield to_response(rid, d, prep.prompt_tokens, self.svc.tokenizer)
        except TandemError as e:
            if e.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(max(1, math.ceil(e.retry_after_s)))),))
            await grpc_util.abort_with(context, e, rid)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - INTERNAL, logged with the traceback
            await grpc_util.abort_with(context, e, rid)


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


def add_to_server(server: grpc.aio.Server, svc: GatewayService) -> None:
    generate_pb2_grpc.add_TandemServicer_to_server(TandemServicer(svc), server)
