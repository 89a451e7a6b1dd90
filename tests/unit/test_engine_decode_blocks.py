"""The blocked decode cache (one CPU device): `decode_forward_blocked` over the cache cut into
blocks, each its own buffer with K transposed, computes what `decode_forward` computes over the
one [L, slots, KV, max_len, hd] array (global and windowed layers, sinks, soft-capped scores, a
batch smaller than the slots, a freed slot far ahead), writes the new K/V at the same rows, and
runs only the blocks some active slot reaches (counted by the step itself, not timed)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem_engine import load_engine
from tandem_engine.model import (block_starts, blocked_decode_attention, decode_forward, decode_forward_blocked,
                                 kv_block_sizes)

SLOTS, MAX_LEN = 6, 300  # blocks of 128, 128 and 44 rows


def to_blocks(k, v, sizes):
    """[L, slots, KV, max_len, hd] caches -> per layer, per block: K [slots, KV, hd, n], V [slots, KV, n, hd]."""
    kb = tuple(tuple(jnp.swapaxes(k[i, :, :, s:s + n], 2, 3) for s, n in zip(block_starts(sizes), sizes))
               for i in range(k.shape[0]))
    vb = tuple(tuple(v[i, :, :, s:s + n] for s, n in zip(block_starts(sizes), sizes)) for i in range(v.shape[0]))
    return kb, vb


def from_blocks(kb, vb):
    k = jnp.stack([jnp.concatenate([jnp.swapaxes(b, 2, 3) for b in layer], axis=2) for layer in kb])
    v = jnp.stack([jnp.concatenate(list(layer), axis=2) for layer in vb])
    return k, v


def test_block_sizes_cover_the_cache():
    assert kv_block_sizes(300) == (128, 128, 44)
    assert kv_block_sizes(1024) == (128,) * 8
    assert kv_block_sizes(4096) == (512,) * 8
    assert kv_block_sizes(64) == (64,)
    assert all(sum(kv_block_sizes(n)) == n for n in (1, 100, 129, 1000, 2048, 5000))


@pytest.fixture(scope="module")
def tiny():
    eng = load_engine("tiny", slots=2, max_len=64, prefill_buckets=(16,))
    return eng.cfg, eng.params


@pytest.mark.parametrize("variant", ["plain", "windows", "sinks_softcap"])
def test_blocked_step_equals_the_chunked_step(tiny, variant):
    cfg, params = tiny
    if variant == "windows":  # layer 0 attends to its last 40 positions: a slot at 250 skips block 0
        cfg = cfg._replace(windows=(40, 0))
    if variant == "sinks_softcap":
        cfg = cfg._replace(sinks=True, attn_softcap=5.0)
        layers = dict(params["layers"], sinks=jnp.linspace(-1.0, 1.0, cfg.num_layers * cfg.num_heads)
                      .reshape(cfg.num_layers, cfg.num_heads).astype(jnp.float32))
        params = dict(params, layers=layers)
    rng = np.random.default_rng(1)
    shape = (cfg.num_layers, SLOTS, cfg.num_kv_heads, MAX_LEN, cfg.head_dim)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    # a batch of 4 rows below the 6 slots: slots 4 and 5 are neither read nor written
    tokens = jnp.asarray([3, 7, 11, 5], jnp.int32)
    positions = jnp.asarray([0, 127, 128, 250], jnp.int32)  # first row, block edges, the last block
    active = jnp.asarray([True, True, True, True])
    want_logits, want_k, want_v = jax.jit(decode_forward, static_argnames="cfg")(
        params, tokens, positions, k, v, cfg=cfg, active=active)
    kb, vb = to_blocks(k, v, kv_block_sizes(MAX_LEN))
    got_logits, got_kb, got_vb = jax.jit(decode_forward_blocked, static_argnames="cfg")(
        params, tokens, positions, kb, vb, cfg=cfg, active=active)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=2e-5, atol=2e-5)
    got_k, got_v = from_blocks(got_kb, got_vb)
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_v), np.asarray(want_v), rtol=2e-5, atol=2e-5)
    assert np.asarray(jnp.argmax(got_logits, -1)).tolist() == np.asarray(jnp.argmax(want_logits, -1)).tolist()


def blocks_run(positions, active=None, window=0, reach=None):
    cfg = load_engine("tiny", slots=2, max_len=64, prefill_buckets=(16,)).cfg
    n = len(positions)
    q = jnp.ones((n, 1, cfg.num_heads, cfg.head_dim))
    sizes = kv_block_sizes(MAX_LEN)
    kb = [jnp.ones((n, cfg.num_kv_heads, cfg.head_dim, s)) for s in sizes]
    vb = [jnp.ones((n, cfg.num_kv_heads, s, cfg.head_dim)) for s in sizes]
    pos = jnp.asarray(positions, jnp.int32)
    longest = jnp.max(pos if active is None else jnp.where(jnp.asarray(active), pos, 0))
    _, ran = blocked_decode_attention(q, kb, vb, pos, cfg, longest, window=window,
                                      reach=None if reach is None else jnp.int32(reach))
    return int(ran)


def test_blocks_run_follow_the_longest_active_slot_and_the_window():
    assert blocks_run([5, 9]) == 1
    assert blocks_run([5, 130]) == 2
    assert blocks_run([299, 0]) == 3
    assert blocks_run([5, 299], active=[True, False]) == 1  # a freed slot far ahead adds nothing
    assert blocks_run([250], window=40, reach=211) == 1  # rows 211..250 all sit in the last block
