"""Gateway settings: environment `TANDEM_GATEWAY_*` (nested blocks with `__`)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem_core.settings import RedisConfig
from tandem_core.types import MAX_LOGIT_BIAS


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_GATEWAY_", env_nested_delimiter="__")

    redis: RedisConfig = RedisConfig()  # TANDEM_GATEWAY_REDIS__URL
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # HTTP (OpenAI API, /metrics, /healthz)
    grpc_port: int = Field(default=50051, ge=0, le=65535)  # tandem.v1.Tandem + health
    model: str = "builtin"  # preset or HF directory: tokenizer, context length, EOS ids
    served_model_name: str = ""  # name clients send; default: the model's name
    pool: str = "default"
    max_context_len: PositiveInt = 512  # must equal the workers' engine max_len
    max_prompt_len: PositiveInt = 512  # the workers' largest prefill bucket
    max_tokens_limit: PositiveInt = 4096  # also bounds a chat without max_tokens (it runs to the context end)
    default_max_tokens: PositiveInt = 16  # completions without max_tokens (OpenAI's default)
    request_timeout_s: PositiveFloat = 300.0  # whole request deadline
    first_token_timeout_s: PositiveFloat = 120.0
    # Above this: 429 with Retry-After. Kept under admission_maxlen (the streams' MAXLEN) so nothing queued is
    # trimmed; in a burst of short requests the TTFT prediction's 503 comes first (bench/token_plane.py, burst).
    admission_max_backlog: PositiveInt = 8192
    admission_maxlen: PositiveInt = 10000
    max_body_bytes: PositiveInt = 1024 * 1024
    max_stop_strings: PositiveInt = 8
    # OpenAI parity (issue 12):
    max_n: int = Field(default=8, ge=1, le=64)  # choices per request (`n`); each takes a decode slot
    max_logit_bias: int = Field(default=64, ge=0, le=MAX_LOGIT_BIAS)  # logit_bias entries per request
    api_keys: list[str] = []  # empty: no auth
    admin_key: str = ""
    token_ttl_s: PositiveInt = 600
    log_level: str = "INFO"
    # Added with the gateway service:
    grpc_host: str = ""  # gRPC bind host; empty = same as `host`
    # /metrics on a port of its own (bound on `host`): the HTTP API port then answers /metrics with
    # 404, so a NetworkPolicy can keep the metrics inside the cluster. 0 = /metrics on `port`.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    grpc_max_message_bytes: PositiveInt = 4 * 1024 * 1024
    relay_block_ms: int = Field(default=1000, ge=1, le=1000)  # the token reader's XREAD BLOCK per round trip
    max_open_streams: PositiveInt = 16384  # relays open at once on this replica; past it: 429 (10,000 streams measured: bench/token_plane.py)
    retry_after_s: PositiveFloat = 1.0  # Retry-After on 429
    # Redis outages (a pod restart, a failover): a new request waits this long for Redis before its
    # 503, and at most this many wait at once on a replica (gateway/hold.py).
    redis_hold_s: PositiveFloat = 15.0
    redis_hold_max: PositiveInt = 1024
    shutdown_grace_s: PositiveFloat = 30.0  # SIGTERM: finish open streams for this long
    # Idle keep-alive connections stay open this long: longer than a client pool keeps them (httpx: 5 s),
    # so a reused connection does not race the server closing it. Behind a load balancer that keeps
    # backend connections longer (Google Cloud's: 600 s), raise it above that.
    http_keep_alive_s: PositiveFloat = 75.0
    default_temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default
    # Scheduling (issue 4):
    direct_prefill_max_tokens: int = Field(default=16, ge=0)  # prompts this short prefill on decode pods
    direct_backlog_threshold: PositiveInt = 16  # admission backlog that sends prompts to free decode slots
    cluster_view_ttl_s: PositiveFloat = 0.5  # how stale the registry view used for routing may be
    predicted_prefill_s: PositiveFloat = 0.05  # per-prompt prefill estimate until workers report theirs
    # Front door (issue 5):
    resume_grace_s: PositiveFloat = 30.0  # "resumable": a dropped client has this long to resume
    max_concurrent_requests_per_key: int = Field(default=0, ge=0)  # per API key, per replica; 0 = off
    tokens_per_minute_per_key: int = Field(default=0, ge=0)  # prompt + max_tokens, per replica; 0 = off
    # Structured outputs and tools (issue 13):
    max_grammar_bytes: PositiveInt = 65536  # a request's grammar spec (schema, regex, Lark, tools) as JSON
    # Chat output per model family (issue 28, gateway/chatformat.py), vLLM's names: "auto" reads the
    # chat template's markers, then config.json's model_type.
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1", "openai_gptoss"] = "auto"
    tool_call_parser: Literal["auto", "hermes", "mistral", "openai"] = "auto"
    # Prefix caching and cache-aware routing (issue 14, gateway/prefix_route.py):
    prefix_routing: bool = True  # route remote prompts to the prefill pod likeliest to hold their prefix
    # Tokens per block of the prefix hash chain: MUST equal the pods' prefix_cache.block_size (and be
    # the same on every gateway replica), or the gateway's guess of who holds a prefix is worse.
    prefix_block_size: PositiveInt = 16
    prefix_route_max_backlog: PositiveInt = 4  # a pod's own stream this long: use the shared stream
    prefix_index_entries: PositiveInt = 100_000  # block key -> pod entries the router remembers (LRU)
    # Steer each prompt to the decode pod likeliest to hold its leading KV blocks (a conversation's
    # earlier turns), among pods that say they read a per-pod ready stream (gateway/decode_route.py)
    decode_routing: bool = True
