"""The simulator against a real cluster at small scale (issue 16): `python bench/plan_sim.py --validate`.

    python bench/plan_sim.py --validate [--rate 5] [--duration-s 75] [--lengths 32:16,128:32,256:64]
    python bench/plan_sim.py --validate --report-only    # re-render from bench/out/plan_validate.json

One short trace slice (Poisson arrivals at --rate for --duration-s, each request one of a few
(prompt, output) lengths, on prefill buckets so no prompt pays for a bucket it is not) runs twice:
  * measured: a real `tandem local --prefill 1 --decode 1 --slots 8` (bench/systems.TandemLocal,
    pinned as bench/serve.py's disagg: prefill=0, decode=1, gateway=0, redis=0, the direct-prefill
    shortcut off so every prompt is prefilled on the prefill pod; the client, bench/loadgen.py, on
    CPU 0), warmed up on every bucket and a full batch first, stopped by its PID after;
  * predicted: the same arrivals (the offsets the client really sent them at) through
    bench/plan_model.py with the measured profile and 1 prefill + 1 decode pod fixed, once per
    first-token definition: "decode" (TTFT to the first decode step, the simulator's default)
    and "prefill" (TTFT to the prefill pod's token 0: what Tandem streams first).
TTFT and each request's mean ITL ((end - first token) / (tokens - 1)) are compared: mean, p50,
p90 and predicted / measured. Writes bench/out/plan_validate.json, bench/plots/plan_sim_validate.png
and the `plan_sim_validate` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import plan_trace
from bench.common import BENCH_DIR, machine_line, markdown_table, pyplot, write_section
from bench.loadgen import CLIENT_NAME, RequestSpec, run_load
from bench.plan_model import SimConfig, simulate
from bench.plan_policies import StaticPolicy, scaled
from planner.profile import BUILTIN_PROFILE, load_profile

SECTION = "plan_sim_validate"
OUT = BENCH_DIR / "out"
PLOT = BENCH_DIR / "plots" / "plan_sim_validate.png"
PIN = "prefill=0,decode=1,gateway=0,redis=0"
ENV = {"TANDEM_GATEWAY_DIRECT_PREFILL_MAX_TOKENS": "0"}
MODES = ("decode", "prefill")


def parse_lengths(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        p, _, o = item.partition(":")
        out.append((int(p), int(o)))
    return out


def wait_for_profile(path: Path, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path}: no capacity profile after {wait_s:.0f} s (python bench/capacity.py makes it)")
        print(f"waiting for {path} ...", file=sys.stderr, flush=True)
        time.sleep(30)


GATEWAY_HISTOGRAMS = ("tandem_ttft_seconds", "tandem_queue_seconds", "tandem_itl_seconds")


def scrape(base_url: str) -> dict[str, tuple[float, float]]:
    """{histogram: (sum, count)} of the gateway's unlabelled latency histograms."""
    import urllib.request

    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    vals = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        vals[name] = value
    return {h: (float(vals.get(f"{h}_sum", "nan")), float(vals.get(f"{h}_count", "nan"))) for h in GATEWAY_HISTOGRAMS}


def server_side(before: dict, after: dict) -> dict[str, float]:
    """Mean of each gateway histogram over the measured load (seconds)."""
    out = {}
    for h in GATEWAY_HISTOGRAMS:
        ds, dc = after[h][0] - before[h][0], after[h][1] - before[h][1]
        out[h] = ds / dc if dc > 0 else math.nan
    return out


def measure(trace: plan_trace.Trace, slots: int, seed: int) -> tuple[list, float, dict]:
    """Run the slice against a real tandem local; (results, wall seconds, what the cluster and the
    machine said: the gateway's latency means, CPU per role, load average, the log's tail)."""
    from bench import proc_cpu
    from bench.systems import TandemLocal, model_id, warm_up
    from tandem_core.models import resolve_model

    vocab = resolve_model("builtin").vocab_size
    rng = np.random.default_rng(seed)
    specs = [RequestSpec(t, p, o, "short", rng.integers(3, vocab, p).tolist())
             for t, p, o in zip(trace.t.tolist(), trace.prompt.tolist(), trace.output.tolist())]
    server = TandemLocal("validate", "builtin", colocated=False, slots=slots, max_len=512, pin=PIN, env=ENV,
                         log_path=OUT / "plan_validate.log")
    os.sched_setaffinity(0, {0})
    server.start()
    try:
        model = model_id(server.base_url)
        asyncio.run(warm_up(server.base_url, model, specs, slots, {}))
        m0, c0, me0, load0 = scrape(server.base_url), proc_cpu.snapshot(server.proc.pid, "tandem"), os.times(), os.getloadavg()[0]
        results, wall = asyncio.run(run_load(server.base_url, model, specs, timeout_s=120))
        m1, c1, me1 = scrape(server.base_url), proc_cpu.snapshot(server.proc.pid, "tandem"), os.times()
    finally:
        server.stop()  # SIGTERM to the launcher's PID, SIGKILL after 30 s
    cpu = proc_cpu.cpu_ms_delta(c0, c1)
    cpu["client"] = (me1.user + me1.system - me0.user - me0.system) * 1000.0
    info = {"gateway_means_s": server_side(m0, m1), "cpu_core_fraction": {r: v / 1000.0 / wall for r, v in cpu.items()},
            "load_avg_1m": [load0, os.getloadavg()[0]], "log_tail": server.tail(5)}
    return results, wall, info


def predict(measured: list[dict], profile, mode: str) -> dict:
    """The measured requests' send offsets and lengths through the simulator (1 + 1 pods)."""
    order = sorted(range(len(measured)), key=lambda i: measured[i]["sent_s"])
    tr = plan_trace.Trace(np.asarray([measured[i]["sent_s"] for i in order]),
                          np.asarray([measured[i]["prompt_len"] for i in order], np.int64),
                          np.asarray([measured[i]["output_len"] for i in order], np.int64))
    res = simulate(tr, profile, StaticPolicy({"prefill": 1, "decode": 1}), SimConfig(startup_s=0.0, first_token=mode))
    ttft, itl = np.full(len(order), math.nan), np.full(len(order), math.nan)
    ttft[order], itl[order] = res.ttft, res.itl
    return {"ttft_s": ttft.tolist(), "itl_s": itl.tolist()}


def fit(doc: dict, profile) -> dict:
    """The per-pod costs that make the simulator ('prefill' mode) reproduce the measurement: the
    decode step factor k matching the mean gap (bisection), then a prefill pod busy a * s + c a
    prompt plus a latency d that occupies no pod (gateway, Redis hops, client) matching the
    quartiles of each request shape's TTFT (least squares of the log ratios on a grid). Fitted on
    the mean gap and the quartiles: if it also gets the tails (p90) right, the queueing model
    holds and the profile's per-pod costs are what is off."""
    m = doc["measured"]
    ok = [i for i, r in enumerate(m) if r["error"] is None and r["tokens_out"] > 1]
    want_gap = sum(m[i]["e2e_s"] - m[i]["ttft_s"] for i in ok) / sum(m[i]["tokens_out"] - 1 for i in ok)
    gap = lambda pr: sum(pr["itl_s"][i] * (m[i]["tokens_out"] - 1) for i in ok) / sum(m[i]["tokens_out"] - 1 for i in ok)  # noqa: E731
    lo, hi = 0.2, 20.0
    for _ in range(30):
        k = (lo * hi) ** 0.5
        lo, hi = (k, hi) if gap(predict(m, scaled(profile, decode_mult=k), "prefill")) < want_gap else (lo, k)
    k = (lo * hi) ** 0.5
    shapes = [[i for i in ok if (m[i]["prompt_len"], m[i]["output_len"]) == tuple(s)] for s in doc["lengths"]]
    shapes = [ix for ix in shapes if ix]
    qs = (25, 50, 75)
    want = np.concatenate([np.percentile([m[i]["ttft_s"] for i in ix], qs) for ix in shapes])
    best = (math.inf, 1.0, 0.0, 0.0)
    for a in np.linspace(1.0, 4.0, 13):
        for c in np.arange(0.0, 0.0801, 0.005):
            pr = predict(m, scaled(profile, a, c, k), "prefill")
            got = np.concatenate([np.percentile([pr["ttft_s"][i] for i in ix], qs) for ix in shapes])
            for d in np.arange(0.0, 0.0801, 0.005):
                err = float(np.sum(np.log((got + d) / want) ** 2))
                best = min(best, (err, float(a), float(c), float(d)))
    _, a, c, d = best
    pr = predict(m, scaled(profile, a, c, k), "prefill")
    pr["ttft_s"] = [x + d for x in pr["ttft_s"]]
    return {"prefill_mult": a, "prefill_add_s": c, "latency_s": d, "decode_mult": k, "predicted": pr}


def fitted_rows(doc: dict) -> list[list]:
    m, pr = doc["measured"], doc["fit"]["predicted"]
    ok = [i for i, r in enumerate(m) if r["error"] is None and r["tokens_out"] > 1]
    rows = []
    for name, meas, pred in (("TTFT", [m[i]["ttft_s"] for i in ok], [pr["ttft_s"][i] for i in ok]),
                             ("ITL (per-request mean)", [(m[i]["e2e_s"] - m[i]["ttft_s"]) / (m[i]["tokens_out"] - 1) for i in ok],
                              [pr["itl_s"][i] for i in ok])):
        a, b = stats(meas), stats(pred)
        rows += [[f"{name} {q}", a[q] * 1e3, b[q] * 1e3, b[q] / a[q]] for q in ("mean", "p50", "p90")]
    return rows


def stats(x) -> dict:
    x = np.asarray([v for v in x if v is not None and not math.isnan(v)])
    if not len(x):
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan}
    return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90))}


def compare(doc: dict) -> list[list]:
    ok = [i for i, r in enumerate(doc["measured"]) if r["error"] is None and r["tokens_out"] > 0]
    m = doc["measured"]
    got = {"ttft": stats(m[i]["ttft_s"] for i in ok),
           "itl": stats((m[i]["e2e_s"] - m[i]["ttft_s"]) / (m[i]["tokens_out"] - 1) for i in ok if m[i]["tokens_out"] > 1)}
    rows = []
    for metric, key in (("TTFT", "ttft_s"), ("ITL (per-request mean)", "itl_s")):
        short = "ttft" if key == "ttft_s" else "itl"
        pred = {mode: stats(doc["predicted"][mode][key][i] for i in ok) for mode in MODES}
        for q in ("mean", "p50", "p90"):
            meas = got[short][q]
            row = [f"{metric} {q}", meas * 1e3]
            for mode in MODES:
                row += [pred[mode][q] * 1e3, pred[mode][q] / meas if meas else math.nan]
            rows.append(row)
    return rows


def by_length(doc: dict, profile) -> list[list]:
    rows, m = [], doc["measured"]
    for p, o in doc["lengths"]:
        idx = [i for i, r in enumerate(m) if r["prompt_len"] == p and r["output_len"] == o and r["error"] is None]
        if not idx:
            continue
        meas = np.median([m[i]["ttft_s"] for i in idx])
        pred = {mode: np.median([doc["predicted"][mode]["ttft_s"][i] for i in idx]) for mode in MODES}
        itl = np.median([(m[i]["e2e_s"] - m[i]["ttft_s"]) / (m[i]["tokens_out"] - 1) for i in idx])
        pitl = np.median([doc["predicted"]["decode"]["itl_s"][i] for i in idx])
        rows.append([f"{p}:{o}", len(idx), profile.prefill_seconds(p) * 1e3, meas * 1e3, pred["prefill"] * 1e3,
                     pred["decode"] * 1e3, itl * 1e3, pitl * 1e3])
    return rows


def breakdown(doc: dict) -> list[list]:
    """Means (ms) of TTFT and of every gap, seen by the client, by the gateway, on the Redis clock,
    and predicted: where the measured time goes."""
    m = [r for r in doc["measured"] if r["error"] is None and r["tokens_out"] > 0]
    idx = [i for i, r in enumerate(doc["measured"]) if r["error"] is None and r["tokens_out"] > 0]
    g, pred = doc["gateway_means_s"], doc["predicted"]
    gaps = sum(r["tokens_out"] - 1 for r in m)
    client_gap = sum(r["e2e_s"] - r["ttft_s"] for r in m) / gaps
    def sim_gap(mode):
        return sum(pred[mode]["itl_s"][i] * (doc["measured"][i]["tokens_out"] - 1) for i in idx
                   if doc["measured"][i]["tokens_out"] > 1) / gaps
    def sim_ttft(mode):
        return float(np.mean([pred[mode]["ttft_s"][i] for i in idx]))
    return [["TTFT", float(np.mean([r["ttft_s"] for r in m])) * 1e3, g["tandem_ttft_seconds"] * 1e3,
             g["tandem_queue_seconds"] * 1e3, sim_ttft("prefill") * 1e3, sim_ttft("decode") * 1e3],
            ["gap between tokens", client_gap * 1e3, g["tandem_itl_seconds"] * 1e3, "-", sim_gap("prefill") * 1e3,
             sim_gap("decode") * 1e3]]


def report(doc: dict, profile) -> str:
    ok = sum(1 for r in doc["measured"] if r["error"] is None)
    head = ["", "measured ms", "sim (decode) ms", "sim/measured", "sim (prefill) ms", "sim/measured"]
    lines = [
        "## Cluster simulator validation: predicted vs measured at small scale (issue 16)", "",
        f"`{doc['command']}` ({doc['wall_s']:.0f} s of load). Machine: {doc['machine_line']}", "",
        f"Trace slice: {doc['trace']}; {len(doc['measured'])} requests, {ok} without error. Measured: `tandem local "
        f"--prefill 1 --decode 1 --slots {doc['slots']}` pinned `{PIN}`, direct-prefill shortcut off; client "
        f"{CLIENT_NAME} on CPU 0. Predicted: the same send offsets and lengths through bench/plan_model.py on "
        f"`{doc['profile']}` with 1 + 1 pods; 'decode' = TTFT to the first decode step (queue + prefill + hand-off "
        "+ one step), 'prefill' = TTFT to the prefill pod's token 0 (the hand-off falls in the first gap).", "",
        markdown_table(head, compare(doc)), "",
        "Median by request shape (profile prefill time, measured and predicted TTFT, measured and predicted "
        "per-request ITL):", "",
        markdown_table(["prompt:output", "n", "profile prefill ms", "TTFT measured", "sim (prefill)", "sim (decode)",
                        "ITL measured", "ITL sim"], by_length(doc, profile)), "",
        "![validation](plots/plan_sim_validate.png)",
    ]
    f = doc["fit"]
    lines[-1:-1] = [
        f"Fitted: with the profile's decode step x{f['decode_mult']:.2f} (matching the mean gap) and its "
        f"prefill x{f['prefill_mult']:.2f} + {f['prefill_add_s'] * 1e3:.0f} ms a prompt, plus {f['latency_s'] * 1e3:.0f} ms "
        "of latency that holds no pod (matching each shape's TTFT quartiles), "
        "the simulator ('prefill' first token) gives:", "",
        markdown_table(["", "measured ms", "sim (fitted) ms", "sim/measured"], fitted_rows(doc)), "",
    ]
    if "gateway_means_s" in doc:
        cpu = doc["cpu_core_fraction"]
        cpu0 = sum(v for k, v in cpu.items() if k in ("gateway", "prefill", "redis", "client", "launcher"))
        lines[-1:-1] = [
            "Where the measured time goes (means, ms): the client's view, the gateway's histograms "
            "(tandem_ttft_seconds: arrival at the gateway to the first token relayed; tandem_itl_seconds: "
            "gaps it relayed), the Redis clock (tandem_queue_seconds: admission XADD to first-token XADD, "
            "= queue + prefill) and the simulator:", "",
            markdown_table(["", "client", "gateway", "Redis clock", "sim (prefill)", "sim (decode)"], breakdown(doc)), "",
            "CPU during the load, in cores: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items()))
            + f"; CPU 0's processes (gateway, prefill, Redis, client, launcher) {cpu0:.2f} of its 1 core. "
            f"Load average {doc['load_avg_1m'][0]:.2f} at the start of the load, {doc['load_avg_1m'][1]:.2f} at its end.", "",
        ]
    if doc.get("findings"):
        lines += ["", *doc["findings"]]
    return "\n".join(lines)


def plot(doc: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    m = [r for r in doc["measured"] if r["error"] is None and r["tokens_out"] > 1]
    idx = [i for i, r in enumerate(doc["measured"]) if r["error"] is None and r["tokens_out"] > 1]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    series = {"ttft": ([r["ttft_s"] for r in m], "ttft_s"),
              "itl": ([(r["e2e_s"] - r["ttft_s"]) / (r["tokens_out"] - 1) for r in m], "itl_s")}
    for ax, (name, (meas, key)) in zip(axes, series.items()):
        for label, vals, c in (("measured", meas, "black"),
                               *((f"sim ({mode})", [doc["predicted"][mode][key][i] for i in idx], col)
                                 for mode, col in zip(MODES, ("tab:green", "tab:blue")))):
            v = np.sort(np.asarray(vals) * 1e3)
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label, color=c)
        ax.set_xlabel(f"{'TTFT' if name == 'ttft' else 'per-request mean ITL'} (ms)")
        ax.set_xscale("log")
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=72)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--validate", action="store_true")
    p.add_argument("--profile", default="")
    p.add_argument("--rate", type=float, default=5.0)
    p.add_argument("--duration-s", type=float, default=75.0)
    p.add_argument("--lengths", default="32:16,128:32,256:64")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-profile-s", type=float, default=2400.0)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--findings", default="", help="a text file whose lines end the RESULTS section")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    path = Path(a.profile) if a.profile else BUILTIN_PROFILE
    wait_for_profile(path, a.wait_profile_s)
    profile = load_profile(path)
    if a.report_only:
        doc = json.loads((OUT / "plan_validate.json").read_text())
    else:
        lengths = parse_lengths(a.lengths)
        trace = plan_trace.poisson_slice(a.rate, a.duration_s, lengths, a.seed)
        print(f"measuring {len(trace)} requests: {trace.name}", file=sys.stderr, flush=True)
        machine = machine_line()
        results, wall, info = measure(trace, a.slots, a.seed)
        doc = {"command": " ".join(["python bench/plan_sim.py", *(argv or [])]), "machine_line": machine,
               "trace": trace.name, "lengths": lengths, "slots": a.slots, "wall_s": wall, **info,
               "measured": [{k: v for k, v in r.to_dict().items() if k not in ("itl_s", "token_s")} for r in results]}
    doc["profile"] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    doc["predicted"] = {mode: predict(doc["measured"], profile, mode) for mode in MODES}
    doc["fit"] = fit(doc, profile)
    if a.findings and Path(a.findings).exists():
        doc["findings"] = Path(a.findings).read_text().strip().splitlines()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "plan_validate.json").write_text(json.dumps(doc, indent=1, default=float) + "\n")
    md = report(doc, profile)
    print(md)
    plot(doc)
    if not a.no_write:
        write_section(SECTION, md)
    return 0
