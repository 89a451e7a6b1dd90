"""The pipelined decode loop against the two bugs the vLLM review found in exactly this pipeline:

- deadlock: the step that primes the pipeline (or the last one, with nothing dispatched after it)
  never gets its answer -> a request whose tokens all come from such steps must still finish;
- livelock: a queue nobody drains -> with a publisher slower than the engine and inserts waiting
  for busy slots, every queue still makes progress and every token arrives once, in order.
Real engine (tiny preset), no Redis: the loop's queues are driven directly.
"""
from __future__ import annotations

import queue
import threading
import time

import pytest

from decode_svc.loop import EngineLoop, Insert, LocalPrefill
from decode_svc.slots import SlotTable
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine

SLOTS = 2


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=SLOTS, max_len=64, prefill_buckets=(16,))


def _req(rid: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, [256, 70, 71, 72], max_tokens, SamplingParams(), ignore_eos=True)


def _collect(outputs: queue.Queue, want_finished: int, timeout_s: float) -> dict[str, list]:
    got: dict[str, list] = {}
    finished = 0
    deadline = time.monotonic() + timeout_s
    while finished < want_finished:
        left = deadline - time.monotonic()
        assert left > 0, f"only {finished}/{want_finished} requests finished: {got}"
        try:
            batch = outputs.get(timeout=left)
        except queue.Empty:
            continue
        for e in batch:
            got.setdefault(e.request_id, []).append((e.index, e.finish))
            finished += e.finish is not None
    return got


def _start(engine, outputs_size=64, pipelined=True):
    table = SlotTable(SLOTS)
    inserts, outputs = queue.Queue(SLOTS), queue.Queue(outputs_size)
    loop = EngineLoop(engine, table, inserts, outputs, lambda: None, pipelined=pipelined)
    loop.start()
    return loop, table, inserts, outputs


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("max_tokens", [2, 3, 5])
def test_every_step_gets_its_answer_no_deadlock(engine, max_tokens, pipelined):
    loop, table, inserts, outputs = _start(engine, pipelined=pipelined)
    try:
        table.reserve(1)
        req = _req(f"r{max_tokens}", max_tokens)
        inserts.put(Insert(engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling)), req))
        got = _collect(outputs, 1, timeout_s=30)
        # Index 0 came from prefill; decode emits 1..max_tokens-1, the last one finishing.
        assert got[req.request_id] == [(i, None) for i in range(1, max_tokens - 1)] + [(max_tokens - 1, "length")]
        assert table.used == 0 and table.reserved == 0
    finally:
        loop.stop()
    assert loop.error is None


def test_slow_publisher_and_waiting_inserts_no_livelock(engine):
    loop, table, inserts, outputs = _start(engine, outputs_size=1)  # publisher is the bottleneck
    reqs = [_req(f"q{i}", 6 + i) for i in range(6)]
    got: dict[str, list] = {}

    def feeder():
        # More requests than slots: each waits for a free slot, as the I/O side would.
        for r in reqs:
            while table.reserve(1) == 0:
                time.sleep(0.005)
            if int(r.request_id[1:]) % 2:
                inserts.put(LocalPrefill(r, ("s", "g", b"0-1")))
            else:
                inserts.put(Insert(engine.export_prefix(engine.prefill(r.prompt_ids, r.sampling)), r))

    t = threading.Thread(target=feeder)
    t.start()
    try:
        finished = 0
        deadline = time.monotonic() + 60
        while finished < len(reqs):
            assert time.monotonic() < deadline, f"stalled: {got}"
            try:
                batch = outputs.get(timeout=1)
            except queue.Empty:
                continue
            time.sleep(0.01)  # a slow Redis
            for e in batch:
                got.setdefault(e.request_id, []).append(e.index)
                finished += e.finish is not None
        t.join(10)
    finally:
        loop.stop()
    assert loop.error is None
    for r in reqs:
        first = 0 if int(r.request_id[1:]) % 2 else 1  # local prefills also emit token 0
        assert got[r.request_id] == list(range(first, r.max_tokens)), r.request_id


def test_resumed_request_runs_to_max_tokens_not_to_a_double_counted_context(engine):
    """A request resumed at index 8 (its prompt now holds those 8 tokens) must still emit every
    index up to max_tokens - 1: the context check counts the resumed tokens once (12-token prompt,
    60 tokens in all: position 12 + 51 = 63 is the last of max_len 64)."""
    loop, table, inserts, outputs = _start(engine)
    try:
        table.reserve(1)
        base = [256, 70, 71, 72]
        req = GenerationRequest("resumed", base + [65] * 8, 60, SamplingParams(), ignore_eos=True, start_index=8)
        inserts.put(Insert(engine.export_prefix(engine.prefill(req.prompt_ids, req.sampling)), req))
        got = _collect(outputs, 1, timeout_s=30)
        assert [i for i, _f in got["resumed"]] == list(range(9, 60))
        assert got["resumed"][-1][1] == "length"
    finally:
        loop.stop()
