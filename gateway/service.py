"""The gateway's transport-neutral core: validate -> admit -> enqueue -> relay.

`GatewayService` is built once per app and shared by the HTTP and gRPC front ends, so both
apply the same limits, the same admission bound and the same relay. It owns the Redis client
(set by the app's lifespan), the tokenizer and chat template, the metrics, the per-key limiter and
the background tasks (cancel keys written after a caller went away, grace timers of resumable
requests).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis

from gateway import choices, resume
from gateway.auth import ANONYMOUS, Auth
from gateway.chat import ChatTemplate
from gateway.cluster_view import ClusterReport, ClusterView
from gateway.hold import RedisHold
from gateway.limits import KeyLimiter
from gateway.logprobs import TokenText
from gateway.metrics import GatewayMetrics
from gateway.prefix_route import PrefixRouter
from gateway.readmit import Readmitter
from gateway.relay import Delta, cancel_soon, relay
from gateway.settings import GatewaySettings
from gateway.tokens import TokenMux
from gateway.validation import CompletionParams, Prepared, build_request, served_name
from tandem_core import keys
from tandem_core.bus import admission, conn, registry
from tandem_core.errors import (
    AdmissionRejected,
    DeadlineExceeded,
    InvalidRequest,
    ServiceUnavailable,
    TandemError,
)
from tandem_core.models import ModelInfo, resolve_model
from tandem_core.prefix import cache_salt
from tandem_core.scheduling import choose_route, predicted_ttft_s
from tandem_core.tokenizer import Tokenizer, load_tokenizer
from tandem_core.types import GenerationRequest

log = logging.getLogger(__name__)

_REDIS_DOWN = conn.REDIS_DOWN  # restarts and Sentinel failovers alike (MasterNotFoundError, READONLY)
_BIG_PROMPT_CHARS = 8192  # tokenize longer prompts off the event loop


class RequestNotFound(TandemError):
    grpc_code = "NOT_FOUND"
    http_status = 404
    error_type = "not_found_error"


class GatewayService:
    def __init__(self, settings: GatewaySettings, info: ModelInfo | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.settings = settings
        self.info = info or resolve_model(settings.model)
        self.tokenizer = tokenizer or load_tokenizer(self.info)
        self.model_name = served_name(settings, self.info)
        self.metrics = GatewayMetrics()
        self.redis: aioredis.Redis | None = None
        self.chat_template = ChatTemplate.for_model(self.info)
        self.token_text = TokenText(self.tokenizer)  # logprobs' token strings
        self.limiter = KeyLimiter(
            settings.max_concurrent_requests_per_key, settings.tokens_per_minute_per_key,
            lease_ttl_s=settings.request_timeout_s + 10, retry_after_s=settings.retry_after_s,
        )
        self.background: set[asyncio.Task] = set()
        self.grace_tasks: set[asyncio.Task] = set()
        self.grpc_port: int | None = None  # the bound port, once serving
        self._view_cache: tuple[float, ClusterView] | None = None
        self.backlog = admission.BacklogReader()
        self.open_streams = 0  # relays in progress (all share the one token reader)
        self.mux: TokenMux | None = None  # set with the Redis client by the app's lifespan
        # new requests wait for an unreachable Redis (a restart, a failover) instead of failing
        self.hold = RedisHold(settings.redis_hold_s, settings.redis_hold_max, settings.retry_after_s,
                              _REDIS_DOWN)
        self.metrics.waiting_for_redis.set_function(lambda: self.hold.holding)
        self.auth = Auth(settings)
        self.report = ClusterReport(settings, self.metrics, self.model_name, self._redis, self.hold)
        # admissions a restarted or failed-over Redis lost are enqueued again (gateway/readmit.py)
        self.readmit = Readmitter(self._redis, settings.pool, settings.admission_maxlen)
        self.router = PrefixRouter(  # the same salt on every replica of the pool: rendezvous agrees
            settings.prefix_block_size, settings.prefix_index_entries, settings.prefix_route_max_backlog,
            salt=cache_salt("gateway", settings.pool), enabled=settings.prefix_routing,
        )

    # ------------------------------------------------------------ auth (gateway/auth.py)

    def check_api_key(self, authorization: str | None) -> str:
        return self.auth.check_api_key(authorization)

    def check_admin_key(self, authorization: str | None) -> None:
        self.auth.check_admin_key(authorization)

    # ------------------------------------------------------------ request path

    async def prepare(self, params: CompletionParams) -> Prepared:
        """Validate and tokenize; long prompts are tokenized, and grammars checked (compiled), in a thread."""
        args = (params, self.settings, self.info, self.tokenizer)
        if params.grammar is not None or (params.prompt is not None and len(params.prompt) > _BIG_PROMPT_CHARS):
            return await asyncio.to_thread(build_request, *args)
        return build_request(*args)

    async def submit(self, prep: Prepared, fresh_id: bool, api_key: str = ANONYMOUS) -> None:
        """Admit (or 429) and enqueue. `fresh_id` False: the client chose the id, check it is unused."""
        if self.limiter.enabled:
            try:
                budget = prep.prompt_tokens + prep.request.max_tokens * prep.request.n
                prep.lease = self.limiter.acquire(api_key, budget)
            except AdmissionRejected:
                self.metrics.requests.labels("rate_limited").inc()
                raise
        try:
            direct = await self._enqueue(prep, fresh_id, api_key)
        except BaseException:
            if prep.lease is not None:
                prep.lease.release(0)
            raise
        self.metrics.count_admitted("local" if direct else "remote", prep.prompt_tokens)

    async def _enqueue(self, prep: Prepared, fresh_id: bool, api_key: str) -> bool:
        """Admit and enqueue; while Redis does not answer, the request waits for it (gateway/hold.py).
        True when the prompt went to the decode pods' direct stream."""
        checked = [fresh_id]  # the request-id check, done once (a retry would see its own stream)
        return await self.hold.call(lambda: self._enqueue_once(prep, api_key, checked), prep.request.deadline_ts)

    async def _enqueue_once(self, prep: Prepared, api_key: str, checked: list[bool]) -> bool:
        r = self._redis()
        s = self.settings
        view = await self._view(r)
        queued = await self.backlog.read(r, s.pool, view.prefill_ids)
        backlog = queued.total
        self.metrics.backlog.set(backlog)
        self._admit(backlog, view)
        rid = prep.request.request_id
        if not checked[0]:
            if await r.exists(keys.token_stream(rid), keys.cancel_key(rid), keys.admitted_key(rid)):
                raise InvalidRequest(f"request_id {rid!r} is already in use", param="request_id")
            checked[0] = True
        route = choose_route(
            len(prep.request.prompt_ids), direct_max_tokens=s.direct_prefill_max_tokens, backlog=backlog,
            prefill_workers=view.prefill_workers, decode_free_slots=view.decode_free_slots,
            backlog_threshold=s.direct_backlog_threshold,
        )
        self.metrics.routes.labels("local" if route.direct else "remote", route.reason).inc()
        if prep.resumable and prep.meta is not None:
            await resume.save(r, self._record(prep, api_key), int(s.request_timeout_s + s.token_ttl_s))
        pod = None
        if not route.direct:  # cache-aware: the pod likeliest to hold the prefix, unless busy
            pick = self.router.choose(prep.request.prompt_ids, view.prefill_ids,
                                      queued.of_priority(prep.request.priority))
            self.metrics.prefix_routes.labels(pick.reason).inc()
            pod = pick.pod
        prep.enqueue_entry_id = await admission.enqueue(
            r, s.pool, prep.request, s.admission_maxlen, pod=pod, direct=route.direct)
        self.readmit.add(prep.request, pod, route.direct)
        return route.direct

    def _admit(self, backlog: int, view: "ClusterView") -> None:
        """Reject at once rather than queue work that will miss (Mooncake's early rejection):
        429 when the backlog is over its bound, 503 when the predicted time to first token is
        past the first-token deadline. Both carry Retry-After."""
        s = self.settings
        if self.open_streams >= s.max_open_streams:
            self.metrics.requests.labels("rejected").inc()
            raise AdmissionRejected(
                f"{self.open_streams} streams are open on this gateway, at its bound of "
                f"{s.max_open_streams} (max_open_streams); retry after {s.retry_after_s:g}s",
                retry_after_s=s.retry_after_s,
            )
        if backlog > s.admission_max_backlog:
            self.metrics.requests.labels("rejected").inc()
            raise AdmissionRejected(
                f"admission backlog is {backlog} requests, over the bound of "
                f"{s.admission_max_backlog}; retry after {s.retry_after_s:g}s",
                retry_after_s=s.retry_after_s,
            )
        workers = view.prefill_workers or view.decode_workers
        ttft = predicted_ttft_s(backlog, workers, view.prefill_s or s.predicted_prefill_s)
        self.metrics.predicted_ttft.set(ttft)
        if ttft > s.first_token_timeout_s:
            self.metrics.requests.labels("rejected").inc()
            raise ServiceUnavailable(
                f"predicted time to first token is {ttft:.1f}s ({backlog} requests queued for {workers} "
                f"prefill workers), past the {s.first_token_timeout_s:g}s deadline; retry later",
                retry_after_s=max(s.retry_after_s, ttft - s.first_token_timeout_s),
            )

    async def _view(self, r: aioredis.Redis) -> "ClusterView":
        """The registry, summarised for routing; refreshed at most every cluster_view_ttl_s."""
        now = time.monotonic()
        if self._view_cache is None or now - self._view_cache[0] > self.settings.cluster_view_ttl_s:
            self._view_cache = (now, ClusterView.of(await registry.list_workers(r), self.settings.pool))
        return self._view_cache[1]

    def _record(self, prep: Prepared, api_key: str) -> resume.ResumeRecord:
        req = prep.request
        return resume.ResumeRecord(
            meta=prep.meta, stop=prep.stop, max_tokens=req.max_tokens, stop_token_ids=list(req.stop_token_ids),
            deadline_ts=req.deadline_ts, key=resume.key_digest(api_key),
        )

    async def stream(self, prep: Prepared) -> AsyncIterator[Delta]:
        """Relay the request's tokens; counts the outcome once and releases the key's lease."""
        s = self.settings
        outcome = "disconnected"
        total_s, first_s = s.request_timeout_s, s.first_token_timeout_s
        if prep.replay:  # a resume: whatever is left of the request's own deadline
            total_s = first_s = max(prep.request.deadline_ts - time.time(), 2.0)
        generated = 0
        self.open_streams += 1
        relay_args = dict(
            block_ms=s.relay_block_ms, request_timeout_s=total_s, first_token_timeout_s=first_s,
            cancel_ttl_s=s.token_ttl_s, metrics=self.metrics, background=self.background,
        )
        if prep.request.n > 1:  # one relay per choice's token stream, merged
            gen = self._choices(prep, relay_args)
        else:
            gen = relay(self._redis(), self._mux(), prep, self.tokenizer, **relay_args,
                        on_detach=self._grace_cancel(prep) if prep.resumable else None)
        try:
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
        except _REDIS_DOWN as e:
            outcome = "service_unavailable"
            raise ServiceUnavailable(f"Redis is unreachable: {e}; retry after {s.retry_after_s:g}s",
                                     retry_after_s=s.retry_after_s) from e
        finally:
            self.open_streams -= 1
            self.readmit.discard(prep.request.request_id)
            await gen.aclose()
            self.metrics.requests.labels(outcome).inc()
            self.metrics.generation_tokens.inc(generated)
            if prep.lease is not None:
                prep.lease.release(prep.prompt_tokens + generated)

    async def _choices(self, prep: Prepared, relay_args: dict) -> AsyncIterator[Delta]:
        """The n choices merged (gateway/choices.py); only choice 0 records latency metrics. A
        merged stream that ends early also cancels the parent id, which a prefill pod checks
        before it prefills."""
        req, finished = prep.request, False
        gens = [relay(self._redis(), self._mux(),
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
                cancel_soon(self._redis(), req.request_id, self.settings.token_ttl_s, self.background)

    def _grace_cancel(self, prep: Prepared) -> Callable[[], None]:
        """on_detach of a resumable request: cancel later, unless a client resumed meanwhile."""
        rid, s = prep.request.request_id, self.settings

        async def later() -> None:
            try:
                await resume.cancel_unless_attached(self._redis(), rid, prep.attach_no, s.resume_grace_s,
                                                    s.token_ttl_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - best effort; workers drop the request at its deadline
                log.warning("grace cancel failed request_id=%s", rid, exc_info=True)

        def start() -> None:
            log.info("client detached from resumable request_id=%s; cancel in %gs unless resumed",
                     rid, s.resume_grace_s)
            task = asyncio.get_running_loop().create_task(later())
            self.grace_tasks.add(task)
            task.add_done_callback(self.grace_tasks.discard)

        return start

    async def reattach(self, request_id: str, api_key: str) -> Prepared:
        """A resume of a resumable request: its record, re-read as a Prepared that replays the
        stream from the first entry (RequestNotFound when unknown, expired or another key's)."""
        r = self._redis()
        missing = RequestNotFound(
            f"request {request_id[:128]!r} is unknown, expired or was not sent with \"resumable\": true",
            param="request_id",
        )
        try:
            rec = await resume.load(r, request_id)
            if rec is None or rec.key != resume.key_digest(api_key):
                raise missing
            if time.time() > rec.deadline_ts and not await r.exists(keys.token_stream(request_id)):
                raise missing
            attach_no = await resume.attach(r, request_id)
        except _REDIS_DOWN as e:
            raise ServiceUnavailable(f"Redis is unreachable: {e}; retry after {self.settings.retry_after_s:g}s",
                                     retry_after_s=self.settings.retry_after_s) from e
        req = GenerationRequest(request_id=request_id, prompt_ids=[], max_tokens=rec.max_tokens,
                                stop_token_ids=rec.stop_token_ids, deadline_ts=rec.deadline_ts)
        return Prepared(request=req, stop=rec.stop, model=rec.meta.model, arrival_ts=time.monotonic(),
                        resumable=True, replay=True, meta=rec.meta, attach_no=attach_no)

    async def resend(self, prep: Prepared, api_key: str) -> Prepared | None:
        """A POST sent again with the `X-Request-Id` of a request already admitted (its client lost
        the connection before any answer, e.g. the gateway died): a resumable one is replayed from
        its first event, as a resume would; None when that id was never admitted (send it now)."""
        r, rid = self._redis(), prep.request.request_id
        seen = await self.hold.call(lambda: r.exists(keys.admitted_key(rid), keys.token_stream(rid)),
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

    # ------------------------------------------------------------ cluster view (gateway/cluster_view.py)

    async def ready(self) -> str:
        return await self.report.ready()

    async def cluster(self) -> dict:
        return await self.report.cluster()

    async def refresh_load(self, timeout_s: float = 1.0) -> None:
        await self.report.refresh_load(timeout_s)

    async def drain_background(self, timeout_s: float = 2.0) -> None:
        """Let pending cancel-key writes finish before the Redis client closes. Grace timers stop:
        their requests stay resumable through another replica until their deadline."""
        for t in list(self.grace_tasks):
            t.cancel()
        if self.background:
            await asyncio.wait(list(self.background), timeout=timeout_s)

    def _mux(self) -> TokenMux:
        if self.mux is None:
            raise ServiceUnavailable("the gateway is not connected to Redis yet; retry once /readyz answers ready")
        return self.mux

    def _redis(self) -> aioredis.Redis:
        if self.redis is None:
            raise ServiceUnavailable("the gateway is not connected to Redis yet; retry once /readyz answers ready")
        return self.redis


def retry_after_header(err: TandemError) -> dict[str, str]:
    if err.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))}
