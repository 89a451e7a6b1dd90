"""Interleaving benchmark (issue 4): does disaggregation keep inter-token latency flat while long
prompts arrive in bursts?

    python bench/interleave.py [--quick] [--fresh]

The measurement is the `burst` workload of bench/serve.py run on its two Tandem systems: decode
pinned to CPU 1 in both; the prefill pod on CPU 0 (disaggregated, direct prefill off) or none
(colocated: the decode pod prefills between steps). A steady Poisson stream of short chat-like
requests, plus every few seconds a burst of long prompts. For each system, same run:
  * inter-token latency p50/p99 of the short requests (all of them, and only the gaps that end
    while a long prompt is in flight: "under burst");
  * output tokens/s of everything;
  * the fraction of decode steps delayed by a prefill, measured from the client's side: a step is
    a gap between two consecutive tokens of one short request, and it counts as delayed when it is
    longer than 3x the median gap of the same system in the same run (a decode step that had a
    prefill, or anything else, in its way). No service is instrumented for it.
When bench/serve.py has just run (bench/out/serve.json younger than --max-age-s holding both
systems' burst runs) this reuses those timings instead of starting the clusters again; --fresh
measures anyway. Writes its section of bench/RESULTS.md and `itl_p99_disagg_over_colocated`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import BENCH_DIR, fmt, machine_line, markdown_table, merge_summary, write_section
from bench.loadgen import RequestResult, delayed_step_fraction, pcts, summarize

SECTION = "interleave"
DELAY_FACTOR = 3.0
SYSTEMS = ("disagg", "colocated")


def burst_windows(results: Sequence[RequestResult]) -> list[tuple[float, float]]:
    """[sent, last token] of every long request: the spans during which a long prompt is in flight."""
    return [(r.sent_s, r.sent_s + (r.e2e_s if r.ok else r.ttft_s or 0.0)) for r in results
            if r.kind == "long" and r.ok]


def gaps_under_burst(results: Sequence[RequestResult]) -> list[float]:
    """Short requests' inter-token gaps that end inside a burst window."""
    wins = burst_windows(results)
    out = []
    for r in results:
        if r.kind != "short" or not r.ok:
            continue
        for gap, t in zip(r.itl_s, r.token_s[1:]):
            if any(a <= t <= b for a, b in wins):
                out.append(gap)
    return out


def burst_summary(results: Sequence[RequestResult], wall_s: float, slo: tuple[float, float]) -> dict:
    return {
        "short": summarize(results, wall_s, *slo, kinds=("short",)),
        "long": summarize(results, wall_s, *slo, kinds=("long",)),
        "all": summarize(results, wall_s, *slo),
        "itl_under_burst_s": pcts(gaps_under_burst(results)),
        "delayed_step_fraction": delayed_step_fraction(results, DELAY_FACTOR),
    }


def table(systems: dict) -> str:
    rows = []
    for name in SYSTEMS:
        b = systems.get(name, {}).get("burst")
        if not b:
            rows.append([name, systems.get(name, {}).get("reason", "not run")] + [None] * 8)
            continue
        sh = b["short"]
        rows.append([name, "ok", sh["itl_s"]["p50"] * 1e3, sh["itl_s"]["p99"] * 1e3,
                     b["itl_under_burst_s"]["p99"] * 1e3, b["all"]["output_tokens_per_s"],
                     b["delayed_step_fraction"], sh["ttft_s"]["p99"] * 1e3, b["long"]["ttft_s"]["p50"] * 1e3,
                     b["all"]["errors"]])
    return markdown_table(["system", "status", "ITL p50 ms", "ITL p99 ms", "ITL p99 under burst ms",
                           "out tok/s", "delayed steps", "short TTFT p99 ms", "long TTFT p50 ms", "errors"], rows)


def ratio(systems: dict, key: str = "itl_under_burst_s") -> float | None:
    """p99 ITL disaggregated / colocated: of the gaps under bursts (default), or of all the short
    requests' gaps (key="short")."""
    try:
        if key == "short":
            a, b = (systems[n]["burst"]["short"]["itl_s"]["p99"] for n in SYSTEMS)
        else:
            a, b = (systems[n]["burst"][key]["p99"] for n in SYSTEMS)
    except (KeyError, TypeError):
        return None
    return a / b if b and not math.isnan(a) and not math.isnan(b) else None


def write_from(doc: dict, raw_dir: Path, plots: list[str], how: str = "") -> None:
    """The interleave section of RESULTS.md from a bench/serve.py document."""
    plan, systems = doc["plan"], doc["systems"]
    size, every, plen, olen = plan["burst"]
    r = ratio(systems)
    body = "\n".join([
        "## Interleaving: disaggregated vs colocated under long-prompt bursts", "",
        f"Measured by `python bench/serve.py {' '.join(doc['argv'])}` (its `burst` workload) {how}on "
        f"{machine_line(doc['machine'])}. Model `{plan['model']}`, {plan['slots']} slots. Decode pod on CPU 1 "
        "in both systems; disaggregated: prefill pod on CPU 0 with the gateway, Redis and the client, and "
        "`TANDEM_GATEWAY_DIRECT_PREFILL_MAX_TOKENS=0` (every prompt prefilled on the prefill pod); "
        "colocated: the decode pod prefills between steps.",
        f"Load: Poisson {plan['burst_rate']:g} req/s of chat-like short requests for "
        f"{plan['burst_duration_s']:g} s, plus every {every:g} s a burst of {size} prompts of {plen} tokens "
        f"({olen} output tokens each). ITL columns are the short requests' gaps; \"under burst\" keeps the "
        "gaps that end while a long request is in flight; \"delayed steps\" is the fraction of short "
        f"requests' gaps longer than {DELAY_FACTOR:g}x the median gap of the same system in the same run.", "",
        table(systems), "",
        f"`itl_p99_disagg_over_colocated` (p99 of the gaps under bursts) = {fmt(r)} (target <= 0.5); "
        f"over all the short requests' gaps: {fmt(ratio(systems, 'short'))}. In the disaggregated system every "
        "request's first gap (token 0 from the prefill pod -> token 1 from the decode pod) carries the "
        "hand-off: ready-notice claim, KV pull, insert.", "",
        *(f"![{Path(p).stem}](plots/{Path(p).name})" for p in plots if "interleave" in p),
    ])
    write_section(SECTION, body)


def _fresh_doc(max_age_s: float) -> dict | None:
    path = BENCH_DIR / "out" / "serve.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if time.time() - doc.get("finished", 0) > max_age_s:
        return None
    if not all(doc["systems"].get(n, {}).get("burst") for n in SYSTEMS):
        return None
    return doc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--fresh", action="store_true", help="measure even if bench/serve.py just did")
    p.add_argument("--max-age-s", type=float, default=3600.0)
    p.add_argument("--model", default="builtin")
    a = p.parse_args(argv)
    doc = None if a.fresh else _fresh_doc(a.max_age_s)
    how = "(reused by `bench/interleave.py`) " if doc else ""
    if doc is None:
        doc = measure(a.quick, a.model, argv)
    else:
        print("reusing the burst runs of bench/out/serve.json", flush=True)
    raw = BENCH_DIR / "out" / "serve"
    plots = [str(p) for p in (BENCH_DIR / "plots").glob("interleave*.png")]
    print(table(doc["systems"]), flush=True)
    write_from(doc, raw, plots, how)
    merge_summary({"itl_p99_disagg_over_colocated": ratio(doc["systems"]),
                   "itl_p99_all_gaps_disagg_over_colocated": ratio(doc["systems"], "short")})
    return 0


def measure(quick: bool, model: str, argv: list[str]) -> dict:
    """Run the burst workload on the two Tandem systems (bench/serve.py's machinery)."""
    import os
    from dataclasses import asdict

    from bench import serve, serve_plots
    from bench.common import machine_info
    from tandem_core.models import resolve_model

    plan = serve.Plan.quick(model=model) if quick else serve.Plan(model=model)
    plan.systems = list(SYSTEMS)
    os.sched_setaffinity(0, serve.CLIENT_CPUS)
    wl = serve.workloads(plan, resolve_model(model).vocab_size)
    systems = {}
    for name in SYSTEMS:
        run = serve.run_system(name, plan, wl, only=("burst",))
        serve.save_raw(f"interleave_{name}", run)
        systems[name] = serve.summarize_system(run, plan)
    doc = {"plan": asdict(plan), "machine": machine_info(), "systems": systems,
           "argv": ["(bench/interleave.py)", *argv], "finished": time.time()}
    serve_plots.interleave_plot(BENCH_DIR / "out" / "serve", BENCH_DIR / "plots", prefix="interleave_")
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
