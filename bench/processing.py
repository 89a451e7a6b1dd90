"""What per-slot logits processing costs a decode step: the plain step beside the same batch with
penalties and logit_bias on, with logprobs (top 5) on, and with half the slots doing both
(`python bench/processing.py [--quick]`).

Built-in model, every slot active, the step pipelined as the decode pod runs it. The cases run
alternately in short chunks and each ratio is the median of the per-chunk ratios to the plain
step run right beside it, so the machine's drift (it is shared) cancels. Writes its section of
bench/RESULTS.md. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_line, markdown_table, write_section
from tandem_core.types import SamplingParams

SECTION = "processing"
PROMPT_LEN = 64
PENALTIES = dict(presence_penalty=0.3, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias=((5, 2.0),))
CASES = {  # name -> (sampling of the odd slots, of the even slots)
    "plain (greedy)": (SamplingParams(), SamplingParams()),
    "penalties + bias, all slots": (SamplingParams(**PENALTIES), SamplingParams(**PENALTIES)),
    "logprobs top 5, all slots": (SamplingParams(logprobs=5), SamplingParams(logprobs=5)),
    "both, half the slots": (SamplingParams(logprobs=5, **PENALTIES), SamplingParams()),
}


def filled(engine, odd: SamplingParams, even: SamplingParams):
    ids = np.random.default_rng(0).integers(3, engine.info.vocab_size, PROMPT_LEN).tolist()
    state = engine.init_state()
    for slot in range(engine.slots):
        s = odd if slot % 2 else even
        state = engine.insert(engine.prefill(ids, s), state, slot, s, history=ids)
    return state, any(x.logprobs is not None for x in (odd, even))


def chunk(engine, state, steps: int, logprobs: bool):
    """`steps` pipelined steps (dispatch n+1, then copy n to the host); seconds per step."""
    pending = None
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out = engine.generate(state, logprobs=logprobs) if logprobs else engine.generate(state)
        if pending is not None:
            np.asarray(pending)
        pending = out
    np.asarray(pending)
    return state, (time.perf_counter() - t0) / steps


def bench_batch(slots: int, rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    """name -> (median ms per step, median ratio to the plain step beside it)."""
    from tandem_engine import load_engine

    engine = load_engine("builtin", slots=slots, max_len=1024, prefill_buckets=(PROMPT_LEN,))
    states = {name: filled(engine, *pair) for name, pair in CASES.items()}
    for name, (st, lp) in states.items():  # compile and warm every variant
        states[name] = (chunk(engine, st, 3, lp)[0], lp)
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(rounds):
        for name, (st, lp) in states.items():
            st, t = chunk(engine, st, steps, lp)
            states[name] = (st, lp)
            times[name].append(t)
    plain = times["plain (greedy)"]
    return {name: (statistics.median(ts) * 1e3, statistics.median(t / p for t, p in zip(ts, plain)))
            for name, ts in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md")
    a = p.parse_args(argv)
    rounds, steps = (6, 20) if a.quick else (15, 30)
    rows = []
    for slots in (8, 32):
        for name, (ms, ratio) in bench_batch(slots, rounds, steps).items():
            rows.append([slots, name, f"{ms:.2f}", f"{ratio:.3f}"])
    cmd = "python bench/processing.py" + (" --quick" if a.quick else "")
    body = (f"## Logits processing cost per decode step\n\n`{cmd}` on {machine_line()}; built-in model, every slot "
            f"active, pipelined; {rounds} alternating rounds of {steps} steps; ratio = median per-round ratio to the "
            "plain step run beside it.\n\n"
            + markdown_table(["batch", "case", "ms/step (median)", "vs plain"], rows))
    print(body)
    if not a.no_write:
        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
