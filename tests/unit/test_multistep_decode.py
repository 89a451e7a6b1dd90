"""Multi-step decode (issue 29 item 2): `steps` decode steps in one generate call, the decode loop
running `steps_per_dispatch` of them per call.

- the engine: a K-step call returns, token for token, what K one-step calls return (greedy and
  seeded sampling, slots at different positions), and a slot that reaches the last cache row inside
  the call stays there: nothing past max_len is written, its last row keeps what its last valid
  step wrote;
- the loop: every request's entries (index, token, finish) are the same at K = 4 as at K = 1 across
  finishes inside a call (a stop id, max_tokens, the end of the context), and a cancel inside a run
  of calls still gives each request its tokens exactly once, in order, then one finish.
Real engine (tiny preset), no Redis: the loop's queues are driven directly.
"""
from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from decode_svc.bridge import Bridge
from decode_svc.items import Insert
from decode_svc.loop import EngineLoop
from decode_svc.requests import RequestTable
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine

SLOTS = 4
MAX_LEN = 32


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(16,), steps_per_dispatch=4)


PROMPTS = [[256, 70, 71, 72], [256, 80, 81], [256] + [90 + i for i in range(13)]]  # the last: 14 positions
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.8, seed=7), SamplingParams()]


def _filled(engine):
    state = engine.init_state()
    for slot, (p, s) in enumerate(zip(PROMPTS, SAMPLING)):
        state = engine.insert(engine.prefill(p, s), state, slot, s)
    return state


def _slot_kv(engine, state, slot: int) -> list[np.ndarray]:
    """The row's KV, k and v: its blocks of every layer buffer, [L, KV, blocks, B, hd]."""
    ids = np.asarray(state.block_table)[slot, :engine.kv_blocks_of(slot)]
    return [np.stack([np.asarray(layer)[:, ids] for layer in pool]) for pool in (state.k, state.v)]


def test_k_steps_in_one_call_equal_k_one_step_calls(engine):
    steps = 20  # slot 2 (14 prompt positions) reaches the last row (31) at its 18th step
    one, state = [], _filled(engine)
    kv_at_end = None
    for n in range(steps):
        state, toks = engine.generate(state, 3)
        one.append(np.asarray(toks)[:3])
        if n + 1 == MAX_LEN - len(PROMPTS[2]):  # slot 2 just wrote row MAX_LEN - 1 (its last valid step)
            kv_at_end = _slot_kv(engine, state, 2)
    one = np.stack(one)

    multi, state = [], _filled(engine)
    for _ in range(steps // 4):
        state, toks = engine.generate(state, 3, steps=4)
        assert toks.shape == (4, engine.rows_for(3))
        multi.append(np.asarray(toks)[:, :3])
    multi = np.concatenate(multi)

    valid = MAX_LEN - len(PROMPTS[2])  # slot 2's tokens from its positions 14..31
    assert (multi[:, :2] == one[:, :2]).all(), (multi[:, :2], one[:, :2])
    assert (multi[:valid, 2] == one[:valid, 2]).all()
    pos = np.asarray(state.positions)
    assert pos.tolist()[:3] == [len(PROMPTS[0]) + steps, len(PROMPTS[1]) + steps, MAX_LEN - 1]
    # the slot at the end rewrote its last row with the same input: its cache is what it was after
    # its last valid step (one-step calls past it write a clamped garbage row there)
    for got, want in zip(_slot_kv(engine, state, 2), kv_at_end):
        np.testing.assert_array_equal(got, want)


def test_masks_take_one_step_per_call(engine):
    state = _filled(engine)
    ones = np.full((4, (engine.info.vocab_size + 31) // 32), -1, np.int32)
    with pytest.raises(ValueError, match="1 with grammar masks"):
        engine.generate(state, 3, masks=ones, steps=4)


# ---------------------------------------------------------------------------------------------
# the decode loop

def _req(rid: str, prompt, max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens, SamplingParams(), ignore_eos=True, **kw)


def _drive(engine, reqs, steps_per_dispatch: int, cancel_after: dict[str, int] | None = None,
           timeout_s: float = 60) -> tuple[dict[str, list], EngineLoop]:
    """Insert every request at once and collect each one's entries (index, token, finish) until all
    finish; `cancel_after`: cancel a request once it has this many entries. Then the engine thread's
    third generate call and later ones wait until the cancel is made (a loaded machine's test
    thread read the first entries only after the loop had run the request to its end: make test,
    2026-12-07, "(27, 'length') == (-1, 'cancelled')")."""
    made = threading.Event()
    if cancel_after:
        real, calls = engine.generate, [0]

        def gated(*args, **kw):
            calls[0] += 1
            if calls[0] >= 3:
                made.wait(timeout_s)
            return real(*args, **kw)

        engine.generate = gated  # an instance attribute over the method: removed below
    table = RequestTable(SLOTS)
    bridge = Bridge(SLOTS, 256)
    loop = EngineLoop(engine, table, bridge, steps_per_dispatch=steps_per_dispatch)
    for r in reqs:
        assert table.reserve(1) == 1
        key = table.claim(r.request_id)
        bridge.put_insert(Insert(engine.export_prefix(engine.prefill(r.prompt_ids, r.sampling)), r, key))
    loop.start()
    got: dict[str, list] = {r.request_id: [] for r in reqs}
    cancelled: set[str] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while sum(any(f is not None for _i, _t, f in v) for v in got.values()) < len(reqs):
            assert time.monotonic() < deadline, f"stalled: {got}"
            try:
                batch = bridge.outputs.get(timeout=1)
            except queue.Empty:
                continue
            for e in batch:
                got[e.request_id].append((e.index, e.token, e.finish))
            for rid, n in (cancel_after or {}).items():
                if rid not in cancelled and len(got[rid]) >= n:
                    loop.cancel({rid})
                    cancelled.add(rid)
            if cancel_after and cancelled >= set(cancel_after):
                made.set()
    finally:
        made.set()
        loop.stop()
        engine.__dict__.pop("generate", None)
    assert loop.error is None
    return got, loop


def test_loop_tokens_at_k4_equal_k1_across_finishes_inside_a_call(engine):
    probe, _ = _drive(engine, [_req("probe", PROMPTS[0], 12)], 1)
    toks = [t for _i, t, _f in probe["probe"]]
    stop_tok = toks[5]  # the token at index 6: not on a call's boundary at K = 4 (calls end at 4, 8, ...)
    reqs = [
        _req("stops", PROMPTS[0], 12, stop_token_ids=[stop_tok]),
        _req("short", PROMPTS[1], 6),  # ends by max_tokens at index 5, inside the second call
        _req("ctx", PROMPTS[2], 100),  # 14 prompt positions: ends at the end of the context, index 18
        _req("long", PROMPTS[0], 22),
    ]
    k1, _ = _drive(engine, reqs, 1)
    k4, loop = _drive(engine, reqs, 4)
    assert loop.stats.calls < loop.stats.steps  # some calls did run several steps
    # the single-step calls (work waiting at dispatch) are counted apart: every other call ran 4 steps
    assert loop.stats.steps == 4 * (loop.stats.calls - loop.stats.single_calls) + loop.stats.single_calls
    want_stop = next(i for i, t in enumerate(toks, start=1) if t == stop_tok)
    assert [(i, f) for i, _t, f in k1["stops"]][-1] == (want_stop, "stop")
    assert [(i, f) for i, _t, f in k1["short"]][-1] == (5, "length")
    assert [(i, f) for i, _t, f in k1["ctx"]][-1] == (MAX_LEN - len(PROMPTS[2]), "length")
    for rid in k1:
        assert k4[rid] == k1[rid], rid


def test_cancel_inside_multi_step_calls_gives_each_token_once_then_one_finish(engine):
    reqs = [_req("cancelled", PROMPTS[0], 25), _req("other", PROMPTS[1], 14)]
    got, _ = _drive(engine, reqs, 4, cancel_after={"cancelled": 3})
    ref, _ = _drive(engine, reqs, 1)
    for rid, entries in got.items():
        idx = [i for i, _t, _f in entries]
        assert idx == list(range(1, len(idx) + 1)), (rid, idx)  # once each, in order, no gap
        finishes = [f for _i, _t, f in entries if f is not None]
        assert len(finishes) == 1 and entries[-1][2] is not None, (rid, entries)
        # the tokens before the finish are the reference's
        body = [(i, t) for i, t, f in entries if t >= 0]
        assert body == [(i, t) for i, t, _f in ref[rid]][: len(body)]
    assert got["cancelled"][-1][1:] == (-1, "cancelled")
    assert got["cancelled"][-1][0] < 24
    assert got["other"][-1] == (13, ref["other"][-1][1], "length")
