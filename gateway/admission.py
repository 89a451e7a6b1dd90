"""The gateway's side of admission: may this request enter, where does it go, and enqueue it.

Redis's side (the admission streams, the idempotent enqueue script, the backlog counts) is
tandem_core/bus/admission.py; this module decides. `Admitter.submit` runs, in order:
1. The per-key limiter (limits.py): a lease for prompt + max_tokens * n tokens, or 429 / 400.
2. Under `RedisHold` (hold.py: while Redis does not answer, a new request waits for it):
   a. the cluster view (cluster_view.py, cached for cluster_view_ttl_s) and the backlog;
   b. the early rejections (`check`): open streams or backlog over their bounds (429), a predicted
      time to first token past its deadline (503);
   c. a client-chosen request id must be unused (checked once, not again on a retry);
   d. the route: straight to the decode pods' direct stream when the prompt is short and they
      have room (tandem_core/scheduling.py), else a prefill pool, to the pod likeliest to hold the
      prompt's prefix unless it is busy (prefix_route.py), and steered to the decode pod likeliest
      to hold its leading KV blocks (decode_route.py);
   e. the resume record of a resumable request (resume.py), then the enqueue.
   The backlog and registry reads of concurrent admissions share one read in flight, and one
   writer sends their enqueues in pipelines (batching.py): a burst's Redis connections stay few.
3. The readmitter (readmit.py) remembers the admission, to enqueue it again if Redis loses it.
The result is an `Attachment` (attachment.py) holding the lease and the entry id; a failure on
the way releases the lease.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import redis.asyncio as aioredis

from gateway import resume
from gateway.attachment import Attachment
from gateway.batching import EnqueueBatcher, SingleFlight
from gateway.cluster_view import ClusterView
from gateway.decode_route import DecodeRouter
from gateway.hold import RedisHold
from gateway.limits import KeyLimiter, Lease
from gateway.metrics import GatewayMetrics
from gateway.prefix_route import PrefixRouter
from gateway.readmit import Readmitter
from gateway.settings import GatewaySettings
from gateway.validation import Prepared
from tandem_core.bus import admission, registry
from tandem_core.errors import AdmissionRejected, InvalidRequest, ServiceUnavailable
from tandem_core.bus import KeySpace
from tandem_core.prefix import cache_salt
from tandem_core.scheduling import choose_route, predicted_ttft_s


class Admitter:
    """Admission for one gateway replica. `redis()` raises ServiceUnavailable before the app's
    lifespan has connected; `open_streams()` counts the relays in progress (streaming.py)."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, redis: Callable[[], aioredis.Redis],
                 ks: KeySpace, hold: RedisHold, open_streams: Callable[[], int]) -> None:
        self.settings, self.metrics, self.redis, self.ks, self.hold = settings, metrics, redis, ks, hold
        self.open_streams = open_streams
        self.limiter = KeyLimiter(
            settings.max_concurrent_requests_per_key, settings.tokens_per_minute_per_key,
            lease_ttl_s=settings.request_timeout_s + 10, retry_after_s=settings.retry_after_s,
        )
        self.backlog = admission.BacklogReader()
        self._view_cache: tuple[float, ClusterView] | None = None
        # shared by the admissions in progress: one backlog read and one registry read in flight,
        # and one writer of every enqueue (batching.py): a burst's connections do not grow with it
        self.reads: SingleFlight = SingleFlight()
        self.enqueuer = EnqueueBatcher(redis, ks, settings.pool, settings.admission_maxlen)
        # admissions a restarted or failed-over Redis lost are enqueued again (gateway/readmit.py)
        self.readmit = Readmitter(redis, ks, settings.pool, settings.admission_maxlen)
        self.router = PrefixRouter(  # the same salt on every replica of the pool: rendezvous agrees
            settings.prefix_block_size, settings.prefix_index_entries, settings.prefix_route_max_backlog,
            salt=cache_salt("gateway", settings.pool), enabled=settings.prefix_routing,
        )
        self.decode_router = DecodeRouter(settings.prefix_block_size, settings.prefix_index_entries,
                                          salt=cache_salt("gateway-decode", settings.pool),
                                          enabled=settings.decode_routing)

    async def submit(self, prep: Prepared, fresh_id: bool, api_key: str) -> Attachment:
        """Admit (or 429) and enqueue. `fresh_id` False: the client chose the id, check it is unused."""
        lease = self._lease(prep, api_key)
        try:
            checked = [fresh_id]  # the request-id check, done once (a retry would see its own stream)
            direct, entry_id = await self.hold.call(lambda: self._enqueue_once(prep, api_key, checked),
                                                    prep.request.deadline_ts)
        except BaseException:
            if lease is not None:
                lease.release(0)
            raise
        self.metrics.count_admitted("local" if direct else "remote", prep.prompt_tokens)
        return Attachment(prep, lease=lease, entry_id=entry_id)

    def _lease(self, prep: Prepared, api_key: str) -> Lease | None:
        if not self.limiter.enabled:
            return None
        try:
            return self.limiter.acquire(api_key, prep.prompt_tokens + prep.request.max_tokens * prep.request.n)
        except AdmissionRejected:
            self.metrics.requests.labels("rate_limited").inc()
            raise

    async def _enqueue_once(self, prep: Prepared, api_key: str, checked: list[bool]) -> tuple[bool, bytes]:
        """One attempt (RedisHold retries it): (went to the direct stream, admission entry id)."""
        r, s = self.redis(), self.settings
        view = await self.view(r)
        known = tuple(view.prefill_ids)
        queued = await self.reads(("backlog", known), lambda: self.backlog.read(r, self.ks, s.pool, list(known)))
        self.metrics.backlog.set(queued.total)
        self.check(queued.total, view)
        rid = prep.request.request_id
        if not checked[0]:
            if await admission.in_use(r, self.ks, rid):
                raise InvalidRequest(f"request_id {rid!r} is already in use; choose another (X-Request-Id over "
                                     f"HTTP), or send none and the gateway picks one", param="request_id")
            checked[0] = True
        direct, pod = self._route(prep, view, queued)
        if prep.resumable and prep.meta is not None:
            await resume.save(r, self.ks, self._record(prep, api_key), int(s.request_timeout_s + s.token_ttl_s))
        entry_id = await self.enqueuer.enqueue(prep.request, pod, direct)
        self.readmit.add(prep.request, pod, direct)
        return direct, entry_id

    def _route(self, prep: Prepared, view: ClusterView, queued: admission.Backlog) -> tuple[bool, str | None]:
        """(direct, pod): the decode pods' direct stream, or a prefill pool and, cache-aware, the
        pod likeliest to hold the prompt's prefix (None: the pool's shared stream)."""
        s = self.settings
        route = choose_route(
            len(prep.request.prompt_ids), direct_max_tokens=s.direct_prefill_max_tokens, backlog=queued.total,
            prefill_workers=view.prefill_workers,
            decode_free_slots=view.decode_room_for(len(prep.request.prompt_ids)),  # paged pods: in blocks too
            backlog_threshold=s.direct_backlog_threshold,
        )
        self.metrics.routes.labels("local" if route.direct else "remote", route.reason).inc()
        if route.direct:
            return True, None
        pick = self.router.choose(prep.request.prompt_ids, view.prefill_ids, queued.of_priority(prep.request.priority))
        self.metrics.prefix_routes.labels(pick.reason).inc()
        steer = self.decode_router.choose(prep.request.prompt_ids, view.decode_rooms)
        self.metrics.decode_routes.labels(steer.reason).inc()
        prep.request.decode_pod = steer.pod  # the prefill pod writes its ready notice for that pod
        return False, pick.pod

    def check(self, backlog: int, view: ClusterView) -> None:
        """Reject at once rather than queue work that will miss (Mooncake's early rejection):
        429 when the open streams or the backlog are over their bounds, 503 when the predicted time
        to first token is past the first-token deadline. Both carry Retry-After."""
        s = self.settings
        open_now = self.open_streams()
        if open_now >= s.max_open_streams:
            self.metrics.requests.labels("rejected").inc()
            raise AdmissionRejected(
                f"{open_now} streams are open on this gateway, at its bound of "
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

    async def view(self, r: aioredis.Redis) -> ClusterView:
        """The registry, summarised for routing; refreshed at most every cluster_view_ttl_s."""
        now = time.monotonic()
        if self._view_cache is None or now - self._view_cache[0] > self.settings.cluster_view_ttl_s:
            workers = await self.reads("registry", lambda: registry.list_workers(r))
            self._view_cache = (now, ClusterView.of(workers, self.settings.pool))
        return self._view_cache[1]

    @staticmethod
    def _record(prep: Prepared, api_key: str) -> resume.ResumeRecord:
        req = prep.request
        return resume.ResumeRecord(
            meta=prep.meta, stop=list(prep.stop), max_tokens=req.max_tokens, stop_token_ids=list(req.stop_token_ids),
            deadline_ts=req.deadline_ts, key=resume.key_digest(api_key), skip_special_tokens=prep.skip_special_tokens,
        )
