"""Token-plane benchmark (issue 15): decode pods' token writes and gateways' token readers on Redis.

The token plane alone against ONE Redis at rising load until saturation; a 10,000-stream gateway;
where a run's keys land on a 3-master Redis Cluster; and Redis commands per output token on the
real path.

    python bench/token_plane.py [--quick] [--no-write] [--parts plane,streams,keys,e2e,burst]

Parts (each replaces its own part of bench/out/token_plane.json; the RESULTS.md section
`token_plane` is drawn from all the parts recorded there):
  * plane    N publisher processes (decode pods: `OwnedPublisher.own` per request, ONE
             `add_batch` per pod and step on a pipeline, the decode pod's cancel-key MGET every
             50 ms) and G gateway processes (one `gateway.tokens.TokenMux` each, a relay task per
             request doing `subscribe` / `get` to the finish) at rising steps/s until saturation:
             the p99 publisher->gateway latency passes --p99-bound-ms, delivered falls under 0.9x
             written, the publishers cannot write what is asked, or delivered stops rising.
             Per step: tokens/s, latency, Redis commands / bytes / CPU per token (INFO deltas),
             gateway and publisher CPU per token, the cores each process ran on.
  * streams  one gateway process, one TokenMux, --streams concurrent subscriptions (10,000),
             redis max_connections 64, publishers writing 8..16 tokens for every one of them:
             every stream exactly once and in order, the gateway's peak Redis connections (CLIENT
             LIST by its client name, and its pid's TCP sockets to Redis), time to deliver, XREAD
             cost per call; then 1,000 streams alone and 1,000 beside 9,000 subscriptions nobody
             writes (--streams-compare), to show how an XREAD's cost grows with the keys it names.
  * keys     the plane part's key names, as tandem_core.keys names them with 1, 3 and 16 key
             shards, on a 3-master Redis Cluster (tandem.redis_cluster's RedisClusterProcess):
             keys and operations per master, and each master's DBSIZE once they are written.
  * e2e      `tandem local` with the built-in model: 64 streamed completions of 32 tokens, INFO
             commandstats of its embedded Redis before and after (bench/token_plane_e2e.py).
  * burst    `tandem local`: thousands of short streamed requests at once; served vs refused
             (429/503) and why, under three (admission_max_backlog, max_open_streams) pairs:
             (1024, 4096), (8192, 4096), (8192, 16384); --quick: the first and the last.
Writes bench/out/token_plane.json and, unless --no-write, the `token_plane` section of
bench/RESULTS.md. The processes share this machine's cores: see the cores table in the report.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import token_plane_stats as st
from bench.common import code_version, machine_info, merge_summary, write_section
from bench.token_plane_procs import CoreSampler, Profiler, Roles, cpu_by_role, snapshot, start_redis
from bench.token_plane_roles import PlaneConfig, length_of, token_of

OUT = ROOT / "bench" / "out"
DOC = OUT / "token_plane.json"
SECTION = "token_plane"
PARTS = ("plane", "streams", "keys", "e2e", "burst")


@dataclass
class PlanePlan:
    publishers: int = 2
    gateways: int = 2
    batch: int = 64  # slots per decode pod
    tokens: int = 64  # per request
    start_rate: float = 10.0  # steps/s per pod
    factor: float = 1.6
    max_steps: int = 12
    warmup_s: float = 1.5
    measure_s: float = 4.0
    p99_bound_ms: float = 50.0
    shards: int = 1
    cancel_poll_s: float = 0.05
    pin: dict = field(default_factory=dict)  # role -> cpus (redis, publishers, gateways)
    rates: list = field(default_factory=list)  # explicit steps/s (overrides start_rate/factor)
    profile: bool = False  # py-spy gateway0 and publisher0 through every window
    inject: str = ""  # PlaneConfig.inject: a fault the benchmark must report (its own tests)


@dataclass
class StreamsPlan:
    streams: int = 10_000
    publishers: int = 2
    pods: int = 20  # per publisher process: 2 x 20 pods x 250 slots = 10,000 streams
    steps_per_s: float = 5.0
    max_connections: int = 64
    compare: list = field(default_factory=lambda: ["1000", "1000+9000"])  # active[+idle] streams
    timeout_s: float = 300.0
    pin: dict = field(default_factory=dict)
    profile_s: float = 0.0  # py-spy the gateway this long once writing starts (0: no profile)


# ---------------------------------------------------------------------------------------------
# plane


def run_plane(plan: PlanePlan, progress=print) -> dict:
    tmp = tempfile.mkdtemp(prefix="tandem-tp-")
    cfg = PlaneConfig(redis_url="", out_dir=tmp, run_id=random.getrandbits(32), publishers=plan.publishers,
                      batch=plan.batch, tokens=plan.tokens, gateways=plan.gateways, shards=plan.shards,
                      cancel_poll_s=plan.cancel_poll_s, inject=plan.inject)
    import redis as redis_py

    redis = start_redis(plan.pin.get("redis"))
    cfg.redis_url = redis.url
    roles = Roles(cfg, plan.pin)
    r = redis_py.Redis.from_url(redis.url)
    try:
        wakeup = xread_wakeup(redis.url)
        roles.start(subscribed=2 * cfg.slots)
        pids = {"redis": redis.pid, **roles.pids()}
        cores = CoreSampler(pids)
        cores.start()
        windows, live = [], []
        rates = list(plan.rates) or [plan.start_rate * plan.factor ** k for k in range(plan.max_steps)]
        why = ""
        for k, rate in enumerate(rates):
            roles.ctl.steps_per_s.value = rate
            # the first step also waits for every slot's first request (staggered over one length)
            time.sleep(plan.warmup_s + (plan.tokens / rate if k == 0 else 0.0))
            s0, h0, w0 = snapshot(r, pids), roles.lag(), roles.counter("written")
            profs = {n: Profiler(pids[n], plan.measure_s, OUT / "token_plane" / f"plane-{n}-{k + 1}.txt")
                     for n in ("gateway0", "publisher0")} if plan.profile else {}
            time.sleep(plan.measure_s)
            s1, h1, w1 = snapshot(r, pids), roles.lag(), roles.counter("written")
            dur = s1["t"] - s0["t"]
            lv = {"steps_per_s": rate, "target_per_s": rate * cfg.slots, "written_per_s": (w1 - w0) / dur,
                  "delivered_per_s": float((h1 - h0).sum()) / dur, "p99_ms": st.hist_quantile(h1 - h0, 0.99)}
            live.append(lv)
            windows.append({"steps_per_s": rate, "s0": s0, "s1": s1, "live": lv,
                            "profile": {n: p.top() for n, p in profs.items()}})
            cpu = cpu_by_role(s0, s1)
            progress(f"  plane step {k + 1}: {rate:.1f} steps/s x {cfg.slots} slots: asked {lv['target_per_s']:.0f}, "
                     f"written {lv['written_per_s']:.0f}, delivered {lv['delivered_per_s']:.0f} tok/s, live p99 "
                     f"<= {lv['p99_ms']:g} ms; CPU s/s redis {cpu.get('redis', 0) / dur:.2f} gateways "
                     f"{cpu.get('gateway', 0) / dur:.2f} publishers {cpu.get('publisher', 0) / dur:.2f}")
            why = st.saturated(live, plan.p99_bound_ms)
            if why:
                progress(f"  saturated: {why}")
                break
        core_doc = cores.stop()
        pubs, gws = roles.finish()
    except BaseException:
        roles.kill()
        raise
    finally:
        r.close()
        redis.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    joined = st.join(pubs, gws, lambda s, g: length_of(cfg, s, g), token_of)
    rows = [_plane_row(w, joined, cfg) for w in windows]
    key_ops = {str(n): plane_key_ops(cfg, pubs, n) for n in KEY_SHARDS}
    return {"plan": asdict(plan), "config": json.loads(cfg.to_json()), "rows": rows, "saturated": why,
            "streams": joined["streams"], "streams_ok": joined["streams_ok"], "errors": joined["errors"],
            "error_examples": joined["error_examples"], "tokens": joined["tokens"],
            "fenced": int(sum(int(p["fenced"]) for p in pubs)), "gateway_reads": int(sum(int(g["reads"]) for g in gws)),
            "cores": core_doc, "key_ops": key_ops, "xread_wakeup": wakeup}


def xread_wakeup(url: str, n: int = 100) -> dict:
    """How many of `n` streams the reply to a blocked XREAD over all of them carries, when one
    script XADDs to every one (as the fenced write does): Redis serves a blocked multi-stream read
    with the stream that woke it, so the reader needs a second XREAD for the rest."""
    import threading

    import redis as redis_py

    names = [f"tp:wakeup:{i}" for i in range(n)]
    got: dict = {}
    with redis_py.Redis.from_url(url) as r:
        r.delete(*names)

        def read() -> None:
            with redis_py.Redis.from_url(url) as c:
                got["reply"] = c.xread({k: "0-0" for k in names}, block=5000)

        t = threading.Thread(target=read)
        t.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and int(r.info("clients").get("blocked_clients", 0)) < 1:
            time.sleep(0.01)
        r.eval("for i = 1, #KEYS do redis.call('XADD', KEYS[i], '*', 'i', i) end return 1", n, *names)
        t.join(10)
        version = r.info("server")["redis_version"]
        r.delete(*names)
    return {"streams": n, "in_reply": len(got.get("reply") or []), "redis_version": version}


def _plane_row(w: dict, joined: dict, cfg: PlaneConfig) -> dict:
    s0, s1 = w["s0"], w["s1"]
    ws = st.window_stats(joined["send"], joined["arrival"], s0["t"], s1["t"])
    rc = st.redis_cost(s0["info"], s1["info"], ws["seconds"], ws["written"])
    cpu = cpu_by_role(s0, s1)
    return {"steps_per_s": w["steps_per_s"], "target_per_s": w["steps_per_s"] * cfg.slots, **ws, "redis": rc,
            "cpu_s": cpu, "gateway_cpu_us_per_token": cpu.get("gateway", 0) * 1e6 / max(ws["delivered"], 1),
            "publisher_cpu_us_per_token": cpu.get("publisher", 0) * 1e6 / max(ws["written"], 1),
            "gateway_cpu_util": cpu.get("gateway", 0) / ws["seconds"],
            "publisher_cpu_util": cpu.get("publisher", 0) / ws["seconds"],
            "connected_clients": int(s1["info"].get("connected_clients", 0)), "live": w["live"],
            "profile": w.get("profile") or None,
            "load_avg_1m": s1["load_avg_1m"]}


def plane_key_ops(cfg: PlaneConfig, pubs: list[dict], shards: int) -> dict[str, float]:
    """{key: Redis operations on it} for every key a plane run touched, named by tandem_core.keys
    as this checkout names them: per token HEXISTS on the pod's running hash, XADD + EXPIRE on
    the request's stream; per request HSET + HDEL on the running hash. (XREADs and cancel MGETs
    touch the same streams' slots and are left out: they follow the streams.) Named with `shards`
    key shards, whatever the run itself used: the names are all that placement needs."""
    from bench.token_plane_roles import rid
    from tandem_core.keys import KeySpace

    ks = KeySpace(shards)
    ops: dict[str, float] = {}
    for p, pub in enumerate(pubs):
        for slot, gen, _step in np.asarray(pub["starts"]).tolist():
            worker_id = f"tp{cfg.run_id:x}-decode-{p}-{(slot // cfg.batch) % cfg.pods}"
            request_id = rid(cfg.run_id, slot, gen)
            n = length_of(cfg, slot, gen)
            running = _running_key(ks, worker_id, request_id)
            ops[ks.token_stream(request_id)] = ops.get(ks.token_stream(request_id), 0) + 2 * n
            ops[running] = ops.get(running, 0) + n + 2
    return ops


def _running_key(ks, worker_id: str, request_id: str) -> str:
    """The running hash a request's fenced writes check (one per pod and shard)."""
    return ks.running_key(worker_id, ks.request_shard(request_id))


# ---------------------------------------------------------------------------------------------
# streams


def parse_streams(spec: str) -> tuple[int, int]:
    """`1000` -> (1000, 0); `1000+9000` -> 1,000 written streams and 9,000 more subscribed ones
    that nobody writes (requests still queued for a prefill)."""
    active, _, idle = spec.partition("+")
    return int(active), int(idle or 0)


def run_streams(plan: StreamsPlan, n_streams: int, idle: int = 0, progress=print) -> dict:
    import psutil
    import redis as redis_py

    redis = start_redis(plan.pin.get("redis"))
    tmp = tempfile.mkdtemp(prefix="tandem-tp-")
    pods = plan.pods
    while n_streams % (plan.publishers * pods):  # every stream a slot of its own
        pods -= 1
    cfg = PlaneConfig(redis_url=redis.url, out_dir=tmp, run_id=random.getrandbits(32), publishers=plan.publishers,
                      pods=pods, batch=n_streams // (plan.publishers * pods), tokens=0, gateways=1,
                      one_request_per_slot=True, idle_streams=idle, stagger=False, max_connections=plan.max_connections)
    roles = Roles(cfg, plan.pin)
    r = redis_py.Redis.from_url(redis.url)
    peak = {"client_list": 0, "tcp": 0}

    def sample_connections(roles_: Roles) -> None:
        """The gateway's connections to Redis two ways: CLIENT LIST entries with its client name
        (redis-py names every connection of its pool) and its pid's TCP sockets to Redis's port."""
        clients = r.client_list()
        peak["client_list"] = max(peak["client_list"], sum(1 for c in clients if c.get("name") == "tp-gw0"))
        try:
            conns = psutil.Process(roles_.procs["gateway0"].pid).net_connections("tcp")
        except psutil.Error:
            return
        peak["tcp"] = max(peak["tcp"], sum(1 for c in conns if c.raddr and c.raddr.port == redis.port))

    try:
        t_sub = time.monotonic()
        roles.start(subscribed=cfg.slots + idle, timeout_s=plan.timeout_s, on_wait=sample_connections)
        t_sub = time.monotonic() - t_sub
        pids = {"redis": redis.pid, **roles.pids()}
        cores = CoreSampler(pids)
        cores.start()
        s0 = snapshot(r, pids)
        roles.ctl.steps_per_s.value = plan.steps_per_s if plan.steps_per_s > 0 else -1.0
        prof = Profiler(pids["gateway0"], plan.profile_s, OUT / "token_plane" / f"gateway-{n_streams}+{idle}.txt") \
            if plan.profile_s else None
        deadline = time.monotonic() + plan.timeout_s
        next_print = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            sample_connections(roles)
            done = all(v.value for v in roles.ctl.done)
            if done and roles.counter("completed") >= roles.counter("finished"):
                break
            if time.monotonic() > next_print:
                next_print += 2.0
                progress(f"  streams {n_streams}: written {roles.counter('written')} tokens, "
                         f"{roles.counter('completed')}/{cfg.slots} streams complete, gateway Redis connections "
                         f"now {peak['tcp']} (peak)")
            time.sleep(0.1)
        s1 = snapshot(r, pids)
        core_doc = cores.stop()
        profile = prof.top() if prof else None
        pubs, gws = roles.finish(timeout_s=30.0)
    except BaseException:
        roles.kill()
        raise
    finally:
        r.close()
        redis.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    joined = st.join(pubs, gws, lambda s, g: length_of(cfg, s, g), token_of)
    send, arrival = joined["send"], joined["arrival"]
    span = float(arrival.max() - send.min()) if len(send) else float("nan")
    rc = st.redis_cost(s0["info"], s1["info"], s1["t"] - s0["t"], max(joined["tokens"], 1))
    cpu = cpu_by_role(s0, s1)
    xread = rc["commands"].get("xread", {"calls": 0, "usec": 0})
    reads = int(sum(int(g["reads"]) for g in gws))
    keys_read = int(sum(int(g["xread_keys"]) for g in gws))
    lat = (arrival - send) * 1000.0
    return {"plan": asdict(plan), "streams_asked": n_streams, "idle_streams": idle, "config": json.loads(cfg.to_json()),
            "profile": profile, "xread_bytes_per_call": int(sum(int(g["xread_bytes"]) for g in gws)) / max(reads, 1),
            "streams": joined["streams"], "streams_ok": joined["streams_ok"], "errors": joined["errors"],
            "error_examples": joined["error_examples"], "tokens": joined["tokens"], "subscribe_s": t_sub,
            "deliver_s": span, "delivered_per_s": joined["tokens"] / span if span == span and span > 0 else None,
            "latency_ms": {q: st._pct(lat, v) for q, v in (("p50", 50), ("p99", 99), ("max", 100))},
            "peak_gateway_connections": peak, "redis": rc, "cpu_s": cpu,
            "gateway_cpu_us_per_token": cpu.get("gateway", 0) * 1e6 / max(joined["tokens"], 1),
            "xread_calls": xread["calls"], "xread_usec_per_call": xread["usec"] / max(xread["calls"], 1),
            "xread_redis_s": xread["usec"] / 1e6, "mux_reads": reads,
            "tokens_per_read": joined["tokens"] / max(reads, 1), "xread_keys": keys_read,
            "keys_per_read": keys_read / max(reads, 1), "gateway_xread_calls": int(sum(int(g["xread_calls"]) for g in gws)),
            "gateway_cpu_ms_per_read": cpu.get("gateway", 0) * 1e3 / max(reads, 1),
            "cores": core_doc, "load_avg_1m": [s0["load_avg_1m"], s1["load_avg_1m"]],
            "gateway_cpu_s": cpu.get("gateway", 0.0), "xread_redis_usec": xread["usec"]}


# ---------------------------------------------------------------------------------------------
# keys


KEY_SHARDS = (1, 3, 16)  # shard counts whose key names the keys part places (16: redis.cluster's default)


def run_keys(key_ops_by_shards: dict[str, dict[str, float]], progress=print) -> dict:
    """Where the plane run's keys land on a real 3-master Redis Cluster (CLUSTER SLOTS), named as
    tandem_core.keys names them under each shard count, or, without tandem.redis_cluster's
    RedisClusterProcess, on the even split of `redis-cli --cluster create`."""
    from redis.crc import key_slot

    try:
        from tandem.redis_cluster import RedisClusterProcess
    except ImportError:
        RedisClusterProcess = None
    source = "even split of 3 masters (no RedisClusterProcess in this checkout)"
    ranges = [(0, 5460, "master-0"), (5461, 10922, "master-1"), (10923, 16383, "master-2")]
    dbsize: dict = {}
    cluster = None
    if RedisClusterProcess is not None:
        import redis as redis_py

        cluster = RedisClusterProcess(masters=3, replicas_per_master=0)
        try:
            cluster.start()
            with redis_py.Redis(host="127.0.0.1", port=cluster.nodes[0].port) as r:
                slots = r.execute_command("CLUSTER", "SLOTS")
            ranges = [(int(a), int(b), f"127.0.0.1:{int(m[1])}") for a, b, m, *_ in slots]
            source = "CLUSTER SLOTS of a 3-master RedisClusterProcess (tandem/redis_cluster.py)"
            for shards, key_ops in key_ops_by_shards.items():
                dbsize[shards] = _write_keys(cluster, key_ops)
        finally:
            cluster.stop()
    by_shards = {}
    for shards, key_ops in key_ops_by_shards.items():
        doc = st.placement(key_ops, lambda k: key_slot(k.encode()), st.slot_owner(ranges))
        doc.update({"keys": len(key_ops), "dbsize": dbsize.get(shards)})
        by_shards[shards] = doc
        progress(f"  keys, {shards} shards: {len(key_ops)} keys, {doc['distinct_slots']} slots, busiest master "
                 f"{doc['max_ops_share']:.0%} of ops")
    return {"source": source, "ranges": ranges, "by_shards": by_shards}


def _write_keys(cluster, key_ops: dict[str, float]) -> dict | None:
    """Write one small value per key through redis-py's cluster client and read DBSIZE per node:
    the placement as the cluster itself reports it (the nodes are flushed first)."""
    import redis as redis_py
    from redis.cluster import RedisCluster

    try:
        for node in cluster.nodes:
            with redis_py.Redis(host="127.0.0.1", port=node.port) as r:
                r.flushall()
        rc = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        names = list(key_ops)
        for i in range(0, len(names), 500):
            pipe = rc.pipeline()
            for k in names[i:i + 500]:
                pipe.set(k, 1, ex=600)
            pipe.execute()
        rc.close()
        out = {}
        for node in cluster.nodes:
            with redis_py.Redis(host="127.0.0.1", port=node.port) as r:
                out[f"127.0.0.1:{node.port}"] = int(r.dbsize())
        return out
    except Exception as e:  # noqa: BLE001 - the computed placement stands without it
        return {"error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------------------------
# the command line


def _pins(text: str) -> dict:
    """`redis=0,publishers=1,gateways=0-1` -> {role: [cpus]}."""
    out = {}
    for item in filter(None, text.split(",")):
        role, _, cpus = item.partition("=")
        if role not in ("redis", "publishers", "gateways") or not cpus:
            raise SystemExit(f"--pin: bad item {item!r} (want ROLE=CPUS, ROLE one of redis, publishers, gateways)")
        got: list[int] = []
        for part in cpus.split("+"):
            a, _, b = part.partition("-")
            got += list(range(int(a), int(b or a) + 1))
        out[role] = got
    return out


def plane_series(result: dict) -> list[dict]:
    """The plane part's runs, one per shard count (a single run's result is one series)."""
    return result["series"] if "series" in result else [result]


def exit_code(doc: dict) -> int:
    """1 when any stream of a recorded plane or streams part was not delivered exactly once in order."""
    bad = 0
    parts = doc.get("parts", {})
    if "plane" in parts:
        bad += sum(x["errors"] for x in plane_series(parts["plane"]["result"]))
    if "streams" in parts:
        bad += sum(r["errors"] for r in parts["streams"]["result"]["runs"])
    return 1 if bad else 0


def summary_keys(doc: dict) -> dict:
    parts, out = doc.get("parts", {}), {}
    if "plane" in parts and plane_series(parts["plane"]["result"])[0]["rows"]:
        rows = plane_series(parts["plane"]["result"])[0]["rows"]
        best = max(rows, key=lambda r: r["delivered_per_s"])
        out.update({"token_plane_max_delivered_tok_s": best["delivered_per_s"],
                    "token_plane_redis_cpu_us_per_token": best["redis"]["cpu_us_per_token"],
                    "token_plane_redis_commands_per_token": best["redis"]["calls_per_token"],
                    "token_plane_gateway_cpu_us_per_token": best["gateway_cpu_us_per_token"]})
    if "streams" in parts:
        big = max(parts["streams"]["result"]["runs"], key=lambda r: r["streams"])
        out.update({"streams_max_exactly_once": big["errors"] == 0, "streams_max": big["streams"],
                    "streams_max_peak_gateway_connections": max(big["peak_gateway_connections"].values()),
                    "streams_max_deliver_s": big["deliver_s"]})
    if "e2e" in parts and parts["e2e"]["result"].get("status") == "ok":
        out["e2e_redis_commands_per_token"] = parts["e2e"]["result"]["total"]["run"]
        out["e2e_redis_bytes_in_per_token"] = parts["e2e"]["result"]["bytes_in_per_token"]
    return out


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"not JSON: {type(x).__name__}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--quick", action="store_true", help="smaller plane (1 publisher, 1 gateway, 32 slots), streams "
                   "without the comparison run, 32 e2e requests, one burst of 2,000 (a few minutes)")
    p.add_argument("--no-write", action="store_true", help="leave bench/RESULTS.md alone (the JSON is still written)")
    p.add_argument("--parts", default="plane,streams,keys,e2e,burst", help=f"comma-separated, any of {', '.join(PARTS)}")
    p.add_argument("--out", default=str(DOC), help="the JSON document (default bench/out/token_plane.json)")
    p.add_argument("--report-only", action="store_true", help="re-render the recorded JSON")
    g = p.add_argument_group("plane")
    g.add_argument("--publishers", type=int, default=0, help="publisher processes (default 2; 1 with --quick)")
    g.add_argument("--gateways", type=int, default=0, help="gateway processes (default 2; 1 with --quick)")
    g.add_argument("--batch", type=int, default=0, help="slots per decode pod (default 64; 32 with --quick)")
    g.add_argument("--tokens", type=int, default=0, help="tokens per request (default = --batch)")
    g.add_argument("--rates", default="", help="steps/s per pod, comma-separated (default: rising from --start-rate)")
    g.add_argument("--start-rate", type=float, default=10.0, help="first steps/s per pod (default 10)")
    g.add_argument("--factor", type=float, default=0, help="steps/s growth per step (default 1.6; 2 with --quick)")
    g.add_argument("--max-steps", type=int, default=12, help="load steps at most (default 12)")
    g.add_argument("--warmup-s", type=float, default=0, help="seconds before each window (default 1.5; 1 with --quick)")
    g.add_argument("--measure-s", type=float, default=0, help="seconds per window (default 4; 2 with --quick)")
    g.add_argument("--p99-bound-ms", type=float, default=50.0, help="saturated once p99 latency passes this (50)")
    g.add_argument("--shards", default="", help="key shards (hash tags: redis.shards) of each plane series, "
                   "comma-separated (default 1,16: a plain Redis's and redis.cluster's defaults; 1 with --quick)")
    g.add_argument("--cancel-poll-s", type=float, default=0.05, help="publishers' cancel MGET interval (0.05; 0: none)")
    g.add_argument("--profile", action="store_true", help="py-spy gateway0 and publisher0 in every plane window")
    g.add_argument("--pin", default="", help="CPUs per role, e.g. redis=0,publishers=1,gateways=1 (default: none)")
    g = p.add_argument_group("streams")
    g.add_argument("--streams", type=int, default=10_000, help="concurrent streams on one gateway (10,000)")
    g.add_argument("--streams-compare", default="", help="more runs the same way, ACTIVE[+IDLE] streams, comma-"
                   "separated: IDLE more subscriptions nobody writes (default 1000,1000+9000; none with --quick)")
    g.add_argument("--profile-s", type=float, default=0.0, help="py-spy the gateway this long in each streams run "
                   "(0: no profile)")
    g.add_argument("--streams-rate", type=float, default=5.0, help="steps/s per pod in the streams part (5; 0: back "
                   "to back)")
    g.add_argument("--streams-max-connections", type=int, default=64, help="the gateway's Redis pool bound (64)")
    g = p.add_argument_group("e2e and burst (tandem local)")
    g.add_argument("--e2e-requests", type=int, default=0, help="streamed completions of 32 tokens (64; 32 with --quick)")
    g.add_argument("--burst", default="", help="burst sizes, comma-separated (default 2000,5000; 2000 with --quick)")
    g.add_argument("--burst-slots", type=int, default=16, help="decode slots of the burst's tandem local (16)")
    a = p.parse_args(argv)
    out_path = Path(a.out)
    doc = json.loads(out_path.read_text()) if out_path.exists() else {"parts": {}}
    if a.report_only:
        return publish(doc, not a.no_write)
    parts = [x for x in a.parts.split(",") if x]
    if bad := [x for x in parts if x not in PARTS]:
        p.error(f"unknown parts {bad}; choose from {', '.join(PARTS)}")
    q = a.quick
    command = "python bench/token_plane.py " + " ".join(argv)
    pin = _pins(a.pin)
    shards = a.shards or ("1" if q else "1,16")
    plane_plan = PlanePlan(publishers=a.publishers or (1 if q else 2), gateways=a.gateways or (1 if q else 2),
                           batch=a.batch or (32 if q else 64), tokens=a.tokens or a.batch or (32 if q else 64),
                           start_rate=a.start_rate, factor=a.factor or (2.0 if q else 1.6), max_steps=a.max_steps,
                           warmup_s=a.warmup_s or (1.0 if q else 1.5), measure_s=a.measure_s or (2.0 if q else 4.0),
                           p99_bound_ms=a.p99_bound_ms, cancel_poll_s=a.cancel_poll_s, pin=pin,
                           rates=[float(x) for x in a.rates.split(",") if x], profile=a.profile)
    for part in parts:
        t0 = time.perf_counter()
        print(f"--> {part}", flush=True)
        if part == "plane":
            print(f"  plane: {plane_plan.publishers} publishers x {plane_plan.batch} slots, {plane_plan.gateways} "
                  f"gateways, key shards {shards}", flush=True)
        if part == "plane":
            shard_counts = [int(x) for x in shards.split(",") if x]
            result = {"series": [run_plane(replace(plane_plan, shards=n), progress=_progress) for n in shard_counts]}
        elif part == "streams":
            compare = [x for x in (a.streams_compare or ("" if q else "1000,1000+9000")).split(",") if x]
            sp = StreamsPlan(streams=a.streams, steps_per_s=a.streams_rate, max_connections=a.streams_max_connections,
                             pin=pin, compare=compare, profile_s=a.profile_s)
            runs = [(a.streams, 0)] + [parse_streams(x) for x in compare]
            result = {"runs": [run_streams(sp, n, idle, progress=_progress) for n, idle in runs]}
        elif part == "keys":
            plane = doc["parts"].get("plane")
            if plane is None:
                print("  keys: no plane part recorded yet; run --parts plane first", flush=True)
                continue
            result = run_keys(plane_series(plane["result"])[0]["key_ops"], progress=_progress)
        elif part == "e2e":
            from bench.token_plane_e2e import run_e2e

            result = run_e2e(requests=a.e2e_requests or (32 if q else 64), progress=_progress)
        else:
            from bench.token_plane_e2e import run_burst

            sizes = [int(x) for x in (a.burst or ("2000" if q else "2000,5000")).split(",") if x]
            settings = [BURST_SETTINGS[0], BURST_SETTINGS[-1]] if q else BURST_SETTINGS
            from gateway.settings import GatewaySettings

            d = GatewaySettings()
            result = {"runs": burst_runs(sizes, a.burst_slots, run_burst, settings),
                      "defaults": [d.admission_max_backlog, d.max_open_streams]}
        doc["parts"][part] = {"command": command, "machine": machine_info(), "result": result,
                              "seconds": time.perf_counter() - t0, "code": code_version()}
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(doc, indent=1, default=_json_default))
        print(f"<-- {part} in {time.perf_counter() - t0:.0f}s", flush=True)
    return publish(doc, not a.no_write) or exit_code(doc)


BURST_SETTINGS = [(1024, 4096), (8192, 4096), (8192, 16384)]  # (admission_max_backlog, max_open_streams)


def burst_runs(sizes: list[int], slots: int, run_burst, settings=BURST_SETTINGS) -> list[dict]:
    """Each burst size under each (admission_max_backlog, max_open_streams) pair, passed to the
    gateway as TANDEM_GATEWAY_* variables (the backlog stays under the admission stream's MAXLEN
    of 10,000); the label says which pair is this checkout's default."""
    from gateway.settings import GatewaySettings

    d = GatewaySettings()
    runs = []
    for n in sizes:
        for backlog, open_streams in settings:
            env = {"TANDEM_GATEWAY_ADMISSION_MAX_BACKLOG": str(backlog),
                   "TANDEM_GATEWAY_MAX_OPEN_STREAMS": str(open_streams)}
            mine = (backlog, open_streams) == (d.admission_max_backlog, d.max_open_streams)
            label = f"backlog {backlog}, open streams {open_streams}{' (defaults)' if mine else ''}"
            runs.append(run_burst(n, label, env, slots=slots, progress=_progress))
    return runs


def _progress(msg: str) -> None:
    print(msg, flush=True)


def publish(doc: dict, write: bool) -> int:
    from bench.token_plane_report import report
    from gateway.settings import GatewaySettings

    d = GatewaySettings()
    doc = {**doc, "gateway_defaults": [d.admission_max_backlog, d.max_open_streams]}
    md = report(doc)
    print(md, flush=True)
    if write:
        write_section(SECTION, md)
        merge_summary(summary_keys(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
