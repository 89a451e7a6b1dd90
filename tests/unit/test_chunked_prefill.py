"""Chunked prefill: a prompt prefilled a chunk at a time (`Engine.prefill_chunked`) gives the first
token, KV and greedy continuation of its whole prefill (also over a cached prefix); and in a decode
pod's loop (colocated mode) a long local prompt arriving while a stream runs is prefilled between
that stream's steps, which keep coming, with every token the same as with whole prefills.
Real engine (tiny preset), no Redis: the loop's queues are driven directly."""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from decode_svc.bridge import Bridge
from decode_svc.items import LocalPrefill
from decode_svc.loop import EngineLoop
from decode_svc.requests import RequestTable
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine
from tandem_engine.prefix_cache import Hit

CHUNK = 16
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=2, max_len=96, prefill_buckets=(16, 64), prefix_chunk=CHUNK)


def _greedy(engine, prefix, steps: int) -> list[int]:
    state = engine.insert(prefix, engine.init_state(), 0, GREEDY)
    out = [prefix.first_token]
    for _ in range(steps):
        state, toks = engine.generate(state)
        out.append(int(np.asarray(toks)[0]))
    return out


def _last(gen):
    out = [p for p in gen]
    assert all(p is None for p in out[:-1]) and out[-1] is not None
    return out[-1], len(out)


@pytest.mark.parametrize("length", [5, 16, 17, 40, 64])
def test_chunked_prefill_is_the_whole_prefill(engine, length):
    ids = np.random.default_rng(length).integers(0, engine.info.vocab_size, length).tolist()
    whole = engine.prefill(ids, GREEDY)
    chunked, calls = _last(engine.prefill_chunked(ids, GREEDY))
    assert calls == -(-length // CHUNK)  # one chunk per call
    assert chunked.first_tokens == whole.first_tokens and chunked.true_length == whole.true_length
    a, b = engine.export_prefix(chunked), engine.export_prefix(whole)
    assert a.k.shape == b.k.shape  # the bucket's; rows past the prompt are padding (never attended)
    for x, y in ((a.k, b.k), (a.v, b.v)):
        x, y = x[:, :length], y[:, :length]
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * float(np.abs(y).max()))
    assert _greedy(engine, chunked, 12) == _greedy(engine, whole, 12)


def test_chunked_prefill_over_a_cached_prefix(engine):
    ids = np.random.default_rng(9).integers(0, engine.info.vocab_size, 50).tolist()
    whole = engine.export_prefix(engine.prefill(ids, GREEDY))
    hit = Hit(whole.k[:, :20], whole.v[:, :20], length=20, blocks=1)
    chunked, calls = _last(engine.prefill_chunked(ids, GREEDY, cached=hit))
    assert calls == -(-(50 - 20) // CHUNK)
    assert _greedy(engine, chunked, 12) == _greedy(engine, engine.prefill(ids, GREEDY), 12)


def _run(engine, chunk_tokens: int) -> tuple[dict[str, list[int]], int]:
    """A stream runs; once it has 3 tokens out, a 60-token prompt arrives. Returns every request's
    tokens, and how many of the stream's tokens came out after the prompt arrived and before its
    token 0."""
    table = RequestTable(2)
    bridge = Bridge(2, 256)
    loop = EngineLoop(engine, table, bridge, prefill_chunk_tokens=chunk_tokens)
    loop.start()
    try:
        rng = np.random.default_rng(1)
        stream = GenerationRequest("stream", rng.integers(0, 256, 6).tolist(), 40, GREEDY, ignore_eos=True)
        long = GenerationRequest("long", rng.integers(0, 256, 60).tolist(), 6, GREEDY, ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        between, arrived, finished = 0, False, 0
        for req in (stream,):
            assert table.reserve(1) == 1
            bridge.inserts.put(LocalPrefill(req, ("s", "g", b"0-1"), table.claim(req.request_id)))
        deadline = time.monotonic() + 120
        while finished < 2:
            assert time.monotonic() < deadline, f"not finished: {tokens}"
            try:
                batch = bridge.outputs.get(timeout=1)
            except queue.Empty:
                continue
            for e in batch:
                tokens.setdefault(e.request_id, []).append(e.token)
                finished += e.finish is not None
                if e.request_id == "stream" and arrived and "long" not in tokens:
                    between += 1
            if not arrived and len(tokens.get("stream", [])) >= 3:
                arrived = True
                assert table.reserve(1) == 1
                bridge.inserts.put(LocalPrefill(long, ("s", "g", b"0-2"), table.claim(long.request_id)))
        return tokens, between
    finally:
        loop.stop()


def test_a_long_prompt_is_prefilled_between_a_running_streams_steps(engine):
    whole, between_whole = _run(engine, 0)
    chunked, between = _run(engine, CHUNK)  # one chunk between two steps: 4 chunks for 60 tokens
    assert chunked == whole, "chunked prefill changed the tokens"
    assert between >= 3, f"the stream got {between} tokens out while the long prompt was prefilled in chunks"
    assert between > between_whole
