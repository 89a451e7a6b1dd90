"""The bare engine: the engine's own prefill/insert/generate loop in one process, no serving.

bench/serve.py runs it as the upper bound for Tandem's throughput at the same batch: the same
requests (token-id prompts, output lengths) through the same compiled engine with the same slot
count, the step pipelined the way the decode pod runs it (step n dispatched before step n-1's
tokens are copied to the host), free slots refilled between steps (prefill on the same thread).
No Redis, no gRPC, no HTTP, no client: what is left is the device work and the loop's own host work.

    python bench/bare.py --model builtin --slots 8 --max-len 512 --specs specs.json --out out.json
(`specs.json`: [[prompt_ids, output_len], ...]; run it under `taskset -c CPU` to pin it.)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def warm(engine, prompt_lens: set[int]) -> None:
    """Compile every prefill bucket the run will use, insert and the step, before timing."""
    import jax

    from tandem_core.types import SamplingParams

    state = engine.init_state()
    for b in sorted({engine.bucket_for(n) for n in prompt_lens}):
        prefix = engine.prefill([3] * b, SamplingParams())
        state = engine.insert(prefix, state, 0, SamplingParams())
    for rows in engine.batch_buckets:  # a step compiles once per batch bucket
        state, toks = engine.generate(state, rows)
    state = engine.free(state, 0)
    jax.block_until_ready((state, toks))


def run(engine, work: list[tuple[list[int], int]]) -> dict:
    """Closed loop over `work` with every slot kept busy; returns tokens, seconds, tokens/s."""
    import numpy as np

    from tandem_core.types import SamplingParams

    greedy = SamplingParams()
    todo = deque(work)
    left: dict[int, int] = {}  # slot -> tokens still to emit
    state = engine.init_state()
    pending = None  # (device tokens, slots active when that step was dispatched)
    tokens = prefills = steps = 0
    prefill_s = 0.0
    t0 = time.perf_counter()
    while todo or left:
        for slot in [s for s in range(engine.slots) if s not in left]:
            if not todo:
                break
            ids, out_len = todo.popleft()
            t1 = time.perf_counter()
            prefix = engine.prefill(ids, greedy)  # token 0 comes back with the prefill
            prefill_s += time.perf_counter() - t1
            prefills += 1
            tokens += 1
            if out_len > 1:
                state = engine.insert(prefix, state, slot, greedy)
                left[slot] = out_len - 1
        current = None
        if left:
            state, toks = engine.generate(state, max(left) + 1)  # dispatch only; slots in use only
            current = (toks, list(left))
            steps += 1
        if pending is not None:
            host = np.asarray(pending[0])  # the one device -> host copy of the previous step
            for slot in pending[1]:
                if slot in left:
                    _ = int(host[slot])
                    tokens += 1
                    left[slot] -= 1
                    if left[slot] == 0:
                        del left[slot]
                        state = engine.free(state, slot)
        pending = current
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "requests": prefills, "steps": steps, "wall_s": wall,
            "prefill_s": prefill_s, "output_tokens_per_s": tokens / wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--specs", required=True, help="JSON list of [prompt_ids, output_len]")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from tandem_engine import load_engine

    work = [(list(ids), int(n)) for ids, n in json.loads(Path(a.specs).read_text())]
    engine = load_engine(a.model, slots=a.slots, max_len=a.max_len)
    warm(engine, {len(ids) for ids, _ in work})
    res = run(engine, work)
    res.update(model=a.model, slots=a.slots)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
