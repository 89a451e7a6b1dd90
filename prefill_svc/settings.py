"""Prefill service settings: environment `TANDEM_PREFILL_*` (nested blocks with `__`)."""
from __future__ import annotations

from pydantic import PositiveFloat, PositiveInt
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem_core.settings import EngineConfig, GrpcConfig, PrefixCacheConfig, RedisConfig


class PrefillSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_PREFILL_", env_nested_delimiter="__")

    redis: RedisConfig = RedisConfig()  # TANDEM_PREFILL_REDIS__URL
    grpc: GrpcConfig = GrpcConfig(port=50061)  # KV transfer + gRPC health
    engine: EngineConfig = EngineConfig()  # TANDEM_PREFILL_ENGINE__MODEL
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()  # TANDEM_PREFILL_PREFIX_CACHE__ENABLED
    pool: str = "default"
    worker_id: str = ""  # default: prefill-<hostname>-<pid>
    kv_budget_bytes: PositiveInt = 256 * 1024 * 1024  # held KV above this stops claiming prompts
    kv_lease_s: PositiveFloat = 60.0  # KV not pulled within this is freed
    kv_chunk_bytes: PositiveInt = 1024 * 1024
    max_batch: PositiveInt = 4  # prompts claimed per read
    priority_high_weight: PositiveInt = 4  # high-priority reads per guaranteed low-priority read
    claim_block_ms: PositiveInt = 500
    ready_maxlen: PositiveInt = 10000
    token_ttl_s: PositiveInt = 600
    token_finished_ttl_s: PositiveInt = 60  # a finished token stream lingers this long (for resumes)
    token_maxlen: PositiveInt = 8192
    heartbeat_interval_s: PositiveFloat = 1.0
    recover_interval_s: PositiveFloat = 1.0  # how often to look for a dead pod's admission entries
    stale_pending_s: PositiveFloat = 30.0  # an own delivery idle this long was lost (Redis restart): redo it
    drain_timeout_s: PositiveFloat = 30.0
    log_level: str = "INFO"
