"""Run every benchmark in order (`make bench`, or `make bench QUICK=1` for --quick).

Each benchmark is a script that prints its table, writes its own section of bench/RESULTS.md and
merges its keys into bench/out/summary.json. Add new ones to BENCHMARKS. A failing benchmark is
reported and the rest still run; the exit status is non-zero if any failed.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
BENCHMARKS = [
    "engine.py",
    "step_roofline.py",  # the decode step vs its memory roofline at serving shapes, old vs new optional (issue 29)
    "families.py",  # every served family: decode at batch 8 and 32 vs the roofline, MoE vs dense (issue 28)
    "processing.py",  # penalties, bias and logprobs vs the plain decode step (issue 12)
    "constrained.py",  # grammar-constrained slots (0/50/100%) vs the plain decode step (issue 13)
    "kv_transfer.py",
    "serve.py",
    "interleave.py",  # reuses serve.py's burst runs of the same `make bench`
    "peer.py",  # vLLM CPU vs Tandem side by side, unpinned (issue 11)
    "burst.py",  # 16 prompts of 512 tokens at once: TTFT on both paths vs vLLM (issue 29)
    "prefix.py",  # multi-turn chats: Tandem prefix cache on/off vs vLLM with prefix caching (issue 14)
    "token_plane.py",  # the token plane alone, 10,000 streams, key placement, Redis cost per token (issue 15)
    "paged_capacity.py --write",  # paged KV vs fixed slots on one KV budget: sequences held, tok/s, step time (issue 30)
    "paged_step.py --write",  # the paged decode step on Tandem's CPU kernel and on the gather path vs the slot step (issue 43)
    "host_path.py",  # each role's host CPU per token (Python threads apart from native), the 256-slot projection (issue 29)
    "kv_capacity.py",  # fixed slots vs paged KV at one KV budget: sequences held, tok/s, KV bytes moved (issue 30)
    "decode_affinity.py",  # two paged decode pods: KV moved per conversation turn, decode routing on vs off (issue 30)
    "quantize_quality.py --kv --write",  # int8 weights and fp8 KV vs unquantized: greedy agreement, logit error, bytes (issue 30)
    "load.py",  # a checkpoint's load time against the cold read, peak RSS against its bytes, tp 1 and 2 (issue 41)
    "cold_start.py",  # TTFT of a fresh cluster's first requests, cold and warm compile cache (issue 41)
    "speculative.py",  # speculative decoding on against off, both paths, repeat and open workloads (issue 45)
    "spec_ceiling.py",  # what the repeat workload allows at one stream: lookup tokens a call, verify vs step cost (issue 45)
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument("--only", default="", help="comma-separated script names to run (default: all)")
    args = p.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    failed = []
    for entry in BENCHMARKS:
        script, *extra = entry.split()  # a script writes its section by default, or when given --write
        if only and script not in only and Path(script).stem not in only:
            continue
        cmd = [sys.executable, str(BENCH_DIR / script), *extra] + (["--quick"] if args.quick else [])
        print(f"==> {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=BENCH_DIR.parent)
        print(f"<== {script}: exit {rc} in {time.perf_counter() - t0:.0f}s", flush=True)
        if rc:
            failed.append(script)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
