"""What grammar-constrained slots cost decode: tokens/s of the built-in model at batch 8 and 32
with 0%, 50% and 100% of the slots under a small JSON schema (`python bench/constrained.py
[--quick]`).

Each step runs as the decode loop runs it (decode_svc/loop.py): an unconstrained batch pipelined
(step n+1 dispatched before step n's tokens are read) with the maskless compiled step; a batch with
a constrained slot unpipelined: masks computed on the host from each slot's Matcher, the masked step
dispatched, its tokens read and fed to the matchers. "0%, unpipelined" separates what losing the
pipeline costs from what the masks cost. A matcher whose object is complete restarts, so every
constrained slot stays constrained. Every slot samples at temperature 1. The cases alternate in
short chunks and each ratio is the median per-chunk ratio to the pipelined 0% chunk beside it.
Writes its section of bench/RESULTS.md; timings are reported, never asserted.
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
from tandem_core.grammar import Grammars
from tandem_core.types import SamplingParams

SECTION = "constrained"
PROMPT_LEN = 32
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SPEC = {"kind": "json_schema", "schema": SCHEMA}
NOTE = ("\n\nReading: on these CPUs a decode step takes 14-55 ms, so the grammar's host time (under 2 ms a "
        "step with 32 constrained slots) and the lost pipelining stay inside the run-to-run noise (ratios within a "
        "few per cent either way). On an accelerator whose step is about a millisecond the unpipelined step would "
        "cost the host round trip as well; run this there before quoting a ratio.")
CASES = {"0%": (0.0, True), "0%, unpipelined": (0.0, False), "50%": (0.5, False), "100%": (1.0, False)}


class Batch:
    """One case's filled DecodeState and the matchers of its constrained slots."""

    def __init__(self, engine, grammars: Grammars, share: float, pipelined: bool) -> None:
        ids = np.random.default_rng(0).integers(3, engine.info.vocab_size, PROMPT_LEN).tolist()
        self.engine, self.pipelined, self.state = engine, pipelined, engine.init_state()
        picked = sorted(range(engine.slots), key=lambda s: (s % 2, s))[: round(share * engine.slots)]
        self.matchers = {slot: grammars.matcher(SPEC) for slot in picked}  # 50%: the even slots
        words = (engine.info.vocab_size + 31) // 32
        self.masks = np.full((engine.slots, words), -1, np.int32)
        for slot in range(engine.slots):
            s = SamplingParams(temperature=1.0, seed=slot)
            masks = self.masks[slot:slot + 1].copy() if slot in self.matchers else None
            if masks is not None:
                self.matchers[slot].mask_into(masks[0])
            prefix = engine.prefill(ids, s, masks=masks)
            if slot in self.matchers:
                self.matchers[slot].consume(prefix.first_token)
            self.state = engine.insert(prefix, self.state, slot, s)
        self.mask_s = 0.0

    def chunk(self, steps: int) -> float:
        """Seconds per step over `steps` steps."""
        t0 = time.perf_counter()
        if self.pipelined:
            pending = None
            for _ in range(steps):
                self.state, out = self.engine.generate(self.state)
                if pending is not None:
                    np.asarray(pending)
                pending = out
            np.asarray(pending)
        else:
            for _ in range(steps):
                self._constrained_step()
        return (time.perf_counter() - t0) / steps

    def _constrained_step(self) -> None:
        m0 = time.perf_counter()
        for slot, m in self.matchers.items():
            if m.done():
                m.rebuild([])  # a finished object: start the next one, the slot stays constrained
            m.mask_into(self.masks[slot])
        self.mask_s += time.perf_counter() - m0
        kw = {"masks": self.masks} if self.matchers else {}
        self.state, out = self.engine.generate(self.state, **kw)
        toks = np.asarray(out)
        m0 = time.perf_counter()
        for slot, m in self.matchers.items():
            m.consume(int(toks[slot]))
        self.mask_s += time.perf_counter() - m0


def bench_batch(slots: int, rounds: int, steps: int) -> dict[str, tuple[float, float, float]]:
    """case -> (tokens/s median, ratio to pipelined 0%, host grammar ms per step)."""
    from tandem_engine import load_engine

    engine = load_engine("builtin", slots=slots, max_len=PROMPT_LEN + 2 * rounds * steps + 64,
                         prefill_buckets=(PROMPT_LEN,))
    grammars = Grammars(engine.info)
    batches = {name: Batch(engine, grammars, share, pipe) for name, (share, pipe) in CASES.items()}
    for b in batches.values():  # compile and warm every variant
        b.chunk(3)
        b.mask_s = 0.0
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(rounds):
        for name, b in batches.items():
            times[name].append(b.chunk(steps))
    base = times["0%"]
    return {name: (slots / statistics.median(ts), statistics.median(p / t for t, p in zip(ts, base)),
                   batches[name].mask_s / (rounds * steps) * 1e3)
            for name, ts in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md")
    a = p.parse_args(argv)
    rounds, steps = (5, 16) if a.quick else (12, 30)
    rows = []
    for slots in (8, 32):
        for name, (tps, ratio, mask_ms) in bench_batch(slots, rounds, steps).items():
            rows.append([slots, name, f"{tps:.0f}", f"{ratio:.3f}", f"{mask_ms:.3f}"])
    cmd = "python bench/constrained.py" + (" --quick" if a.quick else "")
    body = (f"## Grammar-constrained decoding cost\n\n`{cmd}` on {machine_line()}; built-in model, every slot "
            f"active at temperature 1, a small JSON schema (two fields) on the constrained share of the slots; "
            f"{rounds} alternating rounds of {steps} steps; tokens/s = batch / median step time; ratio = median "
            "per-round tokens/s relative to the pipelined 0% case beside it; grammar ms = host time per step in "
            "llguidance (masks + consuming the tokens).\n\n"
            + markdown_table(["batch", "constrained", "tokens/s", "vs 0% pipelined", "grammar ms/step"], rows)
            + NOTE)
    print(body)
    if not a.no_write:
        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
