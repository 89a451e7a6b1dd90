"""Settings blocks shared by the services. Each service owns one `BaseSettings` class
(prefix `TANDEM_<SERVICE>_`, nested with `__`) built once in its `__main__`; these plain models
are its nested blocks. Nothing here reads the environment at import time.
"""
from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import BaseModel, Field, PositiveFloat, PositiveInt, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class SentinelConfig(BaseModel):
    """Redis Sentinel: ask these sentinels where the primary of `master_name` is, and ask again
    after a failover, so a promoted replica takes over without a restart of any service.

    `hosts` empty (the default) = no Sentinel: `RedisConfig.url` names the one Redis. Set, the
    url is not used; `RedisConfig.username`/`password` authenticate to the primary (and, with `auth`, to the
    sentinels too, which is how Bitnami's chart sets them up). From the environment a list is JSON:
    TANDEM_GATEWAY_REDIS__SENTINEL__HOSTS='["10.0.0.5:26379","10.0.0.6:26379"]'.
    """

    hosts: list[str] = []  # "host:port" of each sentinel
    master_name: str = Field(default="tandem", min_length=1)  # `sentinel monitor <name> ...`
    auth: bool = False  # the sentinels require a password: the same as Redis's (redis.username/password)

    @field_validator("hosts")
    @classmethod
    def _host_port(cls, hosts: list[str]) -> list[str]:
        for h in hosts:
            host, _, port = h.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"sentinel host {h!r} is not host:port (e.g. 10.0.0.5:26379)")
        return hosts

    def addresses(self) -> list[tuple[str, int]]:
        return [(h.rpartition(":")[0].strip("[]"), int(h.rpartition(":")[2])) for h in self.hosts]


class RedisConfig(BaseModel):
    """Where the admission/ready/token streams live. `rediss://` URLs use TLS. With
    `sentinel.hosts` set, the primary is found (and found again after a failover) through Sentinel."""

    url: str = "redis://127.0.0.1:6379/0"
    # A Redis ACL user (Redis 6+; `AUTH username password`): each role's own, with only the
    # commands and keys it needs (tandem_core/bus/acl.py; `tandem redis-acl` prints them). None =
    # the default user (a plain `requirepass`, or a user named in the URL: redis://user:pw@host).
    username: str | None = None
    password: str | None = None
    socket_timeout_s: PositiveFloat = 10.0
    connect_timeout_s: PositiveFloat = 5.0
    # the client's connection bound (per node on a Redis Cluster): past it a command waits for a
    # free connection (up to socket_timeout_s), it never opens another (tandem_core/redis_client.py)
    max_connections: PositiveInt = 64
    sentinel: SentinelConfig = SentinelConfig()
    # Redis Cluster: `url` names any one node (redis:// or rediss://); redis-py's cluster client
    # finds the rest and follows failovers and slot moves.
    cluster: bool = False
    # Key shards: a request's keys and the pool streams it passes through share a hash tag, one
    # of `shards`; on a Redis Cluster they spread over the nodes. Every service of a deployment
    # must use the same count (checked at start against `tandem:meta:shards`). 0 = 1 on a plain
    # Redis, 16 with `cluster`.
    shards: int = Field(default=0, ge=0, le=1024)

    def shard_count(self) -> int:
        return self.shards or (16 if self.cluster else 1)


class GrpcConfig(BaseModel):
    """A gRPC server: bind address and the address other pods use to reach it."""

    host: str = "0.0.0.0"
    port: int = Field(default=0, ge=0, le=65535)  # 0 = pick a free port
    advertise_host: str = "127.0.0.1"
    max_message_bytes: PositiveInt = 8 * 1024 * 1024
    # mTLS for internal gRPC (KV transfer): all three set = TLS on, and peers must present a
    # certificate signed by the CA. The chart mounts them from a Secret.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_server_name: str = ""  # name to check in the peer's certificate (pods dial IPs)
    # A plaintext port serving grpc.health.v1 only (nothing else), for Kubernetes' `grpc:` probes,
    # which speak no TLS: with mTLS on `port` the probes point here. 0 = none (health only on `port`).
    health_port: int = Field(default=0, ge=0, le=65535)

    @model_validator(mode="after")
    def _tls_whole(self) -> "GrpcConfig":
        """All three TLS files or none: a partial set would serve and dial in plaintext, silently."""
        files = {"tls_cert_file": self.tls_cert_file, "tls_key_file": self.tls_key_file,
                 "tls_ca_file": self.tls_ca_file}
        missing = [k for k, v in files.items() if not v]
        if missing and len(missing) < len(files):
            raise ValueError(f"a partial TLS configuration: {', '.join(missing)} not set (set all three of "
                             "tls_cert_file, tls_key_file, tls_ca_file for mutual TLS, or none for plaintext)")
        if self.health_port and self.health_port == self.port:
            raise ValueError(f"health_port {self.health_port} is the gRPC port itself: give the plaintext "
                             "health port a port of its own (or 0 for none)")
        return self

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file and self.tls_key_file and self.tls_ca_file)


class EngineConfig(BaseModel):
    """Which model and which compiled shapes."""

    model: str = "builtin"
    max_len: PositiveInt = 512
    prefill_buckets: list[PositiveInt] = [16, 32, 64, 128, 256, 512]
    dtype: str = Field(default="float32", pattern="^(float32|bfloat16)$")
    # weight-only quantization: "int8" holds the layer matrices as int8 with per-output-channel
    # scales (tandem_engine/quantize.py); "" = weights in `dtype`. The KV stays in `dtype` either
    # way; prefill and decode pods of one pool set it alike (the chart refuses a mismatch).
    quantize: Literal["", "int8"] = ""
    tp: int = Field(default=1, ge=0)  # tensor parallelism over this pod's devices; 0 = all of them
    # a mixture of experts: split whole experts across the tp devices (expert parallelism) instead
    # of each expert's hidden units
    expert_parallel: bool = False
    # JAX's persistent compilation cache: a restarted pod (or a second pod on the node) loads its
    # compiled steps instead of compiling again (seconds instead of tens of seconds). "" turns it off.
    # XLA CPU intra-op threads (0: one per core). On CPUs that several workers share, 1 wastes
    # least (idle pool threads spin); on a TPU/GPU host it only sizes the host-side pool.
    cpu_threads: int = Field(default=0, ge=0)
    compile_cache_dir: str = Field(default_factory=lambda: os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem", "jax"))
    # Structured outputs: compiled grammars kept (LRU), and the CPU time one token mask may take
    # before its request fails (the others go on).
    grammar_cache_size: PositiveInt = 128
    mask_deadline_s: PositiveFloat = 0.05
    # Multi-step decode: a decode pod runs this many steps per dispatched call when it can (one
    # while a grammar, a waiting insert or a request ending by length needs a single step): the
    # host's per-call cost is paid once per this many tokens, and tokens reach clients in bursts
    # of it (decode_svc/loop.py). 1 turns it off. Default by bench/engine_thread.py.
    steps_per_dispatch: PositiveInt = 4
    # Where a decode pod keeps its KV: a pool of `kv_blocks` blocks of `kv_block_size` positions,
    # taken as a sequence grows; `slots` counts sequence rows, which can be far more than the memory
    # holds at max_len each: a decode pod claims work while it has the blocks for the prompt plus a
    # reserve (docs/scaling.md, decode capacity). kv_blocks 0: every row can reach max_len at once
    # (slots x max_len positions).
    kv_block_size: PositiveInt = 16  # positions per KV block
    kv_blocks: int = Field(default=0, ge=0)  # blocks in the pool; 0 = slots x max_len / kv_block_size
    # keep finished sequences' full blocks in the pool (evicted first when blocks run
    # short) and share them with later sequences that start with the same tokens: a decode pod
    # then pulls only the KV it does not hold (a conversation's new turn). tandem_engine/block_cache.py
    kv_reuse: bool = True
    # a family with windowed and global layers (gemma2, gemma3, gpt-oss): the windowed layers keep
    # only the blocks their window reaches, in a group of their own (tandem_engine/paged.py
    # WindowGroup), so their KV follows the window, not max_len; with kv_reuse a finished sequence's
    # blocks are reused only by one that matches them to their end (a next turn). false: every
    # block of every layer (and reuse of any shared part)
    kv_window_group: bool = True
    # the decode KV's element type; "fp8" (float8_e4m3fn) holds twice bfloat16's positions
    # in the same memory (error against the dtype: bench/quantize_quality.py --kv); "auto": `dtype`
    kv_dtype: str = Field(default="auto", pattern="^(auto|fp8)$")

    @model_validator(mode="after")
    def _pool_fits_one(self) -> "EngineConfig":
        if self.kv_blocks and self.kv_blocks * self.kv_block_size < self.max_len:
            need = -(-self.max_len // self.kv_block_size)
            raise ValueError(f"kv_blocks {self.kv_blocks} x kv_block_size {self.kv_block_size} = "
                             f"{self.kv_blocks * self.kv_block_size} positions cannot hold one sequence of max_len "
                             f"{self.max_len}: set kv_blocks >= {need} (or 0: slots x max_len positions), or lower max_len")
        return self

    def kv_kwargs(self) -> dict:
        """The KV pool options of `load_engine`."""
        return {"kv_block_size": self.kv_block_size, "kv_blocks": self.kv_blocks or None,
                "kv_reuse": self.kv_reuse, "kv_dtype": None if self.kv_dtype == "auto" else self.kv_dtype,
                "kv_window_group": self.kv_window_group}

    def load_kwargs(self, slots: int, prefix_chunk: int) -> dict:
        """The keyword arguments of `tandem_engine.load_engine` for this block, with the pod's
        decode `slots` and its prefix cache's `chunk_tokens` (the engine reads no settings: every
        service builds its engine from this one mapping)."""
        return {"model": self.model, "slots": slots, "max_len": self.max_len,
                "prefill_buckets": tuple(self.prefill_buckets), "dtype": self.dtype, "quantize": self.quantize or None, "tp": self.tp,
                "expert_parallel": self.expert_parallel, "compile_cache_dir": self.compile_cache_dir, "cpu_threads": self.cpu_threads,
                "prefix_chunk": prefix_chunk, "steps_per_dispatch": self.steps_per_dispatch, **self.kv_kwargs()}


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


class PrefixCacheConfig(BaseModel):
    """A pod's prefix cache: KV of prompt prefixes already seen, in blocks of `block_size` tokens,
    under its own byte budget (LRU), apart from the held-KV budget. A prefill pod's is a pool of
    blocks in device memory (`budget_bytes` of it, taken at start) that a hit's prefill reads in
    place (tandem_engine/prefix_pool.py); a decode pod's local prefills keep theirs in host memory."""

    enabled: bool = True
    block_size: PositiveInt = 16  # tokens per block; a prompt's trailing partial block is always computed
    budget_bytes: int = Field(default=64 * 1024 * 1024, ge=0)  # memory for cached blocks; 0 = off
    chunk_tokens: PositiveInt = 64  # a prompt after a cached prefix runs in chunks of this many (one compiled shape)


class WorkerSettings(BaseSettings):
    """The fields every worker pod (prefill, decode) has: where Redis and its gRPC server are,
    which model, its pool and identity, how it reads streams, writes token streams, beats and
    drains. Each service subclasses it with its own `env_prefix` (TANDEM_PREFILL_, TANDEM_DECODE_),
    its own fields, and its own defaults where the two differ (the gRPC port, `claim_block_ms`,
    `stale_pending_s`): a field redeclared in the subclass keeps its env name."""

    model_config = SettingsConfigDict(env_nested_delimiter="__")

    redis: RedisConfig = RedisConfig()  # <PREFIX>REDIS__URL
    grpc: GrpcConfig = GrpcConfig()
    engine: EngineConfig = EngineConfig()  # <PREFIX>ENGINE__MODEL
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()  # <PREFIX>PREFIX_CACHE__ENABLED
    pool: str = "default"
    worker_id: str = ""  # default: <role>-<hostname>-<pid>
    priority_high_weight: PositiveInt = 4  # high-priority reads per guaranteed low-priority read
    claim_block_ms: PositiveInt = 500  # the longest one wait for new stream entries blocks
    token_ttl_s: PositiveInt = 600
    token_finished_ttl_s: PositiveInt = 60  # a finished token stream lingers this long (for resumes)
    token_maxlen: PositiveInt = 8192
    heartbeat_interval_s: PositiveFloat = 1.0
    recover_interval_s: PositiveFloat = 1.0  # how often to look for dead pods' work
    stale_pending_s: PositiveFloat = 30.0  # an own delivery idle this long was lost (Redis restart): redo it
    drain_timeout_s: PositiveFloat = 30.0
    log_level: str = "INFO"
    # Reclaim of a dead consumer's pending entries: at most this many per stream per round, and
    # only those idle this long (an entry another pod claimed a moment ago has been reset to 0).
    reclaim_batch: PositiveInt = 100
    reclaim_min_idle_ms: PositiveInt = 1000

    def engine_kwargs(self, slots: int = 1) -> dict:
        """`tandem_engine.load_engine(**settings.engine_kwargs(slots))`: the engine block and the
        prefix cache's chunk size."""
        return self.engine.load_kwargs(slots, self.prefix_cache.chunk_tokens)
