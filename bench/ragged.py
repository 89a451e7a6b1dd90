"""A long prompt beside running decode rows: the engine's ragged call against the whole prefill
(`python bench/ragged.py [--rounds N] [--write]`).

What a colocated decode pod can do with a 512-token local prompt while 8 rows decode (issue 43):
- **whole**: `prefill` the prompt (its own forward), `insert` its KV into a row, then one step of
  the 9 rows: the decode loop's path for a prompt within `prefill_chunk_tokens` (the rows wait
  for the prefill);
- **ragged C**: `begin_prompt`, then `generate_ragged` calls over every slot until the call that
  ends the prompt: each carries the next C tokens of the prompt beside one step of the rows (the
  loop's `_seat` path, C = the engine's prefix_chunk), for C = 64 and 512.
Engines of the built-in model (max_len 1024, one XLA thread, 32 slots, as `tandem local` runs a
decode pod), one per C, each in its own process; `--rounds` alternating rounds; reported per path
the process CPU ms for the whole prompt (best of the rounds, median of 5 prompts in a round) and
the number of calls. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_line, markdown_table, merge_summary, write_section

SECTION = "ragged"
PROMPT = 512
ROWS = 8
CHUNKS = (64, 512)


def _cpu() -> float:
    return time.process_time()


def measure(chunk: int) -> dict[str, float]:
    """In this process: CPU ms of the whole path and of the ragged path at `chunk` for a
    PROMPT-token prompt beside ROWS decoding rows (median of 5 prompts after one to compile)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    from tandem_core.types import SamplingParams
    from tandem_engine import load_engine

    greedy = SamplingParams()
    rng = np.random.default_rng(0)
    engine = load_engine("builtin", slots=32, max_len=1024, cpu_threads=1, prefix_chunk=chunk,
                         prefill_buckets=(64, 128, 256, 512, 1024))
    state = engine.init_state()
    for slot in range(ROWS):
        state = engine.insert(engine.prefill(rng.integers(3, 2000, 100).tolist(), greedy), state, slot, greedy)
    seat = ROWS

    def ragged() -> tuple[float, int]:
        nonlocal state
        state = engine.begin_prompt(state, seat, rng.integers(3, 2000, PROMPT).tolist(), greedy)
        t0, calls = _cpu(), 0
        while True:
            state, out = engine.generate_ragged(state, None)
            calls += 1
            if out.slot is not None:
                np.asarray(out.first)
                break
        spent = _cpu() - t0
        state = engine.free(state, seat)
        return spent, calls

    def whole() -> tuple[float, int]:
        nonlocal state
        t0 = _cpu()
        prefix = engine.prefill(rng.integers(3, 2000, PROMPT).tolist(), greedy)
        state = engine.insert(prefix, state, seat, greedy)
        state, tokens = engine.generate(state, None)
        np.asarray(tokens)
        spent = _cpu() - t0
        state = engine.free(state, seat)
        jax.block_until_ready(state.active)
        return spent, 2

    out = {}
    for name, run in (("ragged", ragged), ("whole", whole)):
        run()  # compiles
        got = [run() for _ in range(5)]
        out[name] = statistics.median(t for t, _ in got) * 1e3
        out[f"{name} calls"] = got[0][1]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--write", action="store_true", help="write bench/RESULTS.md and summary.json")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.child)))
        return
    best: dict[int, dict[str, float]] = {c: {} for c in CHUNKS}
    for r in range(a.rounds):
        for c in CHUNKS:
            done = subprocess.run([sys.executable, __file__, "--child", str(c)], capture_output=True, text=True,
                                  check=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {r + 1} C={c}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
            for k, v in got.items():
                best[c][k] = min(v, best[c].get(k, v))
    whole = min(best[c]["whole"] for c in CHUNKS)
    rows = [["whole: prefill, insert, one step of the rows", 2, f"{whole:.1f}", "1.00"]]
    rows += [[f"ragged, chunks of {c}", int(best[c]["ragged calls"]), f"{best[c]['ragged']:.1f}",
              f"{best[c]['ragged'] / whole:.2f}"] for c in CHUNKS]
    table = markdown_table(["path", "calls", "CPU ms for the prompt", "/ whole"], rows)
    body = (f"## A long prompt beside decoding rows: the ragged call against a whole prefill (issue 43)\n\n"
            f"`python bench/ragged.py --rounds {a.rounds} --write` on {machine_line()}. Built-in model, max_len "
            f"1024, one XLA thread, 32 slots; a {PROMPT}-token prompt while {ROWS} rows decode; process CPU ms "
            f"from the first call to the prompt's first token on the host (median of 5 prompts, best of "
            f"{a.rounds} alternating rounds, each engine in its own process). The ragged calls also step the "
            f"rows once each (the whole path once).\n\n{table}\n")
    print(body)
    if a.write:
        write_section(SECTION, body)
        merge_summary({"ragged_512_over_whole": round(best[512]["ragged"] / whole, 3),
                       "ragged_64_over_whole": round(best[64]["ragged"] / whole, 3)})


if __name__ == "__main__":
    main()
