"""The gateway's side of a request after admission: relay its tokens to the client, attach again.

`Streaming.stream(attachment)` is the one relay loop both front ends iterate: one `relay`
(relay.py) of the request's token stream, or with n > 1 one per choice merged (choices.py). It
counts the relay as open while it runs (the bound admission checks), counts its outcome once,
tells the readmitter it is over, and releases the attachment's limiter lease with the tokens
actually used. When the client of a resumable request goes away, the relay starts a grace timer
instead of cancelling (`_grace_cancel`, resume.py's policy).

A client attaches again in two ways, both answered with an `Attachment` (attachment.py) that
replays the token stream from its first entry:
1. `reattach`: GET /v1/requests/{id}/stream, the resume of a resumable request (any replica).
2. `resend`: the same POST sent again with its X-Request-Id after its client lost the first
   answer; a resumable request is replayed as a resume would be, any other is refused.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis

from gateway import choices, resume
from gateway.attachment import Attachment
from gateway.hold import RedisHold
from gateway.metrics import GatewayMetrics
from gateway.relay import Delta, cancel_soon, relay
from gateway.settings import GatewaySettings
from gateway.tokens import TokenMux
from gateway.validation import Prepared
from tandem_core.bus import admission, conn
from tandem_core.errors import DeadlineExceeded, InvalidRequest, ServiceUnavailable, TandemError
from tandem_core.bus import KeySpace
from tandem_core.tokenizer import Tokenizer
from tandem_core.types import GenerationRequest

log = logging.getLogger(__name__)

REDIS_DOWN = conn.REDIS_DOWN  # restarts and Sentinel failovers alike (MasterNotFoundError, READONLY)


class RequestNotFound(TandemError):
    """No resumable request by that id for this key: it is unknown, expired, another key's, or was
    sent without "resumable": true. Send the request again."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    error_type = "not_found_error"


def redis_unreachable(e: Exception, retry_after_s: float) -> ServiceUnavailable:
    return ServiceUnavailable(f"Redis is unreachable: {e}; retry after {retry_after_s:g}s",
                              retry_after_s=retry_after_s)


class Streaming:
    """Relays for one gateway replica. `redis()` and `mux()` raise ServiceUnavailable before the
    app's lifespan has connected; `forget(request_id)` is told when a relay ends (the readmitter)."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, tokenizer: Tokenizer,
                 redis: Callable[[], aioredis.Redis], ks: KeySpace, mux: Callable[[], TokenMux], hold: RedisHold,
                 forget: Callable[[str], None]) -> None:
        self.settings, self.metrics, self.tokenizer = settings, metrics, tokenizer
        self.redis, self.ks, self.mux, self.hold, self.forget = redis, ks, mux, hold, forget
        self.open = 0  # relays in progress (all share the one token reader)
        self.background: set[asyncio.Task] = set()  # cancel keys written after a caller went away
        self.grace_tasks: set[asyncio.Task] = set()  # grace timers of detached resumable requests

    async def stream(self, att: Attachment) -> AsyncIterator[Delta]:
        """Relay the request's tokens; counts the outcome once and releases the key's lease."""
        s, prep = self.settings, att.prep
        outcome, generated = "disconnected", 0
        self.open += 1
        gen: AsyncIterator[Delta] | None = None
        try:
            gen = self._relays(att)
            async for delta in gen:
                generated = delta.completion_tokens
                if delta.finish_reason:
                    outcome = delta.finish_reason
                yield delta
        except DeadlineExceeded:
            outcome = "timeout"
            raise
        except TandemError as e:
            outcome = e.error_type
            raise
        except REDIS_DOWN as e:
            outcome = "service_unavailable"
            raise redis_unreachable(e, s.retry_after_s) from e
        finally:
            self.open -= 1
            self.forget(att.request_id)
            if gen is not None:
                await gen.aclose()
            self.metrics.requests.labels(outcome).inc()
            self.metrics.generation_tokens.inc(generated)
            att.release(prep.prompt_tokens + generated)

    def _relays(self, att: Attachment) -> AsyncIterator[Delta]:
        """The request's relay, or with n > 1 its choices' relays merged."""
        s, prep = self.settings, att.prep
        total_s, first_s = s.request_timeout_s, s.first_token_timeout_s
        if prep.replay:  # a resume: whatever is left of the request's own deadline
            total_s = first_s = max(prep.request.deadline_ts - time.time(), 2.0)
        relay_args = dict(
            entry_id=att.entry_id, block_ms=s.relay_block_ms, request_timeout_s=total_s, first_token_timeout_s=first_s,
            cancel_ttl_s=s.token_ttl_s, metrics=self.metrics, background=self.background,
        )
        if prep.request.n > 1:
            return self._choices(prep, relay_args)
        return relay(self.redis(), self.mux(), prep, self.tokenizer, **relay_args,
                     on_detach=self._grace_cancel(att) if prep.resumable else None)

    async def _choices(self, prep: Prepared, relay_args: dict) -> AsyncIterator[Delta]:
        """The n choices merged (gateway/choices.py); only choice 0 records latency metrics. A
        merged stream that ends early also cancels the parent id, which a prefill pod checks
        before it prefills."""
        req, finished = prep.request, False
        gens = [relay(self.redis(), self.mux(),
                      dataclasses.replace(prep, request=req.choice(i), replay=prep.replay or i > 0),
                      self.tokenizer, **relay_args) for i in range(req.n)]
        try:
            left = req.n
            async for d in choices.merge(gens):
                left -= d.finish_reason is not None
                finished = left == 0
                yield d
        finally:
            if not finished:
                cancel_soon(self.redis(), self.ks, req.request_id, self.settings.token_ttl_s, self.background)

    def _grace_cancel(self, att: Attachment) -> Callable[[], None]:
        """on_detach of a resumable request: cancel later, unless a client resumed meanwhile."""
        rid, s = att.request_id, self.settings

        async def later() -> None:
            try:
                await resume.cancel_unless_attached(self.redis(), self.ks, rid, att.attach_no, s.resume_grace_s,
                                                    s.token_ttl_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("grace cancel failed request_id=%s", rid, exc_info=True)

        def start() -> None:
            log.info("client detached from resumable request_id=%s; cancel in %gs unless resumed",
                     rid, s.resume_grace_s)
            task = asyncio.get_running_loop().create_task(later())
            self.grace_tasks.add(task)
            task.add_done_callback(self.grace_tasks.discard)

        return start

    async def reattach(self, request_id: str, api_key: str) -> Attachment:
        """A resume of a resumable request: its record, re-read as a request that replays the
        stream from the first entry (RequestNotFound when unknown, expired or another key's)."""
        r = self.redis()
        missing = RequestNotFound(
            f"request {request_id[:128]!r} is unknown, expired or was not sent with \"resumable\": true; "
            f"send the request again", param="request_id",
        )
        try:
            rec = await resume.load(r, self.ks, request_id)
            if rec is None or rec.key != resume.key_digest(api_key):
                raise missing
            if time.time() > rec.deadline_ts and not await admission.started(r, self.ks, request_id):
                raise missing
            attach_no = await resume.attach(r, self.ks, request_id)
        except REDIS_DOWN as e:
            raise redis_unreachable(e, self.settings.retry_after_s) from e
        req = GenerationRequest(request_id=request_id, prompt_ids=[], max_tokens=rec.max_tokens,
                                stop_token_ids=rec.stop_token_ids, deadline_ts=rec.deadline_ts)
        prep = Prepared(request=req, stop=tuple(rec.stop), model=rec.meta.model, arrival_ts=time.monotonic(),
                        resumable=True, replay=True, meta=rec.meta, skip_special_tokens=rec.skip_special_tokens)
        return Attachment(prep, attach_no=attach_no)

    async def resend(self, prep: Prepared, api_key: str) -> Attachment | None:
        """A POST sent again with the `X-Request-Id` of a request already admitted (its client lost
        the connection before any answer, e.g. the gateway died): a resumable one is replayed from
        its first event, as a resume would; None when that id was never admitted (send it now)."""
        r, rid = self.redis(), prep.request.request_id
        seen = await self.hold.call(lambda: admission.admitted_or_started(r, self.ks, rid),
                                    prep.request.deadline_ts)
        if not seen:
            return None
        in_use = InvalidRequest(
            f"request_id {rid!r} is already in use; a POST is safe to send again with the same "
            f"X-Request-Id only with \"resumable\": true and the same API key", param="request_id")
        if not prep.resumable:
            raise in_use
        try:
            return await self.reattach(rid, api_key)
        except RequestNotFound:
            raise in_use from None

    async def drain(self, timeout_s: float = 2.0) -> None:
        """Let pending cancel-key writes finish before the Redis client closes. Grace timers stop:
        their requests stay resumable through another replica until their deadline."""
        for t in list(self.grace_tasks):
            t.cancel()
        if self.background:
            await asyncio.wait(list(self.background), timeout=timeout_s)
