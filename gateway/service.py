"""The gateway's transport-neutral core: validate -> admit -> enqueue -> relay.

`GatewayService` is built once per app and shared by the HTTP and gRPC front ends, so both
apply the same limits, the same admission bound and the same relay. It owns the Redis client
(set by the app's lifespan), the tokenizer, the metrics and the set of background tasks (cancel
keys written after a caller went away).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import math
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.metrics import GatewayMetrics
from gateway.relay import Delta, relay
from gateway.settings import GatewaySettings
from gateway.validation import CompletionParams, Prepared, build_request, served_name
from tandem_core import keys, streams
from tandem_core.errors import (
    AdmissionRejected,
    DeadlineExceeded,
    InvalidRequest,
    ServiceUnavailable,
    TandemError,
    Unauthenticated,
)
from tandem_core.models import ModelInfo, resolve_model
from tandem_core.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
_BIG_PROMPT_CHARS = 8192  # tokenize longer prompts off the event loop


class GatewayService:
    def __init__(self, settings: GatewaySettings, info: ModelInfo | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.settings = settings
        self.info = info or resolve_model(settings.model)
        self.tokenizer = tokenizer or load_tokenizer(self.info)
        self.model_name = served_name(settings, self.info)
        self.metrics = GatewayMetrics()
        self.redis: aioredis.Redis | None = None
        self.background: set[asyncio.Task] = set()
        self.grpc_port: int | None = None  # the bound port, once serving

    # ------------------------------------------------------------ auth

    def check_api_key(self, authorization: str | None) -> None:
        if self.settings.api_keys and not _bearer_ok(authorization, self.settings.api_keys):
            raise Unauthenticated("missing or invalid API key: send 'Authorization: Bearer <key>'")

    def check_admin_key(self, authorization: str | None) -> None:
        if self.settings.admin_key and not _bearer_ok(authorization, [self.settings.admin_key]):
            raise Unauthenticated("missing or invalid admin key: send 'Authorization: Bearer <admin key>'")

    # ------------------------------------------------------------ request path

    async def prepare(self, params: CompletionParams) -> Prepared:
        """Validate and tokenize; long prompts are tokenized in a thread."""
        args = (params, self.settings, self.info, self.tokenizer)
        if params.prompt is not None and len(params.prompt) > _BIG_PROMPT_CHARS:
            return await asyncio.to_thread(build_request, *args)
        return build_request(*args)

    async def submit(self, prep: Prepared, fresh_id: bool) -> None:
        """Admit (or 429) and enqueue. `fresh_id` False: the client chose the id, check it is unused."""
        r = self._redis()
        s = self.settings
        try:
            backlog = await admission_backlog(r, s.pool)
            self.metrics.backlog.set(backlog)
            if backlog > s.admission_max_backlog:
                self.metrics.requests.labels("rejected").inc()
                raise AdmissionRejected(
                    f"admission backlog is {backlog} requests, over the bound of "
                    f"{s.admission_max_backlog}; retry after {s.retry_after_s:g}s",
                    retry_after_s=s.retry_after_s,
                )
            rid = prep.request.request_id
            if not fresh_id and await r.exists(keys.token_stream(rid), keys.cancel_key(rid)):
                raise InvalidRequest(f"request_id {rid!r} is already in use", param="request_id")
            prep.enqueue_entry_id = await streams.enqueue_request(r, s.pool, prep.request, maxlen=s.admission_maxlen)
        except _REDIS_DOWN as e:
            raise ServiceUnavailable(f"Redis is unreachable: {e}", retry_after_s=s.retry_after_s) from e

    async def stream(self, prep: Prepared) -> AsyncIterator[Delta]:
        """Relay the request's tokens; counts the outcome once."""
        s = self.settings
        outcome = "disconnected"
        gen = relay(
            self._redis(), prep, self.tokenizer, block_ms=s.relay_block_ms,
            request_timeout_s=s.request_timeout_s, first_token_timeout_s=s.first_token_timeout_s,
            cancel_ttl_s=s.token_ttl_s, metrics=self.metrics, background=self.background,
        )
        try:
            async for delta in gen:
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
            raise ServiceUnavailable(f"Redis is unreachable: {e}", retry_after_s=s.retry_after_s) from e
        finally:
            await gen.aclose()
            self.metrics.requests.labels(outcome).inc()

    # ------------------------------------------------------------ cluster view

    async def ready(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self._redis().ping(), timeout=2.0))
        except (asyncio.TimeoutError, *_REDIS_DOWN, ServiceUnavailable):
            return False

    async def cluster(self) -> dict:
        r = self._redis()
        s = self.settings
        try:
            workers = await streams.list_workers(r)
            admission = {p: await r.xlen(keys.admission_stream(s.pool, p)) for p in keys.PRIORITIES}
            backlog = await admission_backlog(r, s.pool)
            ready = await r.xlen(keys.ready_stream(s.pool))
        except _REDIS_DOWN as e:
            raise ServiceUnavailable(f"Redis is unreachable: {e}") from e
        self.metrics.backlog.set(backlog)
        return {
            "workers": workers,
            "queues": {"pool": s.pool, "admission": admission, "admission_backlog": backlog, "ready": ready,
                       "admission_max_backlog": s.admission_max_backlog},
            "model": {"name": self.model_name, "model": s.model, "max_context_len": s.max_context_len,
                      "max_prompt_len": s.max_prompt_len},
        }

    async def drain_background(self, timeout_s: float = 2.0) -> None:
        """Let pending cancel-key writes finish before the Redis client closes."""
        if self.background:
            await asyncio.wait(list(self.background), timeout=timeout_s)

    def _redis(self) -> aioredis.Redis:
        if self.redis is None:
            raise ServiceUnavailable("the gateway is not connected to Redis yet")
        return self.redis


async def admission_backlog(r: aioredis.Redis, pool: str) -> int:
    """Undelivered + delivered-but-unacked admission entries, over all priorities.

    Like `streams.admission_backlog`, but correct where XINFO GROUPS has no usable `lag`
    (Redis < 7, or lag NULL after deletions): there it counts XLEN, which equals lag + pending
    because workers XDEL every entry they ack. `streams.admission_backlog` reads 0 in that case.
    """
    total = 0
    for prio in keys.PRIORITIES:
        stream = keys.admission_stream(pool, prio)
        try:
            groups = await r.xinfo_groups(stream)
        except ResponseError:
            continue
        group = next((g for g in groups if _s(g.get("name")) == keys.PREFILL_GROUP), None)
        if group is None:
            continue
        lag = group.get("lag")
        if lag is None:
            total += int(await r.xlen(stream))
        else:
            total += int(lag) + int(group.get("pending") or 0)
    return total


def _s(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


def _bearer_ok(authorization: str | None, allowed: list[str]) -> bool:
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    token = token.strip().encode()
    return any(hmac.compare_digest(token, k.encode()) for k in allowed)


def retry_after_header(err: TandemError) -> dict[str, str]:
    if err.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))}
