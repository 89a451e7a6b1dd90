"""The decode step's CPU time, slot layout against paged KV, with the paged attention on Tandem's CPU
kernel and on the XLA gather path it replaces (`python bench/paged_step.py [--rounds N] [--write]`).

Three engines of the built-in model (max_len 1024, one XLA thread, as `tandem local` runs a decode
pod): `kv_layout="slots"`; `"paged"` (blocks of 16, the step's attention in
tandem_engine/cpu_kernels); `"paged"` with TANDEM_CPU_KERNELS=0 (the gather path,
paged.paged_attention). Each runs in its own process, one after the other, `--rounds` times
alternating, and measures bench/paged_capacity.py's `step_time`: every row of the batch inserted at
the same context, then 20 reserve-and-step calls, process CPU time per step (less sensitive than
wall time to other work on a shared machine). Every context runs once before the measured pass (settling). The
first version of this benchmark, without that pass, measured ~100 ms steps at context 256: the
paged step compiled again when a reserve rebuilt the block table mid-decode (an uncommitted array
beside a committed state: another jit cache key), which engine_decode._table_array now avoids. Reported
per batch and context: the best of the rounds, and paged / slots. Timings are reported, never
asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_line, markdown_table, merge_summary, write_section

SECTION = "paged_step"
BATCHES = (8, 32)
CONTEXTS = (256, 512, 1000)
SYSTEMS = {"slots": ("slots", "1"), "paged, kernel": ("paged", "1"), "paged, gather": ("paged", "0")}


def measure(layout: str) -> dict[str, float]:
    """In this process: CPU ms per step for every batch and context."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    from bench.paged_capacity import step_time
    from tandem_engine import load_engine

    out = {}
    for batch in BATCHES:
        kw: dict = {"kv_layout": layout}
        if layout == "paged":
            kw.update(kv_block_size=16, kv_blocks=batch * 1024 // 16)
        engine = load_engine("builtin", slots=batch, max_len=1024, cpu_threads=1, **kw)
        for ctx in CONTEXTS:  # a first pass: settles every context's inserts and steps
            step_time(engine, batch, ctx, 3)
        for ctx in CONTEXTS:
            out[f"{batch}/{ctx}"] = step_time(engine, batch, ctx, 20) * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--write", action="store_true", help="write bench/RESULTS.md and summary.json")
    p.add_argument("--child", choices=("slots", "paged"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.child)))
        return
    best: dict[str, dict[str, float]] = {name: {} for name in SYSTEMS}
    for r in range(a.rounds):
        for name, (layout, kernels) in SYSTEMS.items():
            env = dict(os.environ, TANDEM_CPU_KERNELS=kernels)
            done = subprocess.run([sys.executable, __file__, "--child", layout], env=env, capture_output=True,
                                  text=True, check=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in got.items()), flush=True)
            for k, v in got.items():
                best[name][k] = min(v, best[name].get(k, v))
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            key = f"{batch}/{ctx}"
            s, k, g = (best[n][key] for n in SYSTEMS)
            rows.append([batch, ctx, f"{s:.2f}", f"{k:.2f}", f"{g:.2f}", f"{k / s:.2f}", f"{g / s:.2f}"])
    table = markdown_table(["batch", "context", "slots ms", "paged, kernel ms", "paged, gather ms",
                            "kernel / slots", "gather / slots"], rows)
    body = (f"## Paged decode step on a CPU: Tandem's kernel, the gather path, the slot layout\n\n"
            f"`python bench/paged_step.py --rounds {a.rounds} --write` on {machine_line()}. Built-in model, "
            f"max_len 1024, one XLA thread; process CPU ms per step, best of {a.rounds} alternating rounds "
            f"(each system in its own process).\n\n{table}\n")
    print(body)
    if a.write:
        write_section(SECTION, body)
        worst = max(best["paged, kernel"][k] / best["slots"][k] for k in best["slots"])
        merge_summary({"paged_step_kernel_over_slots_worst": round(worst, 3)})


if __name__ == "__main__":
    main()
