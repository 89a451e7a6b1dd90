"""Paged KV vs fixed slots on one KV memory budget (`python bench/paged_capacity.py [--quick]
[--write]`).

Two engines of the same model hold the same KV memory, a pool of slots * ceil(max_len / block)
blocks: one with `--slots` rows ("slots": every row can reach max_len at once, as the slot layout
issue 43 deleted set max_len aside per slot, so its capacity is that layout's), one shared by up to
`--rows` sequences ("paged"). Both serve one mixed-length workload through the
same loop, written against the engine's capacity API as a decode pod uses it: admit a request
when a row is free and kv_blocks_free() covers its context plus one dispatch's reserve;
reserve() before every generate, handing the newest short rows back to the queue (resumed later
from their tokens so far: counted as preemptions, no token lost); free on finish.

Workload: prompt lengths 32..900 and outputs 16..256 drawn log-normally (a chat dataset's shape:
most turns a few hundred tokens, a long tail), scaled down together when prompt + output could
pass max_len. The KV inserted is a zero payload of the prompt's length (what is measured is
capacity and step cost, not text; the prefill is not run, so its cost is not in the tok/s).

Reported: concurrent sequences held (mean over the saturated steps, and the most), output
tokens/s at saturation (tokens over the loop's process CPU time, one XLA thread), preemptions;
and the decode step's CPU time at batch 8 and 32 with every row at the same context. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_line, markdown_table, merge_summary, write_section

SECTION = "paged_capacity"
PAD = 128  # payload lengths are padded to this (each padded length compiles one insert)


@dataclass
class Req:
    prompt: int
    output: int
    done: int = 0
    admitted: int = 0


def workload(n: int, max_len: int, seed: int = 0) -> list[Req]:
    """n requests: prompts 32..900 and outputs 16..256, log-normal (medians ~220 and ~90),
    scaled down together when 900 + 256 > max_len."""
    rng = np.random.default_rng(seed)
    scale = min(1.0, max_len / (900 + 256))
    prompts = np.clip(rng.lognormal(np.log(220), 0.8, n), 32, 900) * scale
    outputs = np.clip(rng.lognormal(np.log(90), 0.7, n), 16, 256) * scale
    return [Req(max(2, int(p)), max(2, int(o))) for p, o in zip(prompts, outputs)]


def payloads(engine, max_len: int):
    from tandem_core.types import KVPayload

    c, out = engine.cfg, {}
    for length in range(PAD, max_len + PAD, PAD):
        length = min(length, max_len)
        kv = np.zeros((c.num_layers, length, c.num_kv_heads, c.head_dim), np.float32)
        out[length] = KVPayload(k=kv, v=kv, true_length=length, first_token=1)
    return out


def payload_for(table: dict, context: int):
    from tandem_core.types import KVPayload

    length = next(n for n in sorted(table) if n >= context)
    p = table[length]
    return KVPayload(k=p.k, v=p.v, true_length=context, first_token=1)


def warm(engine, table: dict, steps: int) -> None:
    """Compile every insert length and every step variant the loop can run."""
    from tandem_core.types import SamplingParams

    state = engine.init_state()
    for p in table.values():
        state = engine.insert_payload(p, state, 0, SamplingParams())
        state = engine.free(state, 0)
    widths = sorted({width for _, width, *_ in engine.warm_steps(False, False)}, key=lambda w: w or 0)
    for rows in engine.batch_buckets:
        for width in widths:
            state, tokens = engine._generate(state, rows, logprobs=False, masks=None, steps=steps,
                                             table_blocks=width)
    np.asarray(tokens)


def serve(engine, reqs: list[Req], steps: int, table: dict) -> dict:
    """The decode pod's loop over the capacity API; returns its counts and CPU time."""
    from tandem_core.types import SamplingParams

    greedy = SamplingParams()
    state = engine.init_state()
    queue = deque(Req(r.prompt, r.output) for r in reqs)
    rows: dict[int, Req] = {}
    free_rows = list(range(engine.slots))
    held, saturated, tokens, preempted, admitted, calls = [], [], 0, 0, 0, 0
    reserve = engine.kv_blocks_for(steps)
    t0 = time.process_time()
    while queue or rows:
        while queue and free_rows:
            r = queue[0]
            context = r.prompt + r.done  # a resumed request comes back with its tokens so far
            if engine.kv_blocks_free() < engine.kv_blocks_for(context) + reserve:
                break
            queue.popleft()
            slot = min(free_rows)
            free_rows.remove(slot)
            state = engine.insert_payload(payload_for(table, context), state, slot, greedy)
            admitted += 1
            r.admitted = admitted
            rows[slot] = r
        while True:
            state, short = engine.reserve(state, steps)
            if not short:
                break
            newest = max(short, key=lambda s: rows[s].admitted)  # hand the newest back
            state = engine.free(state, newest)
            queue.appendleft(rows.pop(newest))
            free_rows.append(newest)
            preempted += 1
        state, out = engine.generate(state, max(rows) + 1, steps=steps)
        np.asarray(out)  # the pod reads every dispatch's tokens
        calls += 1
        held.append(len(rows))
        if queue:  # saturated: requests wait while these run
            saturated.append(len(rows))
        for slot in list(rows):
            r = rows[slot]
            n = min(steps, r.output - r.done)
            r.done += n
            tokens += n
            if r.done >= r.output:
                state = engine.free(state, slot)
                del rows[slot]
                free_rows.append(slot)
    cpu = time.process_time() - t0
    return dict(tokens=tokens, cpu_s=cpu, tok_s=tokens / cpu, calls=calls, preempted=preempted,
                held_mean=float(np.mean(saturated or held)), held_max=int(max(held)))


def step_time(engine, batch: int, context: int, n: int) -> float:
    """CPU seconds per one-step generate with `batch` rows at `context` positions."""
    from tandem_core.types import KVPayload, SamplingParams

    c = engine.cfg
    kv = np.zeros((c.num_layers, context, c.num_kv_heads, c.head_dim), np.float32)
    state = engine.init_state()
    for slot in range(batch):
        state = engine.insert_payload(KVPayload(k=kv, v=kv, true_length=context, first_token=1), state, slot,
                                      SamplingParams())
    for _ in range(2):  # compile and settle
        state, _ = engine.reserve(state, 1)
        state, out = engine.generate(state, batch)
        np.asarray(out)
    t0 = time.process_time()
    for _ in range(n):
        state, _ = engine.reserve(state, 1)
        state, out = engine.generate(state, batch)
        np.asarray(out)
    return (time.process_time() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--slots", type=int, default=8, help="fixed slots of the slot layout (the KV budget)")
    p.add_argument("--rows", type=int, default=64, help="sequence rows of the paged layout")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--steps", type=int, default=4, help="steps per generate call (steps_per_dispatch)")
    p.add_argument("--step-context", type=int, default=512)
    p.add_argument("--step-reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="max_len 512, 4 slots, 32 rows, 48 requests")
    p.add_argument("--write", action="store_true", help="write the section of bench/RESULTS.md")
    args = p.parse_args()
    if args.quick:
        args.max_len, args.slots, args.rows, args.requests = 512, 4, 32, 48
        args.step_context, args.step_reps = 256, 10
    from tandem_engine import load_engine

    common = dict(max_len=args.max_len, prefill_buckets=(16,), cpu_threads=1, steps_per_dispatch=args.steps,
                  kv_block_size=args.block)
    budget = args.slots * -(-args.max_len // args.block)
    fixed = load_engine(args.model, slots=args.slots, **common)
    paged = load_engine(args.model, slots=args.rows, kv_blocks=budget, **common)
    reqs = workload(args.requests, args.max_len)
    res = {}
    for name, eng in (("slots", fixed), ("paged", paged)):
        table = payloads(eng, args.max_len)
        warm(eng, table, args.steps)
        res[name] = serve(eng, reqs, args.steps, table)
        print(name, res[name], file=sys.stderr, flush=True)
    # step time: engines wide enough for 32 rows, same capacity per row
    steps = {}
    wide = dict(common, max_len=args.max_len)
    p32 = load_engine(args.model, slots=32, **wide)
    for batch in (8, 32):
        steps[batch] = step_time(p32, batch, args.step_context, args.step_reps)
        print(batch, steps[batch], file=sys.stderr, flush=True)

    a, b = res["slots"], res["paged"]
    rows = [[name, r["held_mean"], r["held_max"], r["tok_s"], r["tokens"], r["cpu_s"], r["preempted"]]
            for name, r in ((f"fixed rows ({args.slots})", a), (f"shared pool ({args.rows} rows)", b))]
    rows.append(["shared / fixed", b["held_mean"] / a["held_mean"], b["held_max"] / a["held_max"],
                 b["tok_s"] / a["tok_s"], "", "", ""])
    cmd = "python bench/paged_capacity.py " + " ".join(sys.argv[1:])
    body = "\n".join([
        "## Paged KV vs fixed slots (same KV memory)",
        "",
        "Since issue 43 deleted the slot layout both sides run the same pool and step: \"fixed rows\" is the pool "
        "with as few rows as the budget holds at max_len each (the slot layout's capacity), \"shared pool\" lets "
        "more rows share the blocks. Runs before that compared against the slot layout's own step.",
        "",
        f"`{cmd}` on {machine_line()}. Model {args.model}, max_len {args.max_len}, KV budget "
        f"{budget} blocks of {args.block} ({args.slots} slots x {args.max_len}); paged: up to {args.rows} "
        f"rows. {args.requests} requests (prompts 32..900, outputs 16..256, log-normal, scaled to "
        f"max_len), {args.steps} steps per call, zero KV payloads (no prefill). CPU time of the "
        f"process, one XLA thread.",
        "",
        markdown_table(["engine", "sequences held (mean, saturated)", "most held", "output tok/s (CPU)",
                        "tokens", "CPU s", "preemptions"], rows),
        "",
        f"Decode step CPU time, every row at {args.step_context} positions (ms):",
        "",
        markdown_table(["batch", "step ms"], [[bt, 1e3 * steps[bt]] for bt in (8, 32)]),
    ])
    print(body)
    if args.write:
        write_section(SECTION, body)
        merge_summary({"paged_held_ratio": b["held_mean"] / a["held_mean"],
                       "paged_tok_s_ratio": b["tok_s"] / a["tok_s"]})


if __name__ == "__main__":
    main()
