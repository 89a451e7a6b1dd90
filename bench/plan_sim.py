"""Cluster simulator (issue 16): a static P:D split, a per-role HPA and the planner on one load trace.

    python bench/plan_sim.py [--quick] [--profile PATH] [--trace FILE.jsonl] [--peak-pods 40]
    python bench/plan_sim.py --validate      # the simulator against a real `tandem local` (bench/plan_validate.py)

The model (bench/plan_model.py) is Tandem's request path on a measured capacity profile
(planner/profiles/builtin-cpu.json by default, bench/capacity.py makes it): one shared admission
queue, prefill pods busy prefill_seconds(prompt) a prompt, a ready queue, decode pods with `slots`
slots whose step lasts decode_itl(batch), a hand-off between them; pods start `--startup-s` after
they are asked for and drain on scale-down. The trace (bench/plan_trace.py) is a synthetic day
compressed to `--hours` with bursts, scaled so that its peak (before bursts) needs `--peak-pods`
pods in all by the planner's own arithmetic, or a recorded JSON-lines trace (--trace). Policies
(bench/plan_policies.py), each on the same trace:
  * static       sized for the trace's mean rate and mean lengths (planner.decide's formulas);
  * static-peak  the same, for the busiest minute (bursts included): a reference for pod-hours;
  * hpa          one HPA per role on queue length (waiting + in service per pod; targets: 1 prompt
                 per prefill pod, max_utilization x the ITL-feasible batch per decode pod), 15 s
                 sync, 10% tolerance, 300 s scale-down stabilization;
  * planner      planner.decide.Planner every --interval-s.
Per policy: SLO attainment (TTFT <= target, 500 ms; the request's mean gap <= target, 10 ms; both),
TTFT and ITL percentiles, pod-hours per role, scale events. TTFT ends at the prefill pod's token 0
(--first-token prefill, what Tandem streams first and what --validate measured); --first-token
decode ends it at the first decode step. --cluster-scale makes the simulated pods dearer than the
profile the policies size with (a profile measured on the engine alone, as --validate found).
--kv-blocks N gives every decode pod a paged KV pool of N blocks (--kv-block-size, --kv-reserve-blocks,
--kv-rows; bench/plan_model.py says how it is modelled): the pods run only what their blocks hold,
the planner reads the capacity as it does the pods' heartbeats, and the static and HPA sizes count
it too (--no-kv-signal: the planner sizes decode by the ITL target alone). Plots under bench/plots/, the `plan_sim` section of
bench/RESULTS.md, `plan_sim_*` keys of bench/out/summary.json. Nothing here is asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import plan_trace
from bench.common import BENCH_DIR, machine_info, machine_line, markdown_table, merge_summary, pyplot, write_section
from bench.plan_model import ROLES, SimConfig, SimResult, simulate
from bench.plan_policies import HPAPolicy, PlannerPolicy, StaticPolicy, scaled, size_for
from planner.decide import PlanConfig, decode_batch
from planner.kv import KVCapacity
from planner.profile import Profile, load_profile
from planner.settings import RoleBounds, SLOConfig

SECTION = "plan_sim"
OUT = BENCH_DIR / "out"
PLOTS = BENCH_DIR / "plots"
COLORS = {"prefill": "tab:blue", "decode": "tab:orange"}
POLICY_COLORS = {"static": "tab:gray", "static-peak": "tab:brown", "hpa": "tab:red", "planner": "tab:green"}


# ---------------------------------------------------------------------------------------------
# the trace and the policies


def length_means(spec: plan_trace.TraceSpec, n: int = 200_000) -> tuple[float, float]:
    rng = np.random.default_rng(spec.seed + 1)
    p = plan_trace._lengths(rng, n, spec.prompt_median, spec.prompt_sigma, spec.prompt_bounds)
    o = plan_trace._lengths(rng, n, spec.output_median, spec.output_sigma, spec.output_bounds)
    return float(p.mean()), float(o.mean())


def rpm_for_pods(pods: int, prompt_mean: float, output_mean: float, profile: Profile, slo: SLOConfig) -> float:
    """The request rate (per minute) at which size_for needs `pods` pods in all (bisection)."""
    lo, hi = 0.0, 1.0
    while sum(size_for(hi, prompt_mean, output_mean, profile, slo).values()) < pods:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(size_for(mid, prompt_mean, output_mean, profile, slo).values()) < pods else (lo, mid)
    return hi * 60.0


def build_trace(args, profile: Profile, slo: SLOConfig) -> plan_trace.Trace:
    if args.trace:
        return plan_trace.read_jsonl(args.trace)
    top = max(p[0] for p in profile.prefill_points)  # no prompt past the profile's longest measured one
    spec = plan_trace.TraceSpec(duration_s=args.hours * 3600.0, prompt_median=min(args.prompt_median, top / 2),
                                prompt_bounds=(8, top), output_median=args.output_median, seed=args.seed)
    peak = args.peak_rpm or rpm_for_pods(args.peak_pods, *length_means(spec), profile, slo)
    spec = plan_trace.TraceSpec(**{**spec.__dict__, "peak_rpm": peak, "low_rpm": peak / 6.0})
    return plan_trace.synthetic(spec)


def kv_of(args, profile: Profile) -> KVCapacity | None:
    """Every simulated decode pod's KV (--kv-blocks; 0: not modelled)."""
    if args.kv_blocks <= 0:
        return None
    return KVCapacity("paged", rows=args.kv_rows or profile.slots, block_size=args.kv_block_size,
                      blocks_total=args.kv_blocks, reserve_blocks=args.kv_reserve_blocks)


def policies(trace: plan_trace.Trace, profile: Profile, slo: SLOConfig, args) -> list:
    pm, om = float(trace.prompt.mean()), float(trace.output.mean())
    mean_rate = len(trace) / max(trace.duration_s, 1.0)
    _, per_min = trace.rate_per_bin(60.0)
    _, first = trace.rate_per_bin(300.0)
    kv = kv_of(args, profile)
    peak = size_for(float(per_min.max()), pm, om, profile, slo, kv=kv)
    bounds = {r: RoleBounds(min_replicas=1, max_replicas=args.max_replicas or 2 * peak[r]) for r in ROLES}
    start = size_for(float(first[0]), pm, om, profile, slo, kv=kv)
    b = max(1, decode_batch(profile, slo, kv=kv, prompt_tokens=pm, output_tokens=om).size)
    hpa_targets = {"prefill": args.hpa_prefill_target, "decode": args.hpa_decode_target or 0.8 * b}
    cfg = PlanConfig(slo, bounds, max_utilization=0.8, scale_up_cooldown_s=args.up_cooldown_s,
                     scale_down_cooldown_s=args.down_cooldown_s)
    return [StaticPolicy(size_for(mean_rate, pm, om, profile, slo, kv=kv), name="static"),
            StaticPolicy(peak, name="static-peak"),
            HPAPolicy(hpa_targets, bounds, start),
            PlannerPolicy(profile, cfg, start, interval_s=args.interval_s, correction=not args.no_correction,
                          kv_signal=not args.no_kv_signal)]


# ---------------------------------------------------------------------------------------------
# summaries


def pct(x: np.ndarray, q) -> list[float]:
    x = x[~np.isnan(x)]
    return np.percentile(x, q).tolist() if len(x) else [math.nan] * len(q)


def summarize(res: SimResult, slo: SLOConfig) -> dict:
    ok_t = res.ttft <= slo.ttft_s
    ok_i = np.isnan(res.itl) | (res.itl <= slo.itl_s)  # a one-token request has no gap to miss
    ok_i &= ~np.isnan(res.finish)
    n = len(res.ttft)
    peaks = {r: int(res.series[f"alive_{r}"].max()) for r in ROLES}
    return {
        "requests": n, "unfinished": res.unfinished,
        "ttft_attain": float(ok_t.mean()), "itl_attain": float(ok_i.mean()), "both_attain": float((ok_t & ok_i).mean()),
        "ttft_s": dict(zip(("p50", "p90", "p99"), pct(res.ttft, [50, 90, 99]))),
        "itl_s": dict(zip(("p50", "p90", "p99"), pct(res.itl, [50, 90, 99]))),
        "pod_hours": {r: res.pod_hours(r) for r in ROLES},
        "scale_events": {r: sum(1 for e in res.scale_events if e[1] == r) for r in ROLES},
        "peak_pods": peaks, "sim_wall_s": res.wall_s, "events": res.events, "end_s": res.end_s,
    }


def planner_notes(log: list) -> dict:
    """How often the planner held, waited for a cooldown, or was capped, from its decisions."""
    out = {"decisions": len(log), "held": 0, "up_cooldown_waits": 0, "capped": 0, "early_no_down": 0}
    corr = [d.corrections for _, d in log if getattr(d, "corrections", None)]
    if corr:
        for i, role in enumerate(("prefill", "decode")):
            v = np.asarray([c[i] for c in corr])
            out[f"correction_{role}"] = {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}
    for _, d in log:
        out["held"] += bool(d.held)
        for note in d.notes:
            out["up_cooldown_waits"] += "scale-up cooldown" in note
            out["capped"] += "capped at max_replicas" in note
            out["early_no_down"] += "no scale-down in the first" in note
    return out


def binned(res: SimResult, bin_s: float, q: float = 90) -> tuple[np.ndarray, np.ndarray]:
    """(bin starts, the q-th percentile of TTFT of the requests arriving in each bin)."""
    edges = np.arange(0.0, res.arrival[-1] + bin_s, bin_s)
    idx = np.searchsorted(res.arrival, edges)
    vals = [np.nanpercentile(res.ttft[a:b], q) if b > a else math.nan for a, b in zip(idx[:-1], idx[1:])]
    return edges[:-1], np.asarray(vals)


# ---------------------------------------------------------------------------------------------
# plots




def plot_replicas(plt, trace, results: list[SimResult], out: Path) -> Path:
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.9 * len(results)), sharex=True)
    bins, rate = trace.rate_per_bin(60.0)
    for ax, res in zip(np.atleast_1d(axes), results):
        s = res.series
        for r in ROLES:
            ax.step(s["t"] / 3600, s[f"want_{r}"], where="post", color=COLORS[r], label=f"{r} asked")
            ax.step(s["t"] / 3600, s[f"ready_{r}"], where="post", color=COLORS[r], alpha=0.4, ls=":", label=f"{r} ready")
        ax.set_ylabel(f"{res.policy}\npods", fontsize=8)
        tw = ax.twinx()
        tw.plot(bins / 3600, rate * 60, color="black", alpha=0.25, lw=0.8)
        tw.set_ylabel("req/min", fontsize=7, color="gray")
        tw.tick_params(labelsize=7)
        ax.tick_params(labelsize=7)
    np.atleast_1d(axes)[0].legend(fontsize=6, ncol=4, loc="upper left")
    np.atleast_1d(axes)[-1].set_xlabel("hours")
    fig.suptitle("replicas per policy (solid: asked; dotted: serving) against the load (gray)", fontsize=9)
    fig.tight_layout()
    path = out / "plan_sim_replicas.png"
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def plot_ttft(plt, results: list[SimResult], slo: SLOConfig, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 3))
    for res in results:
        t, v = binned(res, 60.0)
        ax.plot(t / 3600, v, label=res.policy, color=POLICY_COLORS.get(res.policy), lw=0.9)
    ax.axhline(slo.ttft_s, color="black", ls="--", lw=0.8, label="TTFT target")
    ax.set_yscale("log")
    ax.set_xlabel("hours (request arrival)")
    ax.set_ylabel("TTFT p90 per minute (s)")
    ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    path = out / "plan_sim_ttft.png"
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# the report


def report(doc: dict) -> str:
    slo = doc["slo"]
    rows = []
    for name, s in doc["policies"].items():
        rows.append([name, f"{s['ttft_attain']:.1%}", f"{s['itl_attain']:.1%}", f"{s['both_attain']:.1%}",
                     *(s["ttft_s"][q] for q in ("p50", "p90", "p99")),
                     *(s["itl_s"][q] * 1e3 for q in ("p50", "p90", "p99")),
                     s["pod_hours"]["prefill"], s["pod_hours"]["decode"],
                     s["pod_hours"]["prefill"] + s["pod_hours"]["decode"],
                     f"{s['peak_pods']['prefill']}/{s['peak_pods']['decode']}",
                     f"{s['scale_events']['prefill']}/{s['scale_events']['decode']}", s["sim_wall_s"]])
    table = markdown_table(["policy", "TTFT ok", "ITL ok", "both", "TTFT p50 s", "p90", "p99", "ITL p50 ms", "p90",
                            "p99", "P pod-h", "D pod-h", "pod-h", "peak P/D", "scale ev P/D", "sim s"], rows)
    t, p = doc["trace"], doc["profile"]
    pn = doc.get("planner_notes", {})
    lines = [
        "## Cluster simulator: static vs HPA vs planner (issue 16)", "",
        f"`{doc['command']}`", "", f"Machine: {doc['machine_line']}", "",
        f"Trace: {t['name']}; {t['requests']:,} requests over {t['duration_s'] / 3600:.2f} h, mean "
        f"{t['mean_rpm']:,.0f} req/min, busiest minute {t['peak_minute_rpm']:,.0f} req/min, mean prompt "
        f"{t['prompt_mean']:.0f} / output {t['output_mean']:.0f} tokens.",
        f"Profile: `{p['source']}` ({p['slots']} slots, hand-off {p['handoff_s'] * 1e3:.1f} ms). SLO: TTFT "
        f"{slo['ttft_s']:g} s, ITL {slo['itl_s'] * 1e3:g} ms (per request; the planner sizes for the means). "
        f"Pods start {doc['sim']['startup_s']:g} s after they are asked for; first token: {doc['sim']['first_token']}"
        + (f"; the simulated pods cost more than the profile the policies size with (--cluster-scale "
           f"{doc['sim']['cluster_scale']})" if doc["sim"].get("cluster_scale") else "")
        + (f"; decode pods' KV: {kv['blocks_total']} blocks of {kv['block_size']} positions, {kv['rows']} rows, "
           f"{kv['reserve_blocks']} block(s) of reserve a row (the planner "
           f"{'reads it' if doc['sim'].get('kv_signal', True) else 'does not read it: ITL target alone'})."
           if (kv := doc["sim"].get("kv")) else "."),
        f"Static sized for the mean: {doc['sizes'].get('static')}; static-peak: {doc['sizes'].get('static-peak')}; HPA "
        f"targets (per pod) {doc['sizes'].get('hpa_targets')}; planner every {doc['sizes']['interval_s']:g} s, scale-up "
        f"cooldown {doc['sizes']['up_cooldown_s']:g} s, scale-down window {doc['sizes']['down_cooldown_s']:g} s; "
        "max_replicas per role 2x static-peak's.", "",
        table, "",
        f"Planner: {pn.get('decisions', 0)} decisions, {pn.get('held', 0)} held, {pn.get('up_cooldown_waits', 0)} "
        f"role-ticks waiting for the scale-up cooldown, {pn.get('capped', 0)} capped at max_replicas"
        + "".join(f"; {r} correction median {pn[f'correction_{r}']['median']:.2f} "
                  f"(range {pn[f'correction_{r}']['min']:.2f}-{pn[f'correction_{r}']['max']:.2f})"
                  for r in ("prefill", "decode") if f"correction_{r}" in pn) + ".", "",
        "![replicas](plots/plan_sim_replicas.png)", "", "![ttft](plots/plan_sim_ttft.png)",
    ]
    if doc.get("findings"):
        lines += ["", *doc["findings"]]
    return "\n".join(lines)


def _rel(path: str) -> str:
    p = Path(path)
    return str(p.relative_to(ROOT)) if p.is_absolute() and p.is_relative_to(ROOT) else path


def sizes(pols: list, args) -> dict:
    out = {"interval_s": args.interval_s, "up_cooldown_s": args.up_cooldown_s, "down_cooldown_s": args.down_cooldown_s}
    for p in pols:
        if isinstance(p, StaticPolicy):
            out[p.name] = p.replicas
        elif isinstance(p, HPAPolicy):
            out["hpa_targets"] = p.targets
    return out


def rerender(args) -> int:
    """--report-only: the section again from bench/out/plan_sim.json (with --findings); plots stay."""
    doc = json.loads((OUT / "plan_sim.json").read_text())
    if args.findings and Path(args.findings).exists():
        doc["findings"] = Path(args.findings).read_text().strip().splitlines()
    md = report(doc)
    print(md)
    if not args.no_write:
        write_section(SECTION, md)
    return 0


def run(args, argv: list[str]) -> int:
    machine = machine_line()  # its load average before the runs
    profile = load_profile(args.profile)
    slo = SLOConfig(ttft_s=args.ttft_slo_ms / 1e3, itl_s=args.itl_slo_ms / 1e3)
    t0 = time.perf_counter()
    trace = build_trace(args, profile, slo)
    print(f"trace: {trace.name}: {len(trace):,} requests ({time.perf_counter() - t0:.1f} s)", flush=True)
    cfg = SimConfig(startup_s=args.startup_s, first_token=args.first_token, kv=kv_of(args, profile),
                    tokens_per_step=args.tokens_per_step)
    pols = policies(trace, profile, slo, args)
    if args.policies:
        pols = [p for p in pols if p.name in args.policies.split(",")]
    cluster = profile  # what the simulated pods really cost; the policies size with `profile`
    if args.cluster_scale:
        k, a, c = (float(x) for x in args.cluster_scale.split(","))
        cluster = scaled(profile, prefill_mult=a, prefill_add_s=c / 1e3, decode_mult=k)
    results, summaries = [], {}
    for pol in pols:
        res = simulate(trace, cluster, pol, cfg)
        results.append(res)
        summaries[pol.name] = summarize(res, slo)
        s = summaries[pol.name]
        print(f"{pol.name:12s} both {s['both_attain']:.1%}  TTFT p99 {s['ttft_s']['p99']:.2f} s  pod-h "
              f"{sum(s['pod_hours'].values()):.1f}  ({res.wall_s:.1f} s, {res.events:,} events)", flush=True)
    _, per_min = trace.rate_per_bin(60.0)
    doc = {
        "command": " ".join(["python bench/plan_sim.py", *argv]), "machine": machine_info(),
        "machine_line": machine,
        "trace": {"name": trace.name, "requests": len(trace), "duration_s": trace.duration_s,
                  "mean_rpm": len(trace) / trace.duration_s * 60, "peak_minute_rpm": float(per_min.max() * 60),
                  "prompt_mean": float(trace.prompt.mean()), "output_mean": float(trace.output.mean())},
        "profile": {"source": _rel(profile.source), "slots": profile.slots, "handoff_s": profile.handoff_s},
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "sim": {"startup_s": cfg.startup_s, "first_token": cfg.first_token, "cluster_scale": args.cluster_scale,
                "kv": None if cfg.kv is None else {k: getattr(cfg.kv, k) for k in
                                                   ("rows", "block_size", "blocks_total", "reserve_blocks")},
                "kv_signal": not args.no_kv_signal},
        "sizes": sizes(pols, args), "policies": summaries,
        "planner_notes": planner_notes(next((p.log for p in pols if p.name == "planner"), [])),
    }
    if args.findings and Path(args.findings).exists():
        doc["findings"] = Path(args.findings).read_text().strip().splitlines()
    md = report(doc)
    print(md)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"plan_sim{'_' + args.tag if args.tag else ''}.json").write_text(json.dumps(doc, indent=2, default=float) + "\n")
    plt = pyplot() if not args.no_write else None
    if plt:
        PLOTS.mkdir(parents=True, exist_ok=True)
        plot_replicas(plt, trace, results, PLOTS)
        plot_ttft(plt, results, slo, PLOTS)
    if not args.no_write:
        write_section(SECTION, md)
        merge_summary({f"plan_sim_{k}_both_attain": v["both_attain"] for k, v in summaries.items()}
                      | {f"plan_sim_{k}_pod_hours": sum(v["pod_hours"].values()) for k, v in summaries.items()})
    return 0


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--validate", action="store_true", help="run bench/plan_validate.py (a real tandem local)")
    p.add_argument("--quick", action="store_true", help="a 1-hour day at 20 pods")
    p.add_argument("--profile", default="", help="capacity profile (default: planner/profiles/builtin-cpu.json)")
    p.add_argument("--trace", default="", help="a recorded trace, JSON lines {t, prompt_tokens, output_tokens}")
    p.add_argument("--hours", type=float, default=4.0, help="the synthetic day's length")
    p.add_argument("--peak-pods", type=int, default=40, help="pods the day's peak needs (sets its req/min)")
    p.add_argument("--peak-rpm", type=float, default=0.0, help="the day's peak req/min (instead of --peak-pods)")
    p.add_argument("--prompt-median", type=float, default=256)
    p.add_argument("--output-median", type=float, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo-ms", type=float, default=500.0)
    p.add_argument("--itl-slo-ms", type=float, default=10.0, help="per request, its mean gap")
    p.add_argument("--startup-s", type=float, default=60.0)
    p.add_argument("--first-token", choices=("prefill", "decode"), default="prefill",
                   help="prefill: TTFT ends at the prefill pod's token 0 (Tandem); decode: at the first decode step")
    p.add_argument("--tokens-per-step", type=float, default=1.0,
                   help="tokens a decode step gives each request (speculative decoding: its mean accepted length)")
    p.add_argument("--interval-s", type=float, default=30.0)
    p.add_argument("--up-cooldown-s", type=float, default=60.0)
    p.add_argument("--down-cooldown-s", type=float, default=300.0)
    p.add_argument("--max-replicas", type=int, default=0, help="per role (default: 2x static-peak's)")
    p.add_argument("--hpa-prefill-target", type=float, default=1.0)
    p.add_argument("--hpa-decode-target", type=float, default=0.0, help="default: 0.8 x the ITL-feasible batch")
    p.add_argument("--findings", default="", help="a text file whose lines end the RESULTS section")
    p.add_argument("--cluster-scale", default="", metavar="K,A,C_MS",
                   help="the simulated pods cost more than the profile the policies size with: decode step x K, "
                        "prefill x A + C ms (bench/plan_validate.py's fit)")
    p.add_argument("--no-correction", action="store_true", help="the planner without its correction factors")
    p.add_argument("--kv-blocks", type=int, default=0, help="every decode pod's paged KV pool, in blocks (0: not modelled)")
    p.add_argument("--kv-block-size", type=int, default=16, help="positions a block")
    p.add_argument("--kv-reserve-blocks", type=int, default=1, help="blocks kept free for every running row")
    p.add_argument("--kv-rows", type=int, default=0, help="a decode pod's rows (default: the profile's slots)")
    p.add_argument("--no-kv-signal", action="store_true", help="the planner sizes decode by the ITL target alone")
    p.add_argument("--policies", default="", help="comma-separated subset of static,static-peak,hpa,planner")
    p.add_argument("--report-only", action="store_true", help="re-render the section from bench/out/plan_sim.json")
    p.add_argument("--tag", default="", help="write bench/out/plan_sim_TAG.json")
    p.add_argument("--no-write", action="store_true", help="print only: no RESULTS section, summary keys or plots")
    args, rest = p.parse_known_args(argv)
    if args.quick:
        args.hours, args.peak_pods = min(args.hours, 1.0), min(args.peak_pods, 20)
    return args, rest


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parse(argv)
    if args.validate:
        from bench import plan_validate

        return plan_validate.main(argv)
    if rest:
        raise SystemExit(f"unknown arguments: {' '.join(rest)}")
    return rerender(args) if args.report_only else run(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
