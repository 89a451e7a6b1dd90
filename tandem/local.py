"""`tandem local`: a whole Tandem cluster on this machine, as separate processes.

An embedded real `redis-server` on a free loopback port (or an external Redis: `--redis-url`, a
Redis Cluster with `--redis-cluster`, or one found through its Sentinels with `--redis-sentinel`),
N prefill workers, M decode workers and the gateway, each a
child process configured through the same environment variables the Helm chart sets. Prints the
URL when the cluster answers; Ctrl-C / SIGTERM drains and stops everything.
Children die with the launcher (PR_SET_PDEATHSIG), so nothing outlives it; the embedded Redis's
data folder ($TMPDIR/tandem-redis/run-*) is removed when it stops.

Defaults that fit the model: the context (`--max-len`) is the model's own
`max_position_embeddings`, bounded by AUTO_MAX_LEN and by the memory the decode slots' KV may take
(KV_MEMORY_FRACTION of this machine's memory), and the launcher says which at start, with the slots.
A worker that cannot start with its configuration (exit 78, tandem_core/exits.py) stops the
launcher with its error instead of being restarted.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import time
import urllib.request
from pathlib import Path

from tandem.planner_follow import PlannerFollower
from tandem.redis_proc import RedisProcess, free_port
from tandem.supervisor import Child, ConfigExit, Supervisor
from tandem_core.errors import ModelNotFound
from tandem_core.exits import EXIT_CONFIG
from tandem_core.models import ModelInfo, resolve_model
from tandem_core.redis_client import redact_url

log = logging.getLogger("tandem.local")
DEFAULT_BUCKETS = [16, 32, 64, 128, 256, 512]  # prefill length buckets; doubled on up to the context
AUTO_MAX_LEN = 4096  # --max-len 0 (auto) never goes past this on a laptop: compile time and memory grow with it
KV_MEMORY_FRACTION = 0.25  # of this machine's memory, for the decode workers' KV at the auto context
KV_BYTES = 4  # float32 KV on a CPU
DEFAULT_CPU_THREADS = "1"  # --cpu-threads: every core for prefill was no faster in a quiet burst (bench/RESULTS.md)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = _parser()
    a = p.parse_args(argv)
    _check(p, a)
    return a


def _parser() -> argparse.ArgumentParser:
    """The workers' and the engine's flags here; Redis's and the planner's in their own groups."""
    p = argparse.ArgumentParser(
        prog="tandem local", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run a local Tandem cluster: embedded Redis (or an external one: --redis-url, "
        "--redis-cluster, --redis-sentinel), prefill and decode workers and the gateway as separate processes. "
        "The gateway serves the OpenAI API on http://HOST:PORT/v1.",
    )
    p.add_argument("--model", default=os.environ.get("TANDEM_MODEL", "builtin"),
                   help="preset name (builtin, tiny, small-100m) or a Hugging Face checkpoint directory of a "
                        "served family (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Mixtral, Qwen3-MoE, "
                        "gpt-oss: docs/models.md)")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)), help="gateway HTTP port")
    p.add_argument("--grpc-port", type=int, default=0, help="gateway gRPC port (0: a free port)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--slots", type=int, default=4,
                   help="decode slots per decode worker: requests decoded at once (sized for a laptop)")
    p.add_argument("--colocated", action="store_true",
                   help="no prefill workers: each decode worker prefills locally between steps (JetStream-style)")
    p.add_argument("--max-len", type=int, default=0,
                   help="positions per sequence (prompt + output); 0: the model's own context length, bounded "
                   f"by {AUTO_MAX_LEN} and by the memory the decode slots' KV may take (said at start)")
    p.add_argument("--quantize", choices=["int8"], default="",
                   help="weight-only quantization of the prefill and decode workers (both alike): int8 holds the "
                   "attention, MLP and expert matrices as int8 with one scale per output channel, half the weight "
                   "bytes of bfloat16 (quality against unquantized weights: bench/quantize_quality.py)")
    p.add_argument("--cpu-threads", type=_cpu_threads, default=DEFAULT_CPU_THREADS, metavar="N|ROLE=N,...",
                   help="XLA CPU compute threads of the prefill and decode workers (0: one per core): one count for "
                   "both, or per role (ROLE=N items; a role left out gets 1). Decode steps run back to back, so one "
                   "thread suits a laptop whose cores the workers share (idle pool threads spin against the other "
                   "workers; one for prefill too: every core for it gained nothing in a quiet burst run). A "
                   "--colocated worker takes decode's count")
    p.add_argument("--kv-blocks", type=int, default=0, metavar="N",
                   help="blocks in each decode worker's KV pool, taken as sequences grow (--slots counts sequence "
                   "rows; a decode worker claims work while it has the blocks for the prompt plus a reserve); 0: "
                   "slots x max-len positions")
    p.add_argument("--kv-block-size", type=int, default=16, metavar="B", help="positions per KV block")
    p.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto",
                   help="the decode KV's element type; fp8 (float8_e4m3fn) holds twice bfloat16's "
                   "positions in the same memory (its error: bench/quantize_quality.py --kv)")
    p.add_argument("--speculative", choices=["off", "ngram", "draft"], default="off",
                   help="speculative decoding in the decode workers: ngram checks each running request's n-gram "
                   "prompt-lookup proposal (what followed the latest earlier match of its last tokens) in one "
                   "step, greedy output unchanged, sampled output distributed as without it; pays where "
                   "outputs repeat their prompts (edits, quotes); draft: a smaller model's tokens "
                   "(--draft-model; sampled at a sampled request's parameters, --greedy-draft: its argmax) instead; "
                   "a request whose proposals miss stops proposing for a while (docs/local.md)")
    p.add_argument("--speculative-k", type=int, default=4, metavar="K",
                   help="with --speculative: tokens proposed at most per request and step")
    p.add_argument("--draft-model", default="", metavar="MODEL",
                   help="with --speculative draft: the draft model, a preset name or a Hugging Face directory "
                   "with the served model's tokenizer (each decode worker loads it beside the model)")
    p.add_argument("--greedy-draft", dest="draft_sample", action="store_false",
                   help="with --speculative draft: the draft proposes its greedy tokens for sampled requests too "
                   "(by default it samples at the request's temperature, top-k and top-p)")
    p.add_argument("--no-kv-reuse", dest="kv_reuse", action="store_false",
                   help="do not keep finished sequences' blocks for later ones that start with the same "
                   "tokens (by default a conversation's next turn pulls only the KV its decode worker lacks)")
    p.add_argument("--no-kv-window-group", dest="kv_window_group", action="store_false",
                   help="a family with windowed and global layers (gemma2, gemma3, gpt-oss): keep every block of "
                   "the windowed layers too (by default they keep only their window's blocks, and a finished "
                   "sequence's blocks are reused only by one that matches them to their end: a next turn)")
    p.add_argument("--kv-budget-bytes", type=int, default=256 * 1024 * 1024, help="held KV per prefill worker")
    p.add_argument("--prefix-cache-bytes", type=int, default=64 * 1024 * 1024, metavar="BYTES",
                   help="device memory per prefill worker for the KV blocks of prompt prefixes already seen (its prefix "
                        "pool; 0: none); a decode worker reuses its own KV pool's blocks (--no-kv-reuse)")
    p.add_argument("--pin", default="", metavar="ROLE=CPUS,...",
                   help="pin children to CPUs, e.g. prefill=0,decode=1,gateway=0,redis=0 (CPUS: 0, 0-1 or 0+1); "
                        "roles: prefill, decode, gateway, redis")
    _redis_flags(p.add_argument_group("redis"))
    _planner_flags(p.add_argument_group("planner"))
    p.add_argument("--log-level", default="INFO", help="log level of the launcher and every service")
    p.add_argument("--ready-timeout", type=float, default=180.0,
                   help="seconds to wait for the cluster (a decode worker at 16 rows warms in ~25 s on 2 quiet "
                        "CPU cores with an empty compilation cache)")
    return p


def _redis_flags(p) -> None:
    """The embedded Redis, or the external one to use instead (a plain URL, a cluster, sentinels)."""
    p.add_argument("--no-persistence", action="store_true",
                   help="run the embedded Redis without its append-only file (it is on unless this is given, so "
                   "a restarted Redis keeps queued requests and token streams)")
    p.add_argument("--redis-url", default="", metavar="URL",
                   help="use this external Redis instead of the embedded one (redis://[:PASSWORD@]HOST:PORT/DB, "
                   "rediss:// for TLS): no redis-server is started, and none is restarted; its restarts "
                   "are waited out by the services as the embedded one's are")
    p.add_argument("--redis-cluster", action="store_true",
                   help="with --redis-url: that URL is one node of a Redis Cluster (every service gets "
                   "TANDEM_<SERVICE>_REDIS__CLUSTER=true and uses the cluster client, which finds the other "
                   "nodes and follows failovers)")
    p.add_argument("--redis-sentinel", default="", metavar="HOST:PORT[,HOST:PORT...]",
                   help="use an external Redis through these Redis Sentinels instead of the embedded one "
                   "(no redis-server is started); every service follows the sentinels to a promoted "
                   "replica after a failover")
    p.add_argument("--redis-master", default="tandem", metavar="NAME",
                   help="with --redis-sentinel: the master name the sentinels monitor")


def _planner_flags(p) -> None:
    """The planner as one more child, and the worker counts it may reach."""
    p.add_argument("--planner", action="store_true",
                   help="also run the planner (tandem planner, mode local): it sizes the prefill and decode "
                   "workers to its TTFT/ITL targets (TANDEM_PLANNER_* settings pass through), and this launcher "
                   "starts workers and drains them (SIGTERM) to follow it; --prefill/--decode are the start")
    p.add_argument("--planner-port", type=int, default=9300, help="the planner's HTTP port (/metrics, /decision, /keda)")
    p.add_argument("--planner-interval", type=float, default=10.0, metavar="S", help="seconds between its decisions")
    p.add_argument("--planner-max", type=int, default=3, metavar="N", help="most workers of each role it may start")


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Flags that contradict each other end the command with a message that says which to drop."""
    if a.speculative_k < 1:
        p.error(f"--speculative-k must be >= 1 (got {a.speculative_k})")
    if (a.speculative == "draft") != bool(a.draft_model):
        p.error("--speculative draft needs --draft-model (a preset name or a Hugging Face directory with the "
                "served model's tokenizer), and --draft-model is read only with --speculative draft")
    if a.redis_cluster and not a.redis_url:
        p.error("--redis-cluster says the external Redis is a Redis Cluster: give one of its nodes with "
                "--redis-url redis://HOST:PORT (or drop --redis-cluster to run the embedded Redis)")
    if a.redis_url and a.redis_sentinel:
        p.error("--redis-url and --redis-sentinel both name the Redis to use: give one of them")
    if a.redis_url and not a.redis_url.startswith(("redis://", "rediss://")):
        p.error(f"--redis-url {a.redis_url!r} must start with redis:// (or rediss:// for TLS)")
    # The launcher follows the planner's decision with a plain Redis client (tandem/planner_follow.py):
    # it reads an embedded or external URL alike, but cannot find a key on a cluster's other nodes
    # or the primary behind sentinels.
    if a.planner and (a.colocated or a.redis_sentinel or a.redis_cluster):
        p.error("--planner sizes separate prefill and decode workers, following the planner through a plain "
                "Redis URL (the embedded one or --redis-url): not with --colocated, --redis-sentinel or --redis-cluster")
    if a.kv_blocks < 0 or a.kv_block_size < 1:
        p.error("--kv-blocks must be >= 0 (0: slots x max-len positions) and --kv-block-size >= 1")
    if a.planner and not 1 <= max(a.prefill, a.decode) <= a.planner_max:
        p.error(f"--planner: --prefill and --decode must be between 1 and --planner-max ({a.planner_max})")


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def auto_context(info: ModelInfo, slots: int, decode_workers: int, memory_bytes: int) -> tuple[int, str]:
    """(positions per sequence, why) for --max-len 0: the model's own context, bounded by
    AUTO_MAX_LEN and by the decode workers' KV fitting in KV_MEMORY_FRACTION of `memory_bytes`."""
    own = info.max_position_embeddings
    per_position = 2 * info.num_layers * info.num_kv_heads * info.head_dim * KV_BYTES  # K and V
    fits = int(memory_bytes * KV_MEMORY_FRACTION) // max(1, per_position * slots * max(1, decode_workers))
    fits = max(DEFAULT_BUCKETS[0], 1 << (fits.bit_length() - 1)) if fits >= DEFAULT_BUCKETS[0] else DEFAULT_BUCKETS[0]
    length = min(own, AUTO_MAX_LEN, fits)
    if length == own:
        return length, f"the model's own context length (max_position_embeddings {own})"
    if length == AUTO_MAX_LEN and fits >= AUTO_MAX_LEN:
        return length, f"the model's {own} bounded by {AUTO_MAX_LEN} on a local run"
    return length, (f"the model's {own} bounded by memory: {slots} slots x {decode_workers} decode worker(s) of "
                    f"KV in {KV_MEMORY_FRACTION:.0%} of {memory_bytes / 2**30:.1f} GiB")


def buckets_for(max_len: int) -> list[int]:
    """Prefill length buckets: the defaults, doubled on while below the context, then the context."""
    out = [b for b in DEFAULT_BUCKETS if b < max_len]
    while out and out[-1] * 2 < max_len:
        out.append(out[-1] * 2)
    return out + [max_len]


def _sentinel_hosts(spec: str) -> list[str]:
    """`--redis-sentinel a:26379,b:26379` -> ["a:26379", "b:26379"], each checked as host:port."""
    hosts = [h.strip() for h in spec.split(",") if h.strip()]
    for h in hosts:
        host, _, port = h.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"--redis-sentinel: {h!r} is not HOST:PORT (e.g. 127.0.0.1:26379)")
    return hosts


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the launcher dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _cpu_threads(spec: str) -> dict[str, int]:
    """`--cpu-threads 2` -> {"prefill": 2, "decode": 2}; `prefill=0,decode=1` -> per role (a role
    left out gets 1; 0: one per core). Raises ArgumentTypeError (argparse prints it) for anything else."""
    spec = spec.strip()
    if spec.isdigit():
        return {"prefill": int(spec), "decode": int(spec)}
    out = {"prefill": 1, "decode": 1}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        role, _, n = item.partition("=")
        if role not in out or not n.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"bad item {item!r}: give a count (e.g. 2) or ROLE=N items (ROLE one of prefill, decode; "
                "N >= 0, 0 meaning one per core), e.g. prefill=2,decode=1")
        out[role] = int(n)
    return out


def _pin_map(spec: str) -> dict[str, set[int]]:
    """`--pin prefill=0,decode=1` -> {"prefill": {0}, "decode": {1}} (CPUS: 0, 0-1 or 0+1)."""
    out: dict[str, set[int]] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        role, _, cpus = item.partition("=")
        if role not in ("prefill", "decode", "gateway", "redis") or not cpus:
            raise SystemExit(f"--pin: bad item {item!r} (want ROLE=CPUS, ROLE one of prefill, decode, gateway, redis)")
        got: set[int] = set()
        for part in cpus.split("+"):
            lo, _, hi = part.partition("-")
            got |= set(range(int(lo), int(hi or lo) + 1))
        out[role] = got
    return out


def jax_platforms_env(dev: str = "/dev") -> dict[str, str]:
    """JAX_PLATFORMS=cpu for the workers of a machine with no accelerator, unless the user set it:
    with libtpu installed (make test installs it, for the TPU compile tests) JAX otherwise starts
    the TPU plugin, which finds no TPU and prints initialisation errors into a healthy CPU
    cluster's log. A machine with a TPU (/dev/accel*, /dev/vfio) or an NVIDIA GPU keeps JAX's own choice."""
    if "JAX_PLATFORMS" in os.environ:
        return {}
    d = Path(dev)
    if any(d.glob("accel*")) or any(d.glob("vfio/[0-9]*")) or any(d.glob("nvidia[0-9]*")):
        return {}
    return {"JAX_PLATFORMS": "cpu"}


def _preexec_for(cpus: set[int] | None):
    """The child's pre-exec hook: die with the launcher, and run on `cpus` when pinned."""
    if not cpus:
        return _die_with_parent

    def hook() -> None:
        os.sched_setaffinity(0, cpus)
        _die_with_parent()

    return hook


class Cluster:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.sentinels = _sentinel_hosts(a.redis_sentinel)
        # an external Redis (a URL, a cluster, behind sentinels): nothing of ours to start, supervise or stop
        external = bool(self.sentinels or a.redis_url)
        self.redis = None if external else RedisProcess(appendonly=not a.no_persistence)
        self.pins = _pin_map(a.pin)
        if external and "redis" in self.pins:
            raise SystemExit("--pin redis=...: there is no embedded Redis to pin with --redis-url or --redis-sentinel")
        if self.redis is not None:
            self.redis.preexec = _preexec_for(self.pins.get("redis"))
        self.sup = Supervisor()
        self.grpc_port = a.grpc_port or free_port()
        if a.max_len <= 0:  # main() sizes it and says so; a Cluster built directly gets the same
            a.max_len, _ = auto_context(resolve_model(a.model), a.slots, a.decode, _memory_bytes())
        self.buckets = buckets_for(a.max_len)
        self.next_index = {"prefill": 0, "decode": 0}
        self.follower: PlannerFollower | None = None

    def _env(self, prefix: str, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)  # user-set TANDEM_* settings pass through; ours below win
        env.update({f"{prefix}LOG_LEVEL": self.a.log_level, "PYTHONUNBUFFERED": "1"})
        if self.sentinels:
            env[f"{prefix}REDIS__SENTINEL__HOSTS"] = json.dumps(self.sentinels)
            env[f"{prefix}REDIS__SENTINEL__MASTER_NAME"] = self.a.redis_master
        else:
            env[f"{prefix}REDIS__URL"] = self.redis_url
        # set either way: a TANDEM_*_REDIS__CLUSTER left in the shell must not contradict what runs
        env[f"{prefix}REDIS__CLUSTER"] = "true" if self.a.redis_cluster else "false"
        env.update(extra)
        return env

    @property
    def redis_url(self) -> str:
        """The URL the children get: the embedded Redis's, or --redis-url."""
        return self.redis.url if self.redis is not None else self.a.redis_url

    def _engine_env(self, prefix: str, role: str) -> dict[str, str]:
        return {**jax_platforms_env(), f"{prefix}ENGINE__MODEL": self.a.model, f"{prefix}ENGINE__MAX_LEN": str(self.a.max_len),
                f"{prefix}ENGINE__PREFILL_BUCKETS": json.dumps(self.buckets),
                f"{prefix}ENGINE__CPU_THREADS": str(self.a.cpu_threads[role]),
                f"{prefix}ENGINE__QUANTIZE": self.a.quantize,
                # the prefill pods' prefix pool (a decode pod's reuse is its KV pool's own blocks)
                **({f"{prefix}PREFIX_CACHE__BUDGET_BYTES": str(self.a.prefix_cache_bytes)} if role == "prefill" else {})}

    def _spawn(self, name: str, module: str, env: dict[str, str]) -> None:
        self.sup.add(Child(name, module, env, _preexec_for(self.pins.get(name.split("-")[0]))))

    def start(self) -> None:
        if self.redis is not None:
            self.redis.start()
            log.info("redis pid=%d url=%s", self.redis.pid, self.redis.url)
        elif self.sentinels:
            log.info("redis through sentinels %s, master %r", ",".join(self.sentinels), self.a.redis_master)
        else:
            log.info("external redis%s %s", " cluster through" if self.a.redis_cluster else "", redact_url(self.a.redis_url))
        for _ in range(0 if self.a.colocated else self.a.prefill):
            self.spawn_worker("prefill")
        for _ in range(self.a.decode):
            self.spawn_worker("decode")
        if self.a.planner:
            self.follower = PlannerFollower(self, self.redis_url)
            self.follower.start(self.a.prefill, self.a.decode)
            pre = "TANDEM_PLANNER_"
            # Workers here share the machine's cores: a correction of the profile would read their
            # contention as slowness and ask for more of them (a feedback loop), so it is off
            # unless set (bench/RESULTS.md, planner-run notes).
            own = {} if f"{pre}CORRECTION" in os.environ else {f"{pre}CORRECTION": "false"}
            self._spawn("planner", "planner", self._env(pre, {**own,
                f"{pre}MODE": "local", f"{pre}HOST": "127.0.0.1", f"{pre}PORT": str(self.a.planner_port),
                f"{pre}INTERVAL_S": str(self.a.planner_interval),
                f"{pre}PREFILL__MAX_REPLICAS": str(self.a.planner_max),
                f"{pre}DECODE__MAX_REPLICAS": str(self.a.planner_max)}))
        pre = "TANDEM_GATEWAY_"
        self._spawn("gateway", "gateway", self._env(pre, {
            f"{pre}HOST": self.a.host, f"{pre}PORT": str(self.a.port), f"{pre}GRPC_PORT": str(self.grpc_port),
            f"{pre}MODEL": self.a.model, f"{pre}MAX_CONTEXT_LEN": str(self.a.max_len),
            f"{pre}MAX_PROMPT_LEN": str(max(self.buckets))}))

    def spawn_worker(self, role: str) -> None:
        """Start the next worker of `role`; indices are never reused (a draining worker keeps its id)."""
        i = self.next_index[role]
        self.next_index[role] += 1
        if role == "prefill":
            pre = "TANDEM_PREFILL_"
            self._spawn(f"prefill-{i}", "prefill_svc", self._env(pre, {
                **self._engine_env(pre, "prefill"), f"{pre}GRPC__PORT": "0", f"{pre}GRPC__HOST": "127.0.0.1",
                f"{pre}WORKER_ID": f"prefill-{i}", f"{pre}KV_BUDGET_BYTES": str(self.a.kv_budget_bytes)}))
            return
        pre = "TANDEM_DECODE_"
        self._spawn(f"decode-{i}", "decode_svc", self._env(pre, {
            **self._engine_env(pre, "decode"), f"{pre}GRPC__PORT": "0", f"{pre}GRPC__HOST": "127.0.0.1",
            f"{pre}WORKER_ID": f"decode-{i}", f"{pre}SLOTS": str(self.a.slots),
            f"{pre}COLOCATED": "true" if self.a.colocated else "false", **self._kv_env(pre)}))

    def _kv_env(self, prefix: str) -> dict[str, str]:
        """The decode workers' KV pool and speculative decoding (a prefill worker keeps no decode KV: none of it there)."""
        return {f"{prefix}ENGINE__KV_BLOCKS": str(self.a.kv_blocks),
                f"{prefix}ENGINE__KV_BLOCK_SIZE": str(self.a.kv_block_size),
                f"{prefix}ENGINE__KV_REUSE": "true" if self.a.kv_reuse else "false",
                f"{prefix}ENGINE__KV_WINDOW_GROUP": "true" if self.a.kv_window_group else "false",
                f"{prefix}ENGINE__KV_DTYPE": self.a.kv_dtype,
                f"{prefix}SPECULATIVE__METHOD": self.a.speculative, f"{prefix}SPECULATIVE__K": str(self.a.speculative_k),
                f"{prefix}SPECULATIVE__DRAFT_MODEL": self.a.draft_model,
                f"{prefix}SPECULATIVE__DRAFT_SAMPLE": "true" if self.a.draft_sample else "false"}

    def url(self) -> str:
        host = "127.0.0.1" if self.a.host in ("0.0.0.0", "") else self.a.host
        return f"http://{host}:{self.a.port}"

    def wait_ready(self) -> None:
        """Ready = the gateway answers and every worker has registered a heartbeat."""
        want = {"prefill": 0 if self.a.colocated else self.a.prefill, "decode": self.a.decode}
        deadline = time.monotonic() + self.a.ready_timeout
        last = ""
        while time.monotonic() < deadline:
            self.check_children()
            try:
                with urllib.request.urlopen(self.url() + "/admin/cluster", timeout=2) as resp:
                    workers = json.load(resp).get("workers", [])
                have = {r: sum(1 for w in workers if w["role"] == r) for r in want}
                if all(have[r] >= n for r, n in want.items()):
                    return
                status = f"workers up: prefill {have['prefill']}/{want['prefill']}, decode {have['decode']}/{want['decode']}"
            except OSError:
                status = "waiting for the gateway"
            if status != last:
                log.info("%s", status)
                last = status
            time.sleep(0.3)
        raise TimeoutError(f"cluster not ready within {self.a.ready_timeout}s ({last})")

    def check_children(self) -> None:
        """Supervision: restart whatever died (an embedded Redis too, on its port with its data)."""
        if self.redis is None:  # external: its restarts and failovers are not ours to handle
            self.sup.tick()
            alive = True
        else:
            alive = self.redis.proc is not None and self.redis.proc.poll() is None
            self.sup.tick(restart_redis=self._restart_redis, redis_alive=alive)
        if self.follower is not None and alive:
            self.follower.follow()

    def _restart_redis(self) -> None:
        self.redis.start()
        log.info("redis pid=%d url=%s (restarted)", self.redis.pid, self.redis.url)

    def stop(self, grace_s: float = 40.0) -> None:
        self.sup.stop(grace_s)  # gateway first: stop accepting, then workers drain through Redis
        if self.redis is not None:
            self.redis.close()  # and its data folder with it
        log.info("cluster stopped")


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s [local] %(message)s")
    try:
        info = resolve_model(a.model)
    except ModelNotFound as e:
        log.error("%s", e.message)
        return EXIT_CONFIG
    why = "--max-len"
    if a.max_len <= 0:
        a.max_len, why = auto_context(info, a.slots, a.decode, _memory_bytes())
    log.info("serving %s%s: context %d positions, %s; %d decode slots per decode worker (--slots); "
             "prefill buckets %s", a.model, f" ({a.quantize} weights)" if a.quantize else "", a.max_len, why,
             a.slots, buckets_for(a.max_len))
    log.info("decode KV: %d blocks of %d positions per decode worker (--kv-blocks, --kv-block-size; --slots %d "
             "sequence rows); finished sequences' blocks %s", a.kv_blocks or -(-a.slots * a.max_len // a.kv_block_size),
             a.kv_block_size, a.slots, "kept for reuse" if a.kv_reuse else "not kept (--no-kv-reuse)")
    cluster = Cluster(a)
    stopping = {"flag": False}

    def on_signal(signum, _frame):
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        cluster.start()
        cluster.wait_ready()
        print(f"Tandem is serving {a.model} at {cluster.url()}/v1 (gRPC on 127.0.0.1:{cluster.grpc_port}); "
              f"Ctrl-C stops it.", flush=True)
        while not stopping["flag"]:
            cluster.check_children()
            time.sleep(0.2)
    except ConfigExit as e:
        log.error("%s", e)
        code = EXIT_CONFIG
    except (RuntimeError, TimeoutError) as e:
        log.error("%s", e)
        code = 1
    finally:
        cluster.stop()
    return code
