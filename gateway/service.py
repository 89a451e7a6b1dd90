"""The gateway's transport-neutral core: validate -> admit -> enqueue -> relay.

`GatewayService` is built once per app and shared by the HTTP and gRPC front ends, so both
apply the same limits, the same admission bound and the same relay. It builds the parts, each
with one job, and the front ends call them directly, in the order a request meets them:
1. `svc.auth` (auth.py): who may call (`check_api_key`, `check_admin_key`).
2. `svc.prepare` (validation.py): checks and tokenizes the request into an immutable `Prepared`.
3. `svc.admission.submit` (admission.py): admits it (limiter lease, early rejections, route,
   enqueue) and returns an `Attachment` (attachment.py), what this relay of it holds.
4. `svc.streaming` (streaming.py): `stream` relays its tokens; `reattach` and `resend` attach a
   client again; `open` counts the relays; `drain` ends background writes before Redis closes.
5. `svc.report` (cluster_view.py): `/readyz`, `/admin/cluster` and the load gauges.
It owns what the parts share: the Redis client and token reader (both set by the app's lifespan),
the Redis hold, the tokenizer and chat template, and the metrics. (It was a facade that also
forwarded each part's methods; the forwarding is gone, so a reader follows a call straight to
the part that does it.)
"""
from __future__ import annotations

import asyncio
import math

import redis.asyncio as aioredis

from gateway.admission import Admitter
from gateway.auth import Auth
from gateway.chat import ChatTemplate
from gateway.chatformat import ChatFormat
from gateway.cluster_view import ClusterReport
from gateway.hold import RedisHold
from gateway.logprobs import TokenText
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.streaming import REDIS_DOWN, RequestNotFound, Streaming
from gateway.tokens import TokenMux
from gateway.validation import CompletionParams, Prepared, build_request, served_name
from tandem_core.errors import ServiceUnavailable, TandemError
from tandem_core.bus import KeySpace
from tandem_core.models import ModelInfo, resolve_model
from tandem_core.tokenizer import Tokenizer, load_tokenizer

__all__ = ["GatewayService", "RequestNotFound", "retry_after_header"]

_BIG_PROMPT_CHARS = 8192  # tokenize longer prompts off the event loop
_NOT_CONNECTED = "the gateway is not connected to Redis yet; retry once /readyz answers ready"


class GatewayService:
    def __init__(self, settings: GatewaySettings, info: ModelInfo | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.settings = settings
        self.info = info or resolve_model(settings.model)
        self.tokenizer = tokenizer or load_tokenizer(self.info)
        self.model_name = served_name(settings, self.info)
        self.metrics = GatewayMetrics()
        self.redis: aioredis.Redis | None = None
        self.keys = KeySpace(settings.redis.shard_count())  # the deployment's key shards, for every Redis key
        self.mux: TokenMux | None = None  # set with the Redis client by the app's lifespan
        self.chat_template = ChatTemplate.for_model(self.info)
        self.chat_format = ChatFormat.for_model(self.info.path, self.chat_template.source, self.tokenizer,
                                                settings.reasoning_parser, settings.tool_call_parser)
        self.token_text = TokenText(self.tokenizer)  # logprobs' token strings
        self.grpc_port: int | None = None  # the bound port, once serving
        self.metrics_port: int | None = None  # /metrics' own port, once serving (settings.metrics_port)
        # new requests wait for an unreachable Redis (a restart, a failover) instead of failing
        self.hold = RedisHold(settings.redis_hold_s, settings.redis_hold_max, settings.retry_after_s, REDIS_DOWN)
        self.metrics.waiting_for_redis.set_function(lambda: self.hold.holding)
        self.auth = Auth(settings)
        self.admission = Admitter(settings, self.metrics, self._redis, self.keys, self.hold,
                                  open_streams=lambda: self.streaming.open)
        self.readmit = self.admission.readmit  # the app's lifespan runs its watch
        self.streaming = Streaming(settings, self.metrics, self.tokenizer, self._redis, self.keys, self._mux, self.hold,
                                   forget=self.readmit.discard)
        self.report = ClusterReport(settings, self.metrics, self.model_name, self._redis, self.keys, self.hold)

    # ------------------------------------------------------------ request path

    async def prepare(self, params: CompletionParams) -> Prepared:
        """Validate and tokenize; long prompts are tokenized, and grammars checked (compiled), in a thread."""
        args = (params, self.settings, self.info, self.tokenizer)
        if params.grammar is not None or (params.prompt is not None and len(params.prompt) > _BIG_PROMPT_CHARS):
            return await asyncio.to_thread(build_request, *args)
        return build_request(*args)

    def _mux(self) -> TokenMux:
        if self.mux is None:
            raise ServiceUnavailable(_NOT_CONNECTED)
        return self.mux

    def _redis(self) -> aioredis.Redis:
        if self.redis is None:
            raise ServiceUnavailable(_NOT_CONNECTED)
        return self.redis


def retry_after_header(err: TandemError) -> dict[str, str]:
    if err.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))}
