"""Decode service settings: environment `TANDEM_DECODE_*` (nested blocks with `__`)."""
from __future__ import annotations

from pydantic import PositiveFloat, PositiveInt
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem_core.settings import EngineConfig, GrpcConfig, PrefixCacheConfig, RedisConfig


class DecodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_DECODE_", env_nested_delimiter="__")

    redis: RedisConfig = RedisConfig()  # TANDEM_DECODE_REDIS__URL
    grpc: GrpcConfig = GrpcConfig(port=50062)  # gRPC health
    engine: EngineConfig = EngineConfig()  # TANDEM_DECODE_ENGINE__MODEL
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()  # local prefills (colocated, direct); TANDEM_DECODE_PREFIX_CACHE__*
    pool: str = "default"
    worker_id: str = ""  # default: decode-<hostname>-<pid>
    slots: PositiveInt = 8  # fixed decode batch
    colocated: bool = False  # also prefill from the admission streams (JetStream-style, one pod)
    direct_prefill: bool = True  # prefill prompts the gateway routes straight to decode
    priority_high_weight: PositiveInt = 4  # high-priority reads per guaranteed low-priority read
    claim_block_ms: PositiveInt = 20  # colocated mode polls the admission streams this often
    cancel_poll_s: PositiveFloat = 0.05
    pull_timeout_s: PositiveFloat = 30.0  # one whole KV pull
    insert_queue_size: PositiveInt = 8  # pulled KV waiting for the engine thread
    token_ttl_s: PositiveInt = 600
    token_finished_ttl_s: PositiveInt = 60  # a finished token stream lingers this long (for resumes)
    token_maxlen: PositiveInt = 8192
    heartbeat_interval_s: PositiveFloat = 1.0
    recover_interval_s: PositiveFloat = 1.0  # how often to look for dead pods' work
    stale_pending_s: PositiveFloat = 60.0  # an own delivery idle this long was lost (Redis restart): redo it
    max_attempts: PositiveInt = 3  # resumes per request before it fails with a clear error
    admission_maxlen: PositiveInt = 10000
    resync_window_s: PositiveFloat = 5.0  # own writes kept to write again to a Redis that lost them
    publish_retries: PositiveInt = 30  # ~1 minute of retries through a Redis restart
    drain_timeout_s: PositiveFloat = 30.0
    log_level: str = "INFO"
