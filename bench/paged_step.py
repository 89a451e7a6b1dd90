"""The decode step's CPU time over the KV pool, its attention on Tandem's CPU kernel and on the XLA
gather path it replaces, and optionally against an older tree's slot layout
(`python bench/paged_step.py [--rounds N] [--old-root DIR] [--write]`).

Engines of the built-in model (max_len 1024, one XLA thread, as `tandem local` runs a decode pod):
the pool (blocks of 16, the step's attention in tandem_engine/cpu_kernels); the pool with
TANDEM_CPU_KERNELS=0 (the gather path, attention.paged_attention); with `--old-root`, that tree's
`kv_layout="slots"` (the slot layout, deleted by issue 43: a tree from before 43's deletion, e.g.
29e5fac). Each runs in its own process, one after the other, `--rounds` times
alternating, and measures bench/paged_capacity.py's `step_time`: every row of the batch inserted at
the same context, then 20 reserve-and-step calls, process CPU time per step (less sensitive than
wall time to other work on a shared machine). Every context runs once before the measured pass (settling). The
first version of this benchmark, without that pass, measured ~100 ms steps at context 256: the
paged step compiled again when a reserve rebuilt the block table mid-decode (an uncommitted array
beside a committed state: another jit cache key), which engine_decode._table_array now avoids. Reported
per batch and context: the best of the rounds, and the ratios. Timings are reported, never
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
SYSTEMS = {"kernel": ("paged", "1"), "gather": ("paged", "0")}
OLD = "slots (old tree)"


def measure(layout: str, root: str | None) -> dict[str, float]:
    """In this process: CPU ms per step for every batch and context; `root`: import that tree's
    engine (its slot layout)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if root:
        sys.path.insert(0, root)
        for name in [m for m in sys.modules if m == "bench" or m.startswith("bench.")]:
            del sys.modules[name]
    from bench.paged_capacity import step_time
    from tandem_engine import load_engine

    out = {}
    for batch in BATCHES:
        kw: dict = {"kv_layout": "slots"} if layout == "slots" else {"kv_block_size": 16, "kv_blocks": batch * 1024 // 16}
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
    p.add_argument("--old-root", help="a tree with the slot layout (before issue 43 deleted it): its slot step too")
    p.add_argument("--child", choices=("slots", "paged"), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="one round (`make bench QUICK=1`)")
    a = p.parse_args()
    if a.quick:
        a.rounds = 1
    if a.child:
        print(json.dumps(measure(a.child, a.root)))
        return
    systems = dict(SYSTEMS, **({OLD: ("slots", "1")} if a.old_root else {}))
    best: dict[str, dict[str, float]] = {name: {} for name in systems}
    for r in range(a.rounds):
        for name, (layout, kernels) in systems.items():
            env = dict(os.environ, TANDEM_CPU_KERNELS=kernels)
            root = ["--root", str(Path(a.old_root).resolve())] if name == OLD else []
            done = subprocess.run([sys.executable, __file__, "--child", layout, *root], env=env, capture_output=True,
                                  text=True, check=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in got.items()), flush=True)
            for k, v in got.items():
                best[name][k] = min(v, best[name].get(k, v))
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            key = f"{batch}/{ctx}"
            k, g = best["kernel"][key], best["gather"][key]
            row = [batch, ctx, f"{k:.2f}", f"{g:.2f}", f"{g / k:.2f}"]
            if a.old_root:
                s = best[OLD][key]
                row += [f"{s:.2f}", f"{k / s:.2f}"]
            rows.append(row)
    head = ["batch", "context", "kernel ms", "gather ms", "gather / kernel"]
    table = markdown_table(head + (["old slots ms", "kernel / old slots"] if a.old_root else []), rows)
    old = f" --old-root {a.old_root}" if a.old_root else ""
    also = ", an old tree's slot layout" if a.old_root else ""
    body = (f"## Decode step on a CPU: Tandem's kernel, the gather path{also}\n\n"
            f"`python bench/paged_step.py --rounds {a.rounds}{old} --write` on {machine_line()}. Built-in model, "
            f"max_len 1024, one XLA thread; process CPU ms per step, best of {a.rounds} alternating rounds "
            f"(each system in its own process).\n\n{table}\n")
    print(body)
    if a.write:
        write_section(SECTION, body)
        worst = max(best["kernel"][k] / best["gather"][k] for k in best["gather"])
        merge_summary({"paged_step_kernel_over_gather_worst": round(worst, 3)})


if __name__ == "__main__":
    main()
