"""Decode service settings: environment `TANDEM_DECODE_*` (nested blocks with `__`). The fields
every worker has come from `tandem_core.settings.WorkerSettings`; these are the decode pod's own,
and the shared ones whose default differs here."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator
from pydantic_settings import SettingsConfigDict

from tandem_core.settings import GrpcConfig, PrefixCacheConfig, WorkerSettings


class SpeculativeConfig(BaseModel):
    """TANDEM_DECODE_SPECULATIVE__*: `method` "ngram" (prompt lookup) or "draft" (`draft_model`, a
    smaller checkpoint with the target's tokenizer, run on the pod beside it: tandem_engine/draft.py)
    turns it on (decode_svc/speculate.py); `k` proposed tokens at most per row and call; the n-gram
    lengths tried, longest first; a row
    proposes the tokens whose chance of being kept is at least `min_gain` (its rate moves by
    `rate_step` a judged token) and pauses up to `max_backoff` dispatches below it, and
    `no_match_pause` dispatches when its last tokens recur nowhere; the gate's
    trial `window`, `hold` and longest hold, in dispatches."""

    method: Literal["off", "ngram", "draft"] = "off"
    k: PositiveInt = 4
    draft_model: str = ""  # method "draft": a preset name or a Hugging Face directory (the target's tokenizer)
    # method "draft": a sampled request's draft proposes by sampling at the request's temperature, top-k and
    # top-p (judged by min(1, p / q)); False, or a greedy request: greedily
    draft_sample: bool = True
    max_n: PositiveInt = 3
    min_n: PositiveInt = 2
    min_gain: float = Field(default=0.3, gt=0.0, lt=1.0)
    rate_step: float = Field(default=0.2, gt=0.0, le=1.0)
    max_backoff: PositiveInt = 64
    no_match_pause: PositiveInt = 3
    gate_window: PositiveInt = 32
    gate_hold: PositiveInt = 128
    gate_max_hold: PositiveInt = 4096

    @model_validator(mode="after")
    def _lengths(self) -> SpeculativeConfig:
        if self.min_n > self.max_n:
            raise ValueError(f"speculative.min_n ({self.min_n}) must be <= max_n ({self.max_n})")
        if (self.method == "draft") != bool(self.draft_model):
            raise ValueError("speculative.method 'draft' needs speculative.draft_model (a preset name or a Hugging Face "
                             "directory with the target's tokenizer), and draft_model is read only with method 'draft'"
                             f" (method {self.method!r}, draft_model {self.draft_model!r})")
        return self

    @property
    def on(self) -> bool:
        return self.method != "off"


class DecodeSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_DECODE_", env_nested_delimiter="__")

    grpc: GrpcConfig = GrpcConfig(port=50062)  # gRPC health
    # a decode pod keeps no prefix cache beside its KV pool (engine.kv_reuse: local prompts are seated over
    # its kept blocks): only chunk_tokens is read here, the ragged call's chunk; TANDEM_DECODE_PREFIX_CACHE__*
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    slots: PositiveInt = 8  # fixed decode batch
    colocated: bool = False  # also prefill from the admission streams (JetStream-style, one pod)
    direct_prefill: bool = True  # prefill prompts the gateway routes straight to decode
    claim_block_ms: PositiveInt = 20  # colocated mode polls the admission streams this often
    claim_wait_ms: PositiveInt = 500  # the longest wait for new entries when it watches every source
    cancel_poll_s: PositiveFloat = 0.05
    pull_timeout_s: PositiveFloat = 30.0  # one whole KV pull
    insert_queue_size: PositiveInt = 8  # pulled KV waiting for the engine thread
    # Chunked prefill: while streams run, a local prompt longer than this is seated in a row and
    # prefilled a chunk (the engine's prefix_chunk) per decode call, beside the running rows (the
    # engine's ragged call); shorter ones run whole between two steps; 0 = whole prompts always
    prefill_chunk_tokens: NonNegativeInt = 2048
    # Speculative decoding (decode_svc/speculate.py): method "ngram" checks each row's n-gram
    # prompt-lookup proposal in one verify call; TANDEM_DECODE_SPECULATIVE__METHOD, __K, ...
    speculative: SpeculativeConfig = SpeculativeConfig()
    # The KV pool: positions of growth kept free for every running row when a
    # request is claimed or goes into a row, in blocks (decode_svc/blocks.py); 0 = engine.steps_per_dispatch,
    # one more dispatched call of every row. Larger: fewer hand-backs when blocks run out, fewer rows admitted.
    kv_reserve_steps: NonNegativeInt = 0
    stale_pending_s: PositiveFloat = 60.0  # an own delivery idle this long was lost (Redis restart): redo it
    # Cache-aware routing to decode pods (gateway/decode_route.py, with engine.kv_reuse): read this
    # pod's own per-pod ready stream before the shared one and say so in the heartbeat, so gateways
    # steer conversations here. Off: the shared stream only (steering skips this pod).
    ready_affinity: bool = True
    # A notice steered to another decode pod and seen unread this long is taken by a pod with room
    # (tandem_core/bus/steal.py): a busy, paused or dead pod never strands it. A miss costs a whole pull.
    affinity_wait_ms: PositiveInt = 200
    max_attempts: PositiveInt = 3  # resumes per request before it fails with a clear error
    # Paged KV: hand-backs for blocks a request takes without spending an attempt; each one past
    # it spends one, so one that keeps being the newest on full pods fails clearly after max_attempts more
    max_block_handbacks: NonNegativeInt = 8
    admission_maxlen: PositiveInt = 10000
    resync_window_s: PositiveFloat = 5.0  # own writes kept to write again to a Redis that lost them
    publish_retries: PositiveInt = 30  # ~1 minute of retries through a Redis restart
    output_queue_size: PositiveInt = 64  # steps' tokens waiting for the publisher; full = the engine waits
    publish_coalesce_steps: PositiveInt = 32  # queued steps written in one round trip when Redis is behind
    kv_channels_max: PositiveInt = 64  # gRPC channels to prefill pods kept open (oldest closed past it)
    finished_ids_max: PositiveInt = 10000  # ids of requests finished here, kept for a replay's sake
    recovering_lock_ttl_s: PositiveInt = 30  # one pod at a time resumes a dead pod's requests, for at most this
    resume_marker_ttl_s: PositiveInt = 120  # a resume from one index at one attempt refuses a duplicate this long
