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
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import BENCH_DIR, merge_summary
from bench.interleave_report import SYSTEMS, ratio, table, write_from


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
