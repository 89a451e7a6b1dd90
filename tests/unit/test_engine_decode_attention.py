"""Decode attention reads the KV cache in chunks up to the longest active slot only: the chunked
online softmax equals plain masked attention, its loop visits ceil((max position + 1) / chunk)
chunks (counted by the loop itself, not timed), and a short sequence in a large cache, or one that
crosses a chunk boundary, still decodes to the reference's greedy tokens."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem_core.types import SamplingParams
from tandem_engine import load_engine, reference_greedy
from tandem_engine.model import (DECODE_CHUNK, ModelConfig, _grouped_attention,
                                 chunked_decode_attention, decode_chunks)

GREEDY = SamplingParams()
CFG = ModelConfig(vocab_size=8, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6)


def visited(positions, max_len: int, chunk: int = DECODE_CHUNK) -> int:
    """Chunks the attention loop actually ran (its own counter) on a cache of `max_len` rows."""
    slots = len(positions)
    q = jnp.ones((slots, 1, CFG.num_heads, CFG.head_dim))
    cache = jnp.ones((CFG.num_layers, slots, CFG.num_kv_heads, max_len, CFG.head_dim))
    _, n = chunked_decode_attention(q, cache, cache, 1, jnp.asarray(positions, jnp.int32), CFG, chunk)
    return int(n)


def test_chunks_visited_follow_the_longest_slot():
    assert visited([5, 9], 2048) == 1
    assert visited([5, 700], 2048) == math.ceil(701 / DECODE_CHUNK)
    assert visited([2047, 0], 2048) == 2048 // DECODE_CHUNK
    assert visited([5, 700], 2048, chunk=64) == math.ceil(701 / 64)
    assert visited([3], 100) == 1  # a cache shorter than a chunk is one chunk of max_len rows
    # free slots keep their old positions but do not lengthen the loop
    active = jnp.asarray([True, False])
    assert int(decode_chunks(jnp.asarray([5, 700]), 2048, active=active)) == 1


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("max_len,chunk", [(96, 32), (100, 32), (64, 256)])
def test_chunked_equals_masked_attention(max_len, chunk, dtype, tol):
    """Many chunks, a last chunk clamped to end at max_len (100 % 32), a cache shorter than a
    chunk; slots at the first row, inside a chunk, on a boundary and at the last row."""
    slots = 5
    rng = np.random.default_rng(max_len + chunk)
    q = jnp.asarray(rng.standard_normal((slots, 1, CFG.num_heads, CFG.head_dim)), dtype)
    kv = (CFG.num_layers, slots, CFG.num_kv_heads, max_len, CFG.head_dim)  # head-major cache
    k = jnp.asarray(rng.standard_normal(kv), dtype)
    v = jnp.asarray(rng.standard_normal(kv), dtype)
    positions = jnp.asarray([0, 17, chunk - 1 if chunk < max_len else 40, 63, max_len - 1], jnp.int32)
    mask = (jnp.arange(max_len)[None, :] <= positions[:, None])[:, None, :]
    want = _grouped_attention(q.astype(jnp.float32), jnp.swapaxes(k[1], 1, 2).astype(jnp.float32),
                              jnp.swapaxes(v[1], 1, 2).astype(jnp.float32), mask, CFG)
    got, n = jax.jit(chunked_decode_attention, static_argnames=("cfg", "chunk"))(
        q, k, v, 1, positions, cfg=CFG, chunk=chunk)
    assert got.dtype == dtype and n == math.ceil(max_len / min(chunk, max_len))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.slow  # make test-unit leaves it out: an engine of 1,024 rows and the reference over 260 positions
def test_short_and_boundary_crossing_sequences_in_a_large_cache():
    """max_len 1024 (4 chunks): a 7-token prompt visits one chunk, a 250-token prompt crosses
    into the second chunk while decoding; both slots decode side by side to the reference."""
    engine = load_engine("tiny", slots=2, max_len=1024, prefill_buckets=(16, 256))
    rng = np.random.default_rng(0)
    prompts = {0: rng.integers(0, 256, 7).tolist(), 1: rng.integers(0, 256, 250).tolist()}
    steps = 10
    state = engine.init_state()
    got = {}
    for slot, ids in prompts.items():
        prefix = engine.prefill(ids, GREEDY)
        got[slot] = [prefix.first_token]
        state = engine.insert(prefix, state, slot, GREEDY)
    for _ in range(steps):
        state, tokens = engine.generate(state)
        for slot in prompts:
            got[slot].append(int(np.asarray(tokens)[slot]))
    assert int(np.asarray(state.positions)[1]) > DECODE_CHUNK
    for slot, ids in prompts.items():
        assert got[slot] == reference_greedy(engine.params, engine.cfg, ids, steps + 1, pad_to=272)


def test_windowed_layer_reads_only_its_window():
    """A windowed layer's step starts at the chunk its window reaches: at positions ~1000 of a
    2048-row cache, a 64-position window visits 1 chunk where a global layer visits 4, and the
    result equals plain attention masked to the window (sinks included, as gpt-oss has them)."""
    from tandem_engine.model import window_first_chunk

    slots, max_len, window = 2, 2048, 64
    rng = np.random.default_rng(3)
    positions = jnp.asarray([1000, 1010], jnp.int32)
    q = jnp.asarray(rng.standard_normal((slots, 1, CFG.num_heads, CFG.head_dim)), jnp.float32)
    kv = (CFG.num_layers, slots, CFG.num_kv_heads, max_len, CFG.head_dim)
    k, v = (jnp.asarray(rng.standard_normal(kv), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(CFG.num_heads), jnp.float32)
    first = window_first_chunk(positions, jnp.int32(window), max_len)
    got, n = chunked_decode_attention(q, k, v, 0, positions, CFG, window=jnp.int32(window), first_chunk=first,
                                      sinks=sinks)
    _, n_global = chunked_decode_attention(q, k, v, 0, positions, CFG)
    assert (int(n), int(n_global)) == (1, 4)
    rows = jnp.arange(max_len)[None, :]
    mask = ((rows <= positions[:, None]) & (positions[:, None] - rows < window))[:, None, :]
    want = _grouped_attention(q, jnp.swapaxes(k[0], 1, 2), jnp.swapaxes(v[0], 1, 2), mask, CFG, sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
