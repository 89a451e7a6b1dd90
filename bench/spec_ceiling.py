"""What the speculative bench's repeat workload allows at one stream (issue 45), without timing
the served system: how many tokens a verify call could emit, and what such a call costs.

    python bench/spec_ceiling.py [--quick] [--requests 64] [--k 4,8] [--no-write]

1. Tokens per call with verification free. The repeat workload's prompts (bench/speculative.py,
   the same file) are decoded greedily by the built-in model, 128 tokens each; then the n-gram
   lookup (tandem_engine.speculative.NgramIndex, the decode pod's) is replayed over each output
   as the pod would run it at a fixed k (adaptive k only proposes fewer): each call proposes from
   the prompt and the output so far, keeps the longest prefix equal to the output and emits one
   token more. No model runs for this: it is what the workload's text allows any verify call.
2. The engine's costs, one process, back to back, one row of 32 slots, max_len 1024 (as served):
   a call of one step, of `steps_per_dispatch` (4) steps (the plain loop's dispatch), and a
   verify call of k proposals, each the median of 60 calls after 5.
3. The bound: at one stream the plain loop's token costs (4-step call) / 4 and a speculating
   one's (verify call) / tokens per call, so on / off <= tokens per call x (4-step call / 4) /
   verify call. It leaves out the plain loop's pipelining and every host cost of either loop, both
   of which favour the plain loop, so the served ratio is at most this.

Writes bench/out/spec_ceiling.json and, unless --no-write, the `speculative-ceiling` section of
bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_line, markdown_table, write_section
from bench.systems import ROOT

OUT = ROOT / "bench" / "out" / "spec_ceiling.json"
OUTPUT = 128
STEPS = 4  # the decode pod's default steps_per_dispatch
ROUNDS, CALLS = 4, 20  # engine calls timed: rounds over the variants, calls of each a round


class Replay(NamedTuple):
    tokens_per_call: float  # tokens a verify call emitted, the bonus one included
    acceptance: float  # proposed tokens kept / proposed
    calls: int


def replay_lookup(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int,
                  max_n: int = 3, min_n: int = 2) -> Replay:
    """The n-gram lookup replayed over known outputs (the first token is the prefill's): per call,
    the proposal from the prompt and the output so far, the longest prefix of it equal to the
    output kept, one token more emitted."""
    from tandem_engine.speculative import NgramIndex

    calls = emitted = proposed = kept = 0
    for prompt, out in zip(prompts, outputs):
        index = NgramIndex(list(prompt) + list(out[:1]), max_n, min_n)
        at = 1
        while at < len(out):
            ids = index.propose(k)
            a = 0
            while a < len(ids) and at + a < len(out) and ids[a] == out[at + a]:
                a += 1
            step = min(a + 1, len(out) - at)
            calls, emitted, proposed, kept = calls + 1, emitted + step, proposed + len(ids), kept + a
            index.extend(out[at:at + step])
            at += step
    return Replay(emitted / max(calls, 1), kept / max(proposed, 1), calls)


def _greedy_outputs(engine, prompts: list[list[int]]) -> list[list[int]]:
    import numpy as np

    from tandem_core.types import SamplingParams

    greedy = SamplingParams()
    outs: list[list[int]] = []
    for at in range(0, len(prompts), engine.slots):
        group = prompts[at:at + engine.slots]
        state = engine.init_state()
        got: list[list[int]] = []
        for slot, p in enumerate(group):
            prefix = engine.prefill(p, greedy)
            state = engine.insert(prefix, state, slot, greedy)
            got.append([prefix.first_token])
        for _ in range(OUTPUT - 1):
            state, tokens = engine.generate(state, len(group))
            for slot, t in enumerate(np.asarray(tokens).tolist()):
                got[slot].append(int(t))
        for slot in range(len(group)):
            state = engine.free(state, slot)
        outs += got
    return outs


def _costs(engine, prompt: list[int], ks: list[int]) -> dict[str, float]:
    """Median ms of a 1-step call, a STEPS-step call and a verify call of each k, one row
    (ROUNDS rounds of CALLS calls of each, interleaved)."""
    import numpy as np

    from tandem_core.types import SamplingParams

    greedy = SamplingParams()
    state = engine.insert(engine.prefill(prompt, greedy), engine.init_state(), 0, greedy)
    box = [state]

    def steps(n: int):
        def call() -> None:
            box[0], out = engine.generate(box[0], 1, steps=n)
            np.asarray(out)
        return call

    def verify(k: int):
        def call() -> None:
            box[0], _short = engine.reserve(box[0], k + 1)
            box[0], out = engine.verify(box[0], {0: [5] * k}, k, 1)
            np.asarray(out.tokens)
        return call

    calls = {"step": steps(1), f"steps{STEPS}": steps(STEPS), **{f"verify{k}": verify(k) for k in ks}}
    took: dict[str, list[float]] = {name: [] for name in calls}
    for name, call in calls.items():  # compiled and warm
        for _ in range(5):
            call()
    for _ in range(ROUNDS):  # interleaved, so the machine's drift falls on every variant alike
        for name, call in calls.items():
            for _ in range(CALLS):
                t0 = time.perf_counter()
                call()
                took[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in took.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="32 requests")
    p.add_argument("--k", default="4,8")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from bench.speculative import MAX_LEN, workloads
    from tandem_engine import load_engine

    ks = [int(x) for x in a.k.split(",") if x]
    if a.quick:
        a.requests = 32
    prompts = workloads(a.requests)["repeat"][:a.requests]
    engine = load_engine("builtin", slots=32, max_len=MAX_LEN, prefill_buckets=(64, 128, 256, 512, 1024))
    outputs = _greedy_outputs(engine, prompts)
    costs = _costs(engine, prompts[0], ks)
    plain = costs[f"steps{STEPS}"] / STEPS
    rows, result = [], {"costs_ms": costs, "replays": {}}
    for k in ks:
        for max_n, min_n in ((3, 2), (3, 1), (8, 2)):
            r = replay_lookup(prompts, outputs, k, max_n, min_n)
            bound = r.tokens_per_call * plain / costs[f"verify{k}"]
            result["replays"][f"k{k}_n{min_n}-{max_n}"] = {**r._asdict(), "bound": bound}
            rows.append([k, f"{min_n}-{max_n}", f"{r.tokens_per_call:.2f}", f"{r.acceptance:.2f}",
                         f"{costs[f'verify{k}']:.2f}", f"{plain:.2f}", f"{bound:.2f}"])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    body = ("## Speculative decoding: what the repeat workload allows at one stream (bench/spec_ceiling.py)\n\n"
            f"Command: `python bench/spec_ceiling.py {' '.join(sys.argv[1:])}`  \n"
            f"Machine: {machine_line()}  \n"
            f"{len(prompts)} repeat prompts, their greedy outputs ({OUTPUT} tokens) replayed through the n-gram "
            f"lookup at a fixed k (verification free); engine calls at one row, medians of {ROUNDS * CALLS} (interleaved): one step "
            f"{costs['step']:.2f} ms, a {STEPS}-step call {costs[f'steps{STEPS}']:.2f} ms.\n\n"
            + markdown_table(["k", "n-gram n", "tokens / call", "acceptance", "verify call ms",
                              f"plain ms / token ({STEPS}-step call)", "bound on on / off"], rows)
            + "\n\nbound: tokens / call x plain ms a token / verify call ms, leaving out pipelining and "
              "every host cost (both favour the plain loop). The target (issue 45) is on / off >= 2 at c=1.\n")
    print(body)
    if not a.no_write:
        write_section("speculative-ceiling", body)


if __name__ == "__main__":
    main()
