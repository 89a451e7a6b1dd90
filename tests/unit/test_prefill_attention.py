"""The prefill's attention: head-major grouped attention and its causal blocked form equal plain
attention (K/V heads repeated, one softmax over all keys: reference_forward's way) with windows,
sinks and bfloat16, and the blocked form computes only the scores at or below each block's last
row (counted in the traced program's dot shapes, not timed)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem_engine.attention import _grouped_attention, _window_mask, causal_attention
from tandem_engine.model import ModelConfig

CFG = ModelConfig(vocab_size=8, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6)


def plain(q, k, v, mask, cfg, sinks=None):
    """q [B, T, H, hd], k, v [B, S, KV, hd], mask [B, T, S]: [B, T, H*hd] in float32."""
    groups = cfg.num_heads // cfg.num_kv_heads
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(cfg.head_dim)
    s = jnp.where(mask[:, None], s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    else:
        p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", p, v)
    return out.reshape(*out.shape[:2], -1)


def inputs(b, t, s, dtype, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, CFG.num_heads, CFG.head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((b, s, CFG.num_kv_heads, CFG.head_dim)), dtype) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(CFG.num_heads), jnp.float32)
    return q, k, v, sinks


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("t,block", [(256, 64), (100, 32), (16, 64)])
@pytest.mark.parametrize("window,with_sinks", [(0, False), (24, True)])
def test_causal_blocks_equal_plain_attention(t, block, window, with_sinks, dtype, tol):
    """Blocks dividing T, a last block shorter than the others (100 = 3 x 32 + 4), a prompt
    within one block; a global layer, and a windowed one with sinks (gpt-oss's)."""
    b = 2
    q, k, v, sinks = inputs(b, t, t, dtype, seed=t + block + window)
    pos = jnp.arange(t)
    mask = _window_mask(pos[:, None], pos[None, :], jnp.int32(window or 1 << 30))[None]
    s = sinks if with_sinks else None
    got = jax.jit(causal_attention, static_argnames=("cfg", "block"))(q, k, v, mask, CFG, s, block=block)
    want = plain(q, k, v, jnp.broadcast_to(mask, (b, t, t)), CFG, s)
    assert got.shape == (b, t, CFG.num_heads * CFG.head_dim) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_partials_give_each_rows_log_sum_exp_for_a_merge(with_sinks):
    """`partials=True` (the ragged chunk's own part, attention.chunk_attention): the head-major output
    and each row's log-sum-exp of its scaled, masked scores (and sink), in blocks as whole."""
    b, t, window = 1, 40, 12
    q, k, v, sinks = inputs(b, t, t, jnp.float32, seed=3)
    pos = jnp.arange(t)
    mask = _window_mask(pos[:, None], pos[None, :], jnp.int32(window))[None]
    s = sinks if with_sinks else None
    out, lse = causal_attention(q, k, v, mask, CFG, s, block=16, partials=True)
    kvh, groups, hd = CFG.num_kv_heads, CFG.num_heads // CFG.num_kv_heads, CFG.head_dim
    assert out.shape == (b, kvh, groups, t, hd) and lse.shape == (b, kvh, groups, t)
    token_major = np.transpose(np.asarray(out), (0, 3, 1, 2, 4)).reshape(b, t, -1)
    np.testing.assert_allclose(token_major, np.asarray(plain(q, k, v, mask, CFG, s)), rtol=2e-5, atol=2e-5)
    qh = np.asarray(q).reshape(b, t, kvh, groups, hd)
    scores = np.einsum("btkgd,bskd->bkgts", qh, np.asarray(k)) / np.sqrt(hd)
    scores = np.where(np.asarray(mask)[:, None, None], scores, -np.inf)
    if with_sinks:
        sink = np.broadcast_to(np.asarray(sinks).reshape(1, kvh, groups, 1, 1), (*scores.shape[:-1], 1))
        scores = np.concatenate([scores, sink], axis=-1)
    want = np.log(np.sum(np.exp(scores - scores.max(-1, keepdims=True)), -1)) + scores.max(-1)
    np.testing.assert_allclose(np.asarray(lse), want, rtol=1e-5, atol=1e-5)


def test_grouped_attention_over_a_longer_key_buffer():
    """The suffix of a prompt over a cached prefix: T queries at positions 40.. over S = 96 keys."""
    t, s, start = 24, 96, 40
    q, k, v, sinks = inputs(1, t, s, jnp.float32, seed=5)
    mask = (jnp.arange(s)[None, :] <= (start + jnp.arange(t))[:, None])[None]
    for sk in (None, sinks):
        np.testing.assert_allclose(np.asarray(_grouped_attention(q, k, v, mask, CFG, sk)),
                                   np.asarray(plain(q, k, v, mask, CFG, sk)), rtol=2e-5, atol=2e-5)


def score_elements(fn, t: int, **kw) -> int:
    """Score entries the traced attention computes: the outputs of its query x key dots."""
    q, k, v, _ = inputs(1, t, t, jnp.float32, seed=0)
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a, CFG, None, **kw))(q, k, v, mask)
    sizes = [int(np.prod(e.outvars[0].aval.shape)) for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    return sum(sizes[0::2])  # scores, values, scores, values, ...


def test_blocks_skip_the_scores_above_the_diagonal():
    """4 blocks of 64 rows: 1 + 2 + 3 + 4 of the 16 [64 x 64] tiles of every head's [256, 256]."""
    full = CFG.num_heads * 256 * 256
    assert score_elements(_grouped_attention, 256) == full
    assert score_elements(causal_attention, 256, block=64) == full * 10 // 16


def test_rope_tables_computed_once_rotate_as_rope_does():
    """The prefill's per-layer tables (computed before the layer scan) give rope's own rotation,
    for a global layer and a local one with its own frequencies (Gemma 3's)."""
    from tandem_engine.model import _layer_rope_tables, layer_consts, rope

    cfg = ModelConfig(vocab_size=8, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      rope_theta=10000.0, rms_norm_eps=1e-6, local_rope_theta=10.0, windows=(4, 0))
    positions = (7 + jnp.arange(20))[None]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 20, 4, 8)), jnp.float32)
    for local in (10.0, 0.0):  # per-layer tables; one table for every layer
        c = cfg._replace(local_rope_theta=local)
        consts = layer_consts(c)
        stacked, shared = _layer_rope_tables(positions, consts, c)
        assert (stacked is None) == (not local) and (shared is None) == bool(local)
        for i in range(c.num_layers):
            want = rope(x, positions, consts.inv_freq[i], consts.rope_scale[i])
            tables = shared if shared is not None else (stacked[0][i], stacked[1][i])
            np.testing.assert_array_equal(np.asarray(rope(x, positions, None, tables=tables)), np.asarray(want))
        assert np.allclose(np.asarray(consts.inv_freq[0]), np.asarray(consts.inv_freq[1])) == (not local)
