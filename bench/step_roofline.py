"""The decode step against its memory roofline, at the shapes Tandem serves (issue 29, item 1).

`python bench/step_roofline.py [--quick] [--baseline REF] [--threads N] [--model M]`

The built-in model (or --model), a 32-slot engine with the model's context as max_len (what
`tandem local` gives a decode pod), XLA's CPU pool at `--threads` (default: `tandem local`'s
--cpu-threads default, 1). For batch 8 and 32 (the row buckets a pod steps at 8 and 32 streams)
and every row inserted at position 64, 256, 512 and the last position of the context (the steps
timed advance it by a few dozen positions at most): ms per step (steps
dispatched back to back, one sync), the memory roofline (weights + KV in use / bandwidth, with
the bandwidth measured in this run with the same thread count), their ratio, and a compute floor
(the step's matmul FLOPs / the float32 FLOP/s measured with that thread count) so a reader sees
where a step is bound by arithmetic rather than by memory.

`--baseline REF`: the same measurements for the engine at git REF (exported to a temporary
directory), old and new workers alternating round by round in one run, each cell the best round
of each side, and new/old per cell. On a shared machine the absolute numbers move with the
load; the alternation is what makes the ratio fair. Timings are reported, never asserted.
Writes its section of bench/RESULTS.md and merges its keys into bench/out/summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a worker imports the engine of the tree on its PYTHONPATH (the baseline's, for --baseline)
if str(ROOT) not in sys.path and not os.environ.get("STEP_ROOFLINE_WORKER"):
    sys.path.insert(0, str(ROOT))

from bench.common import machine_info, machine_line, markdown_table, merge_summary, write_section
from bench.engine import decode_roofline_s, decode_weight_bytes, layer_matmul_params

SECTION = "step_roofline"
BATCHES = (8, 32)
SLOTS = 32
SERVING_THREADS = 1  # tandem/local.py: --cpu-threads default


def positions_for(context: int) -> list[int]:
    """64, 256, 512 (those inside the context) and the context's last position."""
    return sorted({p for p in (64, 256, 512) if p < context} | {context - 1})


def step_flops(info, batch: int, position: int) -> float:
    """Matmul FLOPs of one decode step: projections and LM head, and attention's scores and
    values over position + 1 rows."""
    proj = 2.0 * (layer_matmul_params(info) + info.hidden_size * info.vocab_size) * batch
    attn = 4.0 * info.num_layers * info.num_heads * info.head_dim * (position + 1) * batch
    return proj + attn


# ---------------------------------------------------------------------------------------------
# worker: one process, one engine tree (PYTHONPATH picks which), JSON on stdout


def worker(args) -> int:
    from tandem_engine import load_engine

    eng = load_engine(args.model, slots=SLOTS, max_len=args.max_len, cpu_threads=args.threads,
                      prefill_buckets=(64,))
    import jax

    if args.limits:
        from bench.engine import measure_bandwidth, measure_matmul

        bw = measure_bandwidth(nbytes=128 << 20)
        print(json.dumps({"bandwidth": max(bw.values()), **bw, "matmul_flops": measure_matmul(1024),
                          "read_bandwidth": measure_read_bandwidth(128 << 20)}))
        return 0
    import numpy as np

    from tandem_core.types import KVPayload, SamplingParams

    c = eng.cfg
    out = {}
    for batch in args.batches:
        for pos in args.positions:
            # `batch` rows inserted at `pos` positions (zero KV: what is timed is the step), so each
            # row holds the blocks of its context; the steps then advance them by reps x steps
            # positions at most (a row at the last position stays there)
            state = eng.init_state()
            kv = np.zeros((c.num_layers, pos, c.num_kv_heads, c.head_dim), np.float32)
            for row in range(batch):
                state = eng.insert_payload(KVPayload(k=kv, v=kv, true_length=pos, first_token=1), state, row,
                                           SamplingParams())
            for _ in range(2):  # compile and warm
                state, _short = eng.reserve(state, 1)
                state, toks = eng.generate(state, batch)
            jax.block_until_ready(toks)
            best = cpu = float("inf")
            for _ in range(args.reps):
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    state, _short = eng.reserve(state, 1)
                    state, toks = eng.generate(state, batch)
                jax.block_until_ready(toks)
                best = min(best, (time.perf_counter() - t0) / args.steps)
                cpu = min(cpu, (time.process_time() - c0) / args.steps)
            out[f"{batch}/{pos}"] = best
            out[f"{batch}/{pos}/cpu"] = cpu
    print(json.dumps(out))
    return 0


def measure_read_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes read per second by a jitted sum over `nbytes` (a read-only stream, what a decode
    step's weights and KV are; the roofline keeps the copy bandwidth, read + written bytes)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        total(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def run_worker(tree: Path, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu", STEP_ROOFLINE_WORKER="1")
    cmd = [sys.executable, str(ROOT / "bench" / "step_roofline.py"), "--worker", *extra]
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode:
        raise RuntimeError(f"worker in {tree} failed (exit {res.returncode}): {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def export_tree(ref: str, dest: Path) -> Path:
    """The repository at `ref` (git archive) under dest."""
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


# ---------------------------------------------------------------------------------------------
# report


def rows_for(info, results: dict, limits: dict, positions: list[int], baseline: dict | None,
             batches=BATCHES) -> list[list]:
    rows = []
    for batch in batches:
        for pos in positions:
            key = f"{batch}/{pos}"
            step, cpu = results[key], results[key + "/cpu"]
            roof = decode_roofline_s(info, batch, pos + 1, limits["bandwidth"])
            floor = step_flops(info, batch, pos) / limits["matmul_flops"]
            row = [batch, pos, step * 1e3, cpu * 1e3, roof * 1e3, step / roof, floor * 1e3]
            if baseline is not None:
                old, old_cpu = baseline[key], baseline[key + "/cpu"]
                row += [old * 1e3, old_cpu * 1e3, old / roof, old / step, old_cpu / cpu]
            rows.append(row)
    return rows


def report(info, rows, limits, command, plan, baseline_ref, threads, max_len) -> str:
    head = ["batch", "position", "step ms", "CPU ms / step", "mem roofline ms", "step / roofline",
            "compute floor ms"]
    if baseline_ref:
        head += [f"{baseline_ref} step ms", f"{baseline_ref} CPU ms", f"{baseline_ref} / roofline",
                 "speedup, wall", "speedup, CPU"]
    return "\n\n".join([
        "## Decode step vs its memory roofline, serving shapes (issue 29)",
        f"Command: `{command}`  \nMachine: {machine_line(limits['machine'])}  \nModel: {info.name} "
        f"({info.num_layers} layers, d={info.hidden_size}, vocab {info.vocab_size}), float32, "
        f"{SLOTS} slots, max_len {max_len}, XLA CPU pool of {threads} thread(s) (`tandem local`'s default).",
        f"Limits measured in this run with {threads} thread(s): memory bandwidth "
        f"{limits['bandwidth'] / 1e9:.1f} GB/s (best of numpy and XLA copy, read + written bytes), "
        f"matmul {limits['matmul_flops'] / 1e9:.1f} GFLOP/s (float32 1024^3 jnp.dot). Roofline: "
        f"(weights {decode_weight_bytes(info) / 1e6:.1f} MB + KV of position + 1 rows per slot) / "
        f"bandwidth. Compute floor: the step's matmul FLOPs / that rate (a step cannot beat it "
        f"either; where it is above 3x the roofline the 3x target is out of reach in float32)."
        + (f" A read-only stream (a jitted sum over 128 MB) reads {limits['read_bandwidth'] / 1e9:.1f} GB/s "
           f"with the same threads." if limits.get("read_bandwidth") else ""),
        markdown_table(head, rows),
        f"Every slot of the batch at the position; best of {plan['reps']} rounds of {plan['steps']} "
        f"steps dispatched back to back" + (f", {plan['rounds']} alternating old/new rounds" if baseline_ref else "")
        + ". CPU ms / step: the process's CPU time over the same steps (every XLA thread; less "
        "sensitive than wall time to other processes on a shared machine). The machine may be "
        "shared: absolute ms move with its load; the old/new ratio comes from runs interleaved in time.",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    p.add_argument("--model", default="builtin")
    p.add_argument("--threads", type=int, default=SERVING_THREADS, help="XLA CPU threads (tandem local: 1)")
    p.add_argument("--baseline", default="", metavar="REF", help="also measure the engine at git REF, alternating")
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md and summary.json")
    p.add_argument("--batches", type=lambda s: tuple(int(x) for x in s.split(",")), default=BATCHES,
                   help="row buckets to measure (default 8,32); a subset does not write RESULTS.md")
    p.add_argument("--at", type=lambda s: [int(x) for x in s.split(",")], default=None, metavar="POSITIONS",
                   help="positions to measure (default 64,256,512 and the context's last); "
                        "a subset does not write RESULTS.md")
    p.add_argument("--rounds", type=int, default=0, help="alternating old/new rounds (default 3, --quick 1)")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--limits", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-len", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--positions", type=lambda s: [int(x) for x in s.split(",")], default=[], help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    from tandem_core.models import resolve_model

    info = resolve_model(args.model)
    max_len = info.max_position_embeddings
    positions = args.at or positions_for(max_len)
    partial_run = args.at is not None or tuple(args.batches) != BATCHES
    plan = {"steps": 5 if args.quick else 10, "reps": 2 if args.quick else 3,
            "rounds": args.rounds or (1 if args.quick else 3)}
    common = ["--model", args.model, "--threads", str(args.threads), "--max-len", str(max_len)]
    work = common + ["--positions", ",".join(map(str, positions)), "--steps", str(plan["steps"]),
                     "--reps", str(plan["reps"]), "--batches", ",".join(map(str, args.batches))]
    limits = run_worker(ROOT, common + ["--limits"])
    limits["machine"] = machine_info()
    print(f"bandwidth {limits['bandwidth'] / 1e9:.1f} GB/s, matmul {limits['matmul_flops'] / 1e9:.1f} GFLOP/s "
          f"({args.threads} thread(s))", flush=True)
    new: dict = {}
    old: dict | None = {} if args.baseline else None
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = export_tree(args.baseline, Path(tmp) / "old") if args.baseline else None
        for r in range(plan["rounds"]):
            sides = [("new", ROOT, new)] + ([("old", old_tree, old)] if old_tree else [])
            if r % 2:
                sides.reverse()
            for name, tree, acc in sides:
                got = run_worker(tree, work)
                for k, v in got.items():
                    if v is not None:
                        acc[k] = min(acc.get(k, float("inf")), v)
                print(f"  round {r + 1} {name}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in got.items()
                                                              if v is not None and not k.endswith("/cpu")), flush=True)
    rows = rows_for(info, new, limits, positions, old, args.batches)
    command = "python bench/step_roofline.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))
    text = report(info, rows, limits, command, plan, args.baseline, args.threads, max_len)
    print("\n" + text)
    keys = {}
    for row in rows:
        batch, pos, ratio = row[0], row[1], row[5]
        keys[f"decode_step_b{batch}_p{pos}_over_mem_roofline"] = round(ratio, 3)
    keys["decode_step_worst_over_mem_roofline"] = round(max(r[5] for r in rows), 3)
    print("\nsummary:", keys)
    if not args.no_write and not partial_run:
        write_section(SECTION, text)
        merge_summary(keys)
    elif not args.no_write:
        print("(a subset of batches or positions: RESULTS.md and summary.json left as they are)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
