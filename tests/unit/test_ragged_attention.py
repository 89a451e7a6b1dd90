"""attention.ragged_attention, the engine's one attention entry point, taken as a whole: one call
over a ragged batch (decode rows, then several prompt chunks, each over its own sequence's
prefix in the pool) gives every query the dense attention over its sequence's positions up to its
own, and leaves every new K/V in the pool where its table puts it; with no pool (a whole prompt's
prefill) the prompts attend to themselves only. Windows shorter than the sequences, sinks and soft
caps; the decode rows go through the platform's fast path (on this CPU Tandem's kernel where it is
built), the chunks through the dense attention and the pool fold."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tandem_engine import attention
from tandem_engine.attention import _grouped_attention, _window_mask
from tandem_engine.pool_layout import fold, unfold
from tests.unit.test_paged_attention import config

B, WIDTH, BLOCKS = 16, 3, 32  # positions a block, blocks a sequence's table, blocks in the pool
C = 8  # positions a chunk
# (sequence, positions of its queries): two decode rows, then two chunks (one from position 0 with
# nothing before it in the pool, then one over a prefix of 24 positions: a chunk read through
# another chunk's table row, or from another's start, reads the wrong prefix)
QUERIES = [(0, [37]), (1, [5]), (2, list(range(C))), (3, list(range(24, 24 + C)))]


def _case(cfg, seed=0):
    r = np.random.default_rng(seed)
    seqs, kvh, hd = len(QUERIES), cfg.num_kv_heads, cfg.head_dim
    s = WIDTH * B
    dk = r.normal(size=(seqs, s, kvh, hd)).astype(np.float32)
    dv = r.normal(size=(seqs, s, kvh, hd)).astype(np.float32)
    tables = r.permutation(np.arange(1, BLOCKS))[:seqs * WIDTH].reshape(seqs, WIDTH).astype(np.int32)
    pool_k = (r.normal(size=(kvh, BLOCKS, B, hd)) * 30).astype(np.float32)  # garbage where nothing was written
    pool_v = (r.normal(size=(kvh, BLOCKS, B, hd)) * 30).astype(np.float32)
    for seq, positions in QUERIES:  # each sequence's positions before its first query are in the pool
        for p in range(positions[0]):
            pool_k[:, tables[seq, p // B], p % B] = dk[seq, p]
            pool_v[:, tables[seq, p // B], p % B] = dv[seq, p]
    rows = [(seq, p) for seq, positions in QUERIES for p in positions]
    seq_of, pos = np.array([q[0] for q in rows]), np.array([q[1] for q in rows], np.int32)
    q = r.normal(size=(len(rows), 1, cfg.num_heads, hd)).astype(np.float32)
    table = tables[seq_of]
    flat = (table[np.arange(len(rows)), pos // B] * B + pos % B).astype(np.int32)
    return dict(q=q, k=dk[seq_of, pos], v=dv[seq_of, pos], pool_k=pool_k, pool_v=pool_v, flat=flat, table=table,
                pos=pos, seq_of=seq_of, dk=dk, dv=dv, tables=tables)


def _dense(q, dk, dv, pos, cfg, window, sinks):
    """Each query row over its own K/V rows dk, dv [rows, S, KV, hd] up to its position (and
    within the window): the engine's plain dense attention (`_grouped_attention`)."""
    s = dk.shape[1]
    mask = _window_mask(jnp.asarray(pos)[:, None, None], jnp.arange(s)[None, None, :], window or (1 << 30))
    out = _grouped_attention(jnp.asarray(q), jnp.asarray(dk), jnp.asarray(dv), mask, cfg, sinks)
    return np.asarray(out).reshape(q.shape[0], -1)


@pytest.mark.parametrize("window,sinks,softcap", [(0, False, 0.0), (12, False, 0.0), (12, True, 0.0),
                                                  (0, True, 30.0)])
def test_decode_rows_and_chunks_in_one_call_attend_as_dense(window, sinks, softcap):
    cfg = config(heads=4, kv_heads=2, head_dim=64, windows=(window,) if window else (), softcap=softcap,
                 sinks=sinks)
    c = _case(cfg)
    sink = jnp.asarray(np.random.default_rng(1).normal(size=cfg.num_heads).astype(np.float32)) if sinks else None
    out, k_layer, v_layer = attention.ragged_attention(
        jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]), fold(jnp.asarray(c["pool_k"]), 64),
        fold(jnp.asarray(c["pool_v"]), 64), jnp.asarray(c["flat"]), jnp.asarray(c["table"]), jnp.asarray(c["pos"]),
        jnp.asarray(c["pos"] + 1), jnp.zeros((), jnp.float32) if sink is None else sink, cfg=cfg, window=window,
        has_sinks=sinks, chunk=C, chunks=2)
    want = _dense(c["q"], c["dk"][c["seq_of"]], c["dv"][c["seq_of"]], c["pos"], cfg, window, sink)
    np.testing.assert_allclose(np.asarray(out).reshape(len(c["pos"]), -1), want, atol=2e-5, rtol=2e-5)
    # every query's new K/V is in the pool at its position of its sequence's blocks
    got_k, got_v = np.asarray(unfold(k_layer, 64)), np.asarray(unfold(v_layer, 64))
    for seq, p in zip(c["seq_of"], c["pos"]):
        block = c["tables"][seq, p // B]
        np.testing.assert_array_equal(got_k[:, block, p % B], c["dk"][seq, p])
        np.testing.assert_array_equal(got_v[:, block, p % B], c["dv"][seq, p])


@pytest.mark.parametrize("window,sinks", [(0, False), (5, True)])
def test_a_whole_prefill_is_chunks_from_position_zero_with_no_pool(window, sinks):
    cfg = config(heads=4, kv_heads=2, head_dim=16, windows=(window,) if window else (), sinks=sinks)
    r = np.random.default_rng(2)
    prompts, t = 3, 12
    q = r.normal(size=(prompts * t, 1, cfg.num_heads, 16)).astype(np.float32)
    k = r.normal(size=(prompts * t, cfg.num_kv_heads, 16)).astype(np.float32)
    v = r.normal(size=(prompts * t, cfg.num_kv_heads, 16)).astype(np.float32)
    sink = jnp.asarray(r.normal(size=cfg.num_heads).astype(np.float32)) if sinks else None
    out, k_layer, v_layer = attention.ragged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, None, None, None, None, None,
        jnp.zeros((), jnp.float32) if sink is None else sink, cfg=cfg, window=window, has_sinks=sinks, chunk=t,
        chunks=prompts)
    assert k_layer is None and v_layer is None
    seq = np.repeat(np.arange(prompts), t)
    pos = np.tile(np.arange(t), prompts)
    dk, dv = k.reshape(prompts, t, *k.shape[1:]), v.reshape(prompts, t, *v.shape[1:])  # each prompt's own only
    want = _dense(q, dk[seq], dv[seq], pos, cfg, window, sink)
    np.testing.assert_allclose(np.asarray(out).reshape(prompts * t, -1), want, atol=2e-5, rtol=2e-5)


def test_decode_rows_need_a_pool():
    cfg = config(heads=4, kv_heads=2, head_dim=16)
    q = jnp.zeros((3, 1, 4, 16), jnp.float32)
    kv = jnp.zeros((3, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="decode rows with no pool"):
        attention.ragged_attention(q, kv, kv, None, None, None, None, None, None, jnp.zeros(()), cfg=cfg, window=0,
                                   has_sinks=False, chunk=2, chunks=1)
