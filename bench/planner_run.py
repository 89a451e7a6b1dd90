"""The planner's decisions on a recorded load (issue 16): `tandem local --planner` (mode local:
the launcher starts and drains workers to follow it) driven by a load whose rate steps up and
down, every decision read back from the planner's /decision and the workers counted from the
gateway's /admin/cluster.

    python bench/planner_run.py [--quick] [--phases RATE:SECONDS,...] [--profile PATH]

The load is an open-loop Poisson stream per phase (bench/loadgen.py, token-id prompts with
log-normal lengths); its arrivals and lengths are saved as a trace (bench/out/planner_trace.jsonl:
one {"arrival_s", "prompt_tokens", "output_tokens"} per line) that bench/plan_sim.py can replay.
Writes bench/RESULTS.md's `planner-run` section (the decision table), bench/out/planner_run.json
and a plot of replicas against the load. The machine is 2 cores: workers the planner adds share
them, so this shows decisions and drains, not capacity gained.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import BENCH_DIR, fmt, machine_line, markdown_table, pyplot, write_section
from bench.loadgen import RequestSpec, chat_lengths, pcts, run_load
from bench.systems import TandemLocal, model_id, warm_up
from tandem.redis_proc import free_port

SECTION = "planner-run"
OUT = BENCH_DIR / "out"


class PlannedLocal(TandemLocal):
    """`tandem local --planner` starting at 1 prefill + 1 decode worker."""

    def __init__(self, planner_port: int, interval_s: float, max_workers: int, **kw) -> None:
        super().__init__("planned", "builtin", colocated=False, pin="", **kw)
        self.planner_port, self.interval_s, self.max_workers = planner_port, interval_s, max_workers

    def command(self) -> list[str]:
        return [*super().command(), "--planner", "--planner-port", str(self.planner_port),
                "--planner-interval", str(self.interval_s), "--planner-max", str(self.max_workers)]


def phases_of(spec: str) -> list[tuple[float, float]]:
    out = []
    for item in filter(None, spec.split(",")):
        rate, _, secs = item.partition(":")
        try:
            out.append((float(rate), float(secs)))
        except ValueError:
            raise SystemExit(f"--phases: {item!r} is not RATE:SECONDS (e.g. 2:40)") from None
    return out


def workload(phases: list[tuple[float, float]], seed: int, prompt_median: int, output_median: int,
             vocab: int) -> list[RequestSpec]:
    """Poisson arrivals at each phase's rate for its seconds, one after another."""
    rng = np.random.default_rng(seed)
    arrivals, t0 = [], 0.0
    for rate, secs in phases:
        t = t0 + rng.exponential(1.0 / rate)
        while t < t0 + secs:
            arrivals.append(t)
            t += rng.exponential(1.0 / rate)
        t0 += secs
    lens = chat_lengths(rng, len(arrivals), prompt_median, output_median, max_prompt=440, max_output=64)
    return [RequestSpec(a, p, o, "short", rng.integers(3, vocab, p).tolist()) for a, (p, o) in zip(arrivals, lens)]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def sample_workers(base: str, stop: threading.Event, out: list, t0: float) -> None:
    while not stop.is_set():
        try:
            ws = _get(base + "/admin/cluster")["workers"]
            out.append((time.monotonic() - t0, sum(1 for w in ws if w["role"] == "prefill" and not w["draining"]),
                        sum(1 for w in ws if w["role"] == "decode" and not w["draining"])))
        except OSError:
            pass
        stop.wait(1.0)


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def decision_rows(history: list[dict], t_start_wall: float) -> list[list]:
    rows = []
    for h in history:
        f, o = h.get("forecast") or {}, h.get("observed") or {}
        rate = o["arrivals"] / o["interval_s"] if o else None
        ttft = o.get("ttft_mean_s")
        needed = h["needed"]
        rows.append([_f(h["wall_time"] - t_start_wall, ".0f"), _f(rate, ".2f"), _f(o.get("prompt_tokens_mean"), ".0f"),
                     _f(f.get("rate"), ".2f"), _f(f.get("margin"), ".2f"),
                     "-" if needed["prefill"] is None else f"{needed['prefill']}/{needed['decode']}",
                     f"{h['desired']['prefill']}/{h['desired']['decode']}",
                     f"{h['current']['prefill']}/{h['current']['decode']}",
                     _f(None if ttft is None else ttft * 1000, ".0f"),
                     "-" if not h.get("corrections") else f"{h['corrections']['prefill']:.2f}/{h['corrections']['decode']:.2f}",
                     (h["held"] or "; ".join(h["notes"]))[:70] or "-"])
    return rows


def plot(history: list[dict], workers: list, t_start_wall: float, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 3.6))
    t = [h["wall_time"] - t_start_wall for h in history]
    ax.step(t, [h["desired"]["prefill"] for h in history], where="post", label="planner: prefill")
    ax.step(t, [h["desired"]["decode"] for h in history], where="post", label="planner: decode", linestyle="--")
    if workers:
        ax.plot([w[0] for w in workers], [w[1] for w in workers], ".", ms=3, label="prefill workers up")
        ax.plot([w[0] for w in workers], [w[2] for w in workers], "x", ms=3, label="decode workers up")
    ax2 = ax.twinx()
    rates = [((h.get("observed") or {}).get("arrivals", 0) / (h.get("observed") or {}).get("interval_s", 1)) for h in history]
    ax2.plot(t, rates, color="grey", alpha=0.6, label="arrival rate")
    ax2.set_ylabel("requests/s")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="phases 1:30,6:60,1:60 and a 5 s interval")
    p.add_argument("--phases", default="", help="RATE:SECONDS,... of the load (default 1:40,6:90,1:90)")
    p.add_argument("--profile", default="", help="capacity profile (default: the built-in model's)")
    p.add_argument("--interval-s", type=float, default=5.0, help="the planner's interval")
    p.add_argument("--max-workers", type=int, default=3)
    p.add_argument("--ttft-s", type=float, default=1.0)
    p.add_argument("--itl-s", type=float, default=0.05)
    p.add_argument("--prompt-median", type=int, default=200)
    p.add_argument("--output-median", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--correction", action="store_true",
                   help="correct the profile by the pods' measured speed (planner/correct.py; tandem local turns it off: "
                   "its workers share the cores)")
    a = p.parse_args(argv)
    phases = phases_of(a.phases or ("1:30,6:60,1:60" if a.quick else "1:40,6:90,1:90"))
    env = {"TANDEM_PLANNER_SLO__TTFT_S": str(a.ttft_s), "TANDEM_PLANNER_SLO__ITL_S": str(a.itl_s),
           "TANDEM_PLANNER_SCALE_UP_COOLDOWN_S": "0", "TANDEM_PLANNER_SCALE_DOWN_COOLDOWN_S": "30",
           "TANDEM_GATEWAY_DIRECT_PREFILL_MAX_TOKENS": "0"}
    env["TANDEM_PLANNER_CORRECTION"] = "true" if a.correction else "false"
    if a.profile:
        env["TANDEM_PLANNER_PROFILE_PATH"] = str(Path(a.profile).resolve())
    OUT.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = PlannedLocal(port, a.interval_s, a.max_workers, slots=8, max_len=512, env=env,
                          log_path=OUT / "planner_run.log")
    print(f"starting tandem local --planner (phases {phases})", file=sys.stderr)
    server.start()
    try:
        model = model_id(server.base_url)
        specs = workload(phases, a.seed, a.prompt_median, a.output_median, vocab=256)
        asyncio.run(warm_up(server.base_url, model, specs[:8], 8, {}))
        stop, workers = threading.Event(), []
        t0, t_wall = time.monotonic(), time.time()
        sampler = threading.Thread(target=sample_workers, args=(server.base_url, stop, workers, t0), daemon=True)
        sampler.start()
        print(f"driving {len(specs)} requests over {sum(s for _, s in phases):.0f} s", file=sys.stderr)
        results, wall = asyncio.run(run_load(server.base_url, model, specs, timeout_s=300))
        time.sleep(a.interval_s * 2)
        stop.set()
        history = _get(f"http://127.0.0.1:{server.planner_port}/decision")["history"]
    finally:
        server.stop()
    with open(OUT / "planner_trace.jsonl", "w") as f:
        for s in specs:
            f.write(json.dumps({"arrival_s": round(s.arrival_s, 4), "prompt_tokens": s.prompt_len,
                                "output_tokens": s.output_len}) + "\n")
    history = [h for h in history if h["wall_time"] >= t_wall - 1 and h["desired"]]
    ok = [r for r in results if r.ok]
    doc = {"phases": phases, "history": history, "workers": workers, "errors": len(results) - len(ok),
           "requests": len(results), "ttft_ms": pcts([r.ttft_s * 1000 for r in ok]), "wall_s": wall}
    (OUT / "planner_run.json").write_text(json.dumps(doc, indent=1))
    plot(history, workers, t_wall, BENCH_DIR / "plots" / "planner_run.png")
    body = report(doc, a, t_wall, argv if argv is not None else sys.argv[1:])
    print(body)
    write_section(SECTION, body)
    return 0 if doc["errors"] == 0 else 1


def report(doc: dict, a, t_wall: float, argv: list[str]) -> str:
    rows = decision_rows(doc["history"], t_wall)
    heads = ["t s", "observed req/s", "prompt tok", "forecast req/s", "margin", "needed P/D", "desired P/D",
             "running P/D", "TTFT ms", "correction P/D", "held / notes"]
    ups = sum(1 for x, y in zip(doc["history"], doc["history"][1:]) if y["desired"] != x["desired"])
    return "\n".join([
        "## Planner on a recorded load (bench/planner_run.py)", "",
        f"Measured by `python bench/planner_run.py {' '.join(argv)}` on {machine_line()}. `tandem local --planner` "
        f"(built-in model, 8 slots, starting at 1 prefill + 1 decode worker, at most {a.max_workers} each; the launcher "
        f"starts workers and drains them with SIGTERM to follow the planner); planner every {a.interval_s:g} s, SLO TTFT "
        f"{a.ttft_s:g} s and ITL {a.itl_s:g} s, scale-down window 30 s, profile correction "
        f"{'on' if a.correction else 'off'}, direct prefill off. Load: Poisson phases "
        f"{', '.join(f'{r:g} req/s for {s:g} s' for r, s in doc['phases'])}; prompts log-normal around "
        f"{a.prompt_median} tokens, outputs around {a.output_median}. The trace is bench/out/planner_trace.jsonl.",
        "", f"{doc['requests']} requests, {doc['errors']} errors, TTFT p50/p90/p99 "
        f"{fmt(doc['ttft_ms']['p50'], 0)}/{fmt(doc['ttft_ms']['p90'], 0)}/{fmt(doc['ttft_ms']['p99'], 0)} ms; "
        f"{ups} changes of the desired replicas.", "",
        markdown_table(heads, rows), "", "![planner_run](plots/planner_run.png)",
    ])


if __name__ == "__main__":
    sys.exit(main())
