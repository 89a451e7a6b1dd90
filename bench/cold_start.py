"""What do the first requests to a freshly started cluster wait for (issue 41, startup)?

`tandem local --slots 32` starts with an empty JAX compilation cache (a fresh XDG_CACHE_HOME), and
as soon as it says it is serving, 32 requests arrive at concurrency 8 (chat-like prompt lengths,
so several length buckets are batched by the prefill pod): their TTFT p50 / p90 / max. Then the
same cluster is started again over the now warm cache and measured the same way. Reported beside
the time from start to serving. `--old-root DIR` runs an older checkout the same way, alternated,
so old and new code are compared back to back.

    python bench/cold_start.py [--quick] [--old-root DIR] [--no-write]
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine_line, markdown_table, merge_summary, write_section
from bench.loadgen import make_workload, pcts, run_load
from bench.systems import TandemLocal


def one_run(name: str, root: Path, cache: Path, n: int, concurrency: int, slots: int, log_dir: Path) -> dict:
    sys_ = TandemLocal(name, "builtin", colocated=False, slots=slots, max_len=1024, pin="",
                       env={"XDG_CACHE_HOME": str(cache)}, log_path=log_dir / f"{name}.log", root=root,
                       ready_timeout=600)
    t0 = time.monotonic()
    sys_.start(settle=False)  # start to serving: the prefill pod's batched compiles run on after it
    ready_s = time.monotonic() - t0
    try:
        specs = make_workload(seed=3, n=n, rate=0.0, lengths="chat", vocab=2048)
        results, wall = asyncio.run(run_load(sys_.base_url, "builtin", specs, concurrency=concurrency))
    finally:
        sys_.stop()
    ok = [r for r in results if not r.error]
    ttft = pcts([r.ttft_s * 1e3 for r in ok], (50, 90, 100))
    return {"ready_s": ready_s, "ttft": ttft, "errors": len(results) - len(ok)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the same run (it is short already)")
    p.add_argument("--old-root", default="")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    systems = [("new", ROOT)] + ([("old", Path(args.old_root).resolve())] if args.old_root else [])
    rows, summary = [], {}
    work = Path(tempfile.mkdtemp(prefix="tandem-cold-"))
    try:
        for name, root in systems:
            cache = work / f"cache-{name}"
            for phase in ("cold", "warm"):
                got = one_run(f"{name}-{phase}", root, cache, args.requests, args.concurrency, args.slots, work)
                t = got["ttft"]
                rows.append([name, phase, f"{got['ready_s']:.1f}", f"{t['p50']:.0f}", f"{t['p90']:.0f}",
                             f"{t['p100']:.0f}", got["errors"]])
                summary[f"cold_start_{name}_{phase}_ttft_p90_ms"] = t["p90"]
                print(rows[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = markdown_table(["code", "compile cache", "start to serving s", "TTFT p50 ms", "TTFT p90 ms",
                            "TTFT max ms", "errors"], rows)
    body = (f"`python bench/cold_start.py{' --old-root ' + args.old_root if args.old_root else ''}` — "
            f"{machine_line()}; `tandem local --slots {args.slots}` (built-in model, disaggregated), "
            f"{args.requests} requests at concurrency {args.concurrency} as soon as it serves, chat-like lengths; "
            f"cold: an empty JAX compilation cache, warm: the same cluster started again over it.\n\n{table}\n")
    print(body)
    if not args.no_write:
        write_section("cold_start", body)
        merge_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
