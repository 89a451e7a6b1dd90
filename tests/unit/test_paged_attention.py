"""Decode attention over a paged KV pool: the engine's gather path (attention.paged_attention) and the
Pallas TPU kernel as the engine calls it (tandem_engine/paged_attention.py over pallas_decode.py).

- The gather path (what a CPU runs) equals the engine's dense attention (model.py's
  `_grouped_attention`, the prefill's math) over the same KV written contiguously: random pools
  whose unused blocks hold large garbage, block tables shuffled across the pool (and sharing a
  prefix block between rows), lengths crossing block boundaries, GQA, sliding windows, soft-capping
  with a query scale, attention sinks.
- What the kernel lacks (`kernel_gaps`): the paged step takes the kernel on a TPU only for
  families and dtypes it can serve (`attention.step_kernel`), the gather path otherwise.
- The Pallas TPU kernel, run on this CPU in Pallas's TPU interpret mode (it simulates the kernel's
  DMAs, semaphores and scalar prefetch), equals the gather path, a free row (length 0) giving
  zeros; and the engine's paged decode step with the kernel in it (its TPU branch, interpreted)
  equals the same step on the gather path, for a Llama and for a gpt-oss-like family (windows,
  sinks, experts). tests/unit/test_pallas_decode.py tests the kernel itself case by case.
- The TPU path compiles ahead of time for a v5e slice at Llama-3-8B's attention shapes (libtpu's
  compile-only devices, as tests/unit/test_tpu_compile.py): one chip, and tp 2 where each chip runs
  the kernel over its own heads. Those tests skip only where libtpu is not importable (`make test`
  installs it).
"""
from __future__ import annotations

import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem_engine.aot import libtpu_missing
from tandem_engine.arch import ModelConfig
from tandem_engine import attention, paged
from tandem_engine.attention import _grouped_attention, _window_mask
from tandem_engine.paged_attention import PagedAttention, kernel_gaps
from tandem_engine.pool_layout import fold


def config(heads=8, kv_heads=2, head_dim=16, *, windows=(), softcap=0.0, query_scale=0.0, sinks=False, layers=2):
    return ModelConfig(vocab_size=32, hidden_size=heads * head_dim, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=10000.0, rms_norm_eps=1e-6,
                       windows=windows, attn_softcap=softcap, query_scale=query_scale, sinks=sinks)


def paged_case(cfg, lengths, *, block_size=4, blocks_per_seq=6, num_blocks=40, dtype=np.float32, seed=0,
               share_first_block=False):
    """q, a pool and block tables holding each row's KV in shuffled blocks, and the same KV written
    contiguously per row ([rows, S, KV, hd], S = blocks_per_seq * block_size). Every pool position
    no row uses (and every row position past its length) holds large garbage, so a read the mask
    should have dropped shows."""
    r = np.random.default_rng(seed)
    rows, kvh, hd = len(lengths), cfg.num_kv_heads, cfg.head_dim
    s = blocks_per_seq * block_size
    q = r.normal(size=(rows, cfg.num_heads, hd)).astype(dtype)
    dense_k = (r.normal(size=(rows, s, kvh, hd)) * 30).astype(dtype)  # garbage past each length...
    dense_v = (r.normal(size=(rows, s, kvh, hd)) * 30).astype(dtype)
    for i, n in enumerate(lengths):  # ...and ordinary values inside it
        dense_k[i, :n] = r.normal(size=(n, kvh, hd))
        dense_v[i, :n] = r.normal(size=(n, kvh, hd))
    pool_k = (r.normal(size=(kvh, num_blocks, block_size, hd)) * 30).astype(dtype)
    pool_v = (r.normal(size=(kvh, num_blocks, block_size, hd)) * 30).astype(dtype)
    tables = r.permutation(num_blocks)[:rows * blocks_per_seq].reshape(rows, blocks_per_seq).astype(np.int32)
    if share_first_block:  # every row's block 0 is row 0's (a shared prefix): same KV there
        tables[:, 0] = tables[0, 0]
        dense_k[:, :block_size] = dense_k[0, :block_size]
        dense_v[:, :block_size] = dense_v[0, :block_size]
    for i in range(rows):  # write each row's positions through its table
        for j in range(blocks_per_seq):
            part = slice(j * block_size, (j + 1) * block_size)
            pool_k[:, tables[i, j]] = np.swapaxes(dense_k[i, part], 0, 1)
            pool_v[:, tables[i, j]] = np.swapaxes(dense_v[i, part], 0, 1)
    return (q, pool_k, pool_v, np.asarray(lengths, np.int32), tables), (dense_k, dense_v)


def dense_attention(q, dense_k, dense_v, lengths, cfg, *, window=0, sinks=None):
    """The engine's dense attention (the prefill's `_grouped_attention`) of each row's query at
    position length - 1 over its contiguous KV."""
    s = dense_k.shape[1]
    qpos = jnp.asarray(lengths)[:, None, None] - 1
    mask = _window_mask(qpos, jnp.arange(s)[None, None, :], window or (1 << 30))  # [rows, 1, S]
    out = _grouped_attention(jnp.asarray(q)[:, None], jnp.asarray(dense_k), jnp.asarray(dense_v), mask, cfg,
                             None if sinks is None else jnp.asarray(sinks))
    return np.asarray(out).reshape(q.shape)


def gather(q, k, v, lengths, tables, cfg, *, window=0, sinks=None):
    """The engine's gather path (attention.paged_attention) in the kernel's terms: q [rows, H, hd],
    lengths (each row's query at length - 1). Returns [rows, H, hd]."""
    q = jnp.asarray(q)
    # the pool as the engine stores it (pool_layout.py: lane-folded where the block size allows)
    k, v = fold(jnp.asarray(k), cfg.head_dim), fold(jnp.asarray(v), cfg.head_dim)
    out = attention.paged_attention(q[:, None], k, v, jnp.asarray(tables),
                                jnp.asarray(lengths) - 1, cfg, window=window,
                                sinks=None if sinks is None else jnp.asarray(sinks))
    return out.reshape(q.shape)


LENGTHS = [1, 4, 5, 9, 24, 13]  # one position, a block exactly, one past, crossing two, the table full


@pytest.mark.parametrize("name, cfg, window, sinks", [
    ("gqa", config(), 0, False),
    ("mha", config(heads=4, kv_heads=4), 0, False),
    ("window", config(windows=(6, 0)), 6, False),
    ("softcap_and_scale", config(softcap=5.0, query_scale=0.3), 0, False),
    ("sinks", config(sinks=True), 0, True),
    ("sinks_and_window", config(sinks=True, windows=(3, 0)), 3, True),
])
@pytest.mark.parametrize("block_size", [4, 64])  # 4: the whole table in one piece; 64: a piece per block
def test_gather_equals_dense_attention_over_the_same_kv(name, cfg, window, sinks, block_size):
    args, (dk, dv) = paged_case(cfg, LENGTHS, seed=len(name), block_size=block_size)
    sink = np.random.default_rng(7).normal(size=(cfg.num_heads,)).astype(np.float32) * 2 if sinks else None
    got = np.asarray(jax.jit(lambda *a: gather(*a, cfg, window=window, sinks=sink))(*args))
    want = dense_attention(args[0], dk, dv, args[3], cfg, window=window, sinks=sink)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_gather_reads_a_block_shared_between_rows():
    """Rows share their first block (a cached prefix: one pool block in every table), on a
    windowed layer and a global one."""
    cfg = config(windows=(7, 0))
    args, (dk, dv) = paged_case(cfg, LENGTHS, share_first_block=True, seed=3)
    for window in (7, 0):
        got = np.asarray(jax.jit(lambda *a, w=window: gather(*a, cfg, window=w))(*args))
        np.testing.assert_allclose(got, dense_attention(args[0], dk, dv, args[3], cfg, window=window),
                                   rtol=2e-5, atol=2e-5)


def test_shapes_that_disagree_with_the_model_are_refused():
    cfg = config()
    (q, k, v, lengths, tables), _ = paged_case(cfg, [3, 5])
    attn = PagedAttention(cfg)
    with pytest.raises(ValueError, match="KV heads"):
        attn(q, k[:1], v[:1], lengths, tables)
    with pytest.raises(ValueError, match="lengths"):
        attn(q, k, v, lengths[:1], tables)


# ---------------------------------------------------------------------------------------------
# what the kernel serves


LLAMA = config(32, 8, 128, layers=4)
GEMMA2 = config(8, 4, 256, windows=(4096, 0) * 2, softcap=50.0, query_scale=256 ** -0.5, layers=4)
GPT_OSS_128 = config(64, 8, 128, windows=(128, 0) * 2, sinks=True, layers=4)  # gpt-oss's traits at head_dim 128
GPT_OSS = config(64, 8, 64, windows=(128, 0) * 2, sinks=True, layers=4)


def test_the_step_takes_the_kernel_only_for_what_it_serves(caplog):
    """head_dim 128 and 256 from the pool as it is; 64 (gpt-oss, the built-in model) and 32 from
    the lane-folded pool (pool_layout.py) at the engine's block size of 16; not a head_dim of 96
    (it does not divide 128: not folded), nor 64 over blocks of an odd size (not folded either),
    nor an fp8 pool."""
    caplog.set_level(logging.DEBUG, logger="tandem_engine.attention")
    for cfg, dtype, bs in [(LLAMA, jnp.bfloat16, 16), (LLAMA, jnp.float32, 16), (GEMMA2, jnp.bfloat16, 16),
                           (GPT_OSS_128, jnp.bfloat16, 16), (GPT_OSS, jnp.bfloat16, 16), (GPT_OSS, jnp.float32, 32),
                           (config(8, 2, 64), jnp.bfloat16, 16), (config(8, 2, 32), jnp.bfloat16, 16)]:
        assert kernel_gaps(cfg, dtype, bs) == []
        assert attention.step_kernel(cfg, jnp.dtype(dtype), bs) == PagedAttention(cfg)
    for cfg, dtype, bs, needs in [(config(8, 2, 96), jnp.bfloat16, 16, ["head_dim 96", "does not divide 128"]),
                                  (GPT_OSS, jnp.bfloat16, 15, ["head_dim 64", "block size 15"]),
                                  (LLAMA, jnp.float8_e4m3fn, 16, ["float8_e4m3fn pool"])]:
        gaps = "; ".join(kernel_gaps(cfg, dtype, bs))
        assert all(n in gaps for n in needs), gaps
        caplog.clear()
        assert attention.step_kernel(cfg, jnp.dtype(dtype), bs) is None
        # said, not silent: what the kernel lacks is logged (a warning where JAX's backend is a TPU)
        assert any(needs[0] in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# the Pallas kernel itself, interpreted on this CPU


@pytest.mark.parametrize("name, cfg, window", [
    ("groups4", config(8, 2, 128), 0),
    ("groups8_softcap_scale", config(16, 2, 128, softcap=5.0, query_scale=0.05), 0),
    ("window_sinks", config(8, 2, 128, windows=(20, 0), sinks=True), 20),
    ("folded_hd64_window_sinks", config(8, 2, 64, windows=(20, 0), sinks=True), 20),  # a lane-folded pool
])
def test_pallas_kernel_interpreted_equals_the_gather_path(name, cfg, window):
    from jax.experimental.pallas import tpu as pltpu

    lengths = [1, 16, 17, 40, 0, 64]  # one, a page, one past, mid-block, a free row, the table full
    (q, k, v, lengths, tables), _ = paged_case(cfg, lengths, block_size=16, blocks_per_seq=4, num_blocks=32,
                                               seed=len(name))
    tables[1, 2:] = 10 ** 6  # entries past row 1's length: anything (clamped, never read)
    # a bf16 pool; q in float32 (the kernel reads K and V in q's dtype), so its output is float32 too
    q, k, v = jnp.asarray(q), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    sinks = np.linspace(-2, 2, cfg.num_heads).astype(np.float32) if cfg.sinks else None
    pool = (fold(k, cfg.head_dim), fold(v, cfg.head_dim))  # as the engine stores it (pool_layout.py)
    assert not kernel_gaps(cfg, jnp.bfloat16, 16)
    kernel = PagedAttention(cfg)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        got = np.asarray(kernel(q, *pool, lengths, tables, window=window, sinks=sinks))
    # the gather path over the same bf16 values held in float32
    want = np.asarray(gather(q, k.astype(jnp.float32), v.astype(jnp.float32), lengths,
                             np.clip(tables, 0, 31), cfg, window=window, sinks=sinks))
    live = lengths > 0
    np.testing.assert_allclose(got[live], want[live], rtol=1e-4, atol=1e-4)
    assert not got[4].any()  # a free row: zeros


# ---------------------------------------------------------------------------------------------
# the TPU path compiled ahead of time (no TPU here)

needs_libtpu = pytest.mark.skipif(libtpu_missing() is not None, reason=str(libtpu_missing()))


@needs_libtpu
@pytest.mark.parametrize("tpu, topology, tp, rows, block_size", [
    ("v5e", "2x2", 1, 8, 16), ("v5e", "2x2", 1, 32, 32), ("v5e", "2x2", 2, 8, 16),
    ("v6e", "2x2", 1, 8, 16), ("v5p", "2x2x1", 1, 8, 16),
])
def test_pallas_path_compiles_for_tpu_at_llama_8b_shapes(tpu, topology, tp, rows, block_size):
    """Llama-3-8B's attention (32 heads, 8 KV heads, head_dim 128) over a bf16 pool with 256 pages
    a sequence, compiled by the TPU compiler for a v5e slice (and one v6e and one v5p
    configuration): the Mosaic kernel is in the compiled program (not an XLA fallback) and, at
    tp 2, each chip holds half the pool (its KV heads). (On a v5p, two cores a chip, the kernel's
    grid runs in order on one of them: its DMA pipeline crosses grid steps.)"""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tandem_engine import aot

    devices = aot.topology_devices(tpu, topology)
    mesh = Mesh(np.asarray(devices[:tp]), ("tp",))
    assert not kernel_gaps(LLAMA, jnp.bfloat16, block_size)
    attn = PagedAttention(LLAMA, mesh=mesh)
    pages_per_seq, num_blocks = 256, 4096
    spec = {"q": P(None, "tp", None), "pool": P("tp", None, None, None), "rep": P()}

    def s(shape, dtype, kind):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec[kind]))

    pool = s((8, num_blocks, block_size, 128), jnp.bfloat16, "pool")
    lowered = jax.jit(attn.__call__).lower(s((rows, 32, 128), jnp.bfloat16, "q"), pool, pool,
                                           s((rows,), jnp.int32, "rep"), s((rows, pages_per_seq), jnp.int32, "rep"))
    compiled = lowered.compile()
    assert "tpu_custom_call" in compiled.as_text()
    pool_bytes = 8 * num_blocks * block_size * 128 * 2
    mem = compiled.memory_analysis()
    assert 2 * pool_bytes // tp <= mem.argument_size_in_bytes <= 2 * pool_bytes // tp + (1 << 20), mem


@needs_libtpu
def test_on_tpu_the_pool_must_be_one_buffer_per_layer():
    """The kernel reads a layer's pool in place only when that layer's pool is a buffer of its
    own: a pool stacked [L, KV, blocks, block_size, hd] and sliced per layer (`k_pool[i]`) makes
    XLA copy the whole layer's pool for the Mosaic call at every layer of every step (a custom
    call cannot read a slice in place). The compiler's temporaries show it: about nothing for
    per-layer buffers, copies of the layers' K and V pools for the stacked one (measured: 448 MiB
    of temporaries for 4 layers of 64 MiB each, K and V)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tandem_engine import aot

    mesh = Mesh(np.asarray(aot.topology_devices("v5e", "2x2")[:1]), ("tp",))
    attn = PagedAttention(LLAMA, mesh=mesh)
    rep = NamedSharding(mesh, P())
    layers, kv_layer = 4, (8, 2048, 16, 128)
    layer_bytes = int(np.prod(kv_layer)) * 2

    def s(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    small = (s((8, 32, 128)), s((8,), jnp.int32), s((8, 256), jnp.int32))

    def per_layer(q, lengths, table, ks, vs):
        return jnp.stack([attn(q, k, v, lengths, table) for k, v in zip(ks, vs)])

    def stacked(q, lengths, table, k, v):
        return jnp.stack([attn(q, k[i], v[i], lengths, table) for i in range(layers)])

    own = jax.jit(per_layer).lower(*small, (s(kv_layer),) * layers, (s(kv_layer),) * layers).compile()
    sliced = jax.jit(stacked).lower(*small, s((layers, *kv_layer)), s((layers, *kv_layer))).compile()
    assert own.memory_analysis().temp_size_in_bytes < layer_bytes // 16
    assert sliced.memory_analysis().temp_size_in_bytes >= 2 * layer_bytes  # at least a layer's K and V copies


# ---------------------------------------------------------------------------------------------
# the paged decode step with the kernel in it (what a TPU compile runs), interpreted on this CPU


GPT_OSS_LIKE = {"family": "gpt_oss", "hf_config": dict(  # windows (of 20: shorter than row 2), sinks, experts, biases
    sliding_window=20, layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
    num_experts_per_tok=2, attention_bias=True)}


@pytest.mark.parametrize("family, hd", [("llama", 128), ("gpt_oss", 64),
                                        pytest.param("gpt_oss", 128, marks=pytest.mark.slow)])  # slow: 12 s
def test_the_paged_step_with_the_kernel_interpreted_equals_its_gather_step(monkeypatch, family, hd):
    """paged.decode_forward_paged as a TPU compile runs it (its `platform_dependent` taken at the "tpu"
    branch, the kernel in Pallas's TPU interpret mode) against the same step on the gather path, on
    a bf16 model with head_dim 128, Llama-shaped or gpt-oss-like (a window of 20 on its first layer,
    sinks, experts), and gpt-oss-like with gpt-oss's head_dim of 64 (the pool lane-folded, [KV,
    blocks, 8, 128]: the kernel reads it as the engine writes it): rows at different lengths over
    shuffled blocks (crossing a block boundary, the table full), one free row (length 0, writing the
    null block). The same K/V written, and the same logits and greedy tokens up to the two paths'
    rounding."""
    import dataclasses

    from jax.experimental.pallas import tpu as pltpu

    from tandem_core.models import PRESETS
    from tandem_engine import attention
    from tandem_engine.model import config_from_info
    from tandem_engine.weights import init_params

    info = dataclasses.replace(PRESETS["tiny"], hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=hd, max_position_embeddings=256,
                               extra=GPT_OSS_LIKE if family == "gpt_oss" else {})
    cfg = config_from_info(info)
    assert attention.step_kernel(cfg, jnp.dtype(jnp.bfloat16), 16) is not None
    assert (cfg.windows, cfg.sinks) == (((20, 0), True) if family == "gpt_oss" else ((), False))
    params = init_params(info, "bfloat16")
    bs, nb, blocks, rows = 16, 4, 24, 4
    r = np.random.default_rng(7)
    pool = [paged.paged_pool(1, 2, blocks, bs, hd, jnp.bfloat16)[0][0] for _ in range(4)]  # the engine's shape
    assert pool[0].shape == ((2, blocks + 1, 8, 128) if hd == 64 else (2, blocks + 1, bs, hd))
    pool = [jnp.asarray(r.normal(size=p.shape), jnp.bfloat16) for p in pool]
    k_pool, v_pool = tuple(pool[:2]), tuple(pool[2:])
    table = np.zeros((rows, nb), np.int32)
    table[:3] = r.permutation(np.arange(1, blocks + 1))[:3 * nb].reshape(3, nb)  # row 3: free (null blocks)
    positions = jnp.asarray([5, 16, 63, 9], jnp.int32)  # mid-block, a block's first row, the table full
    active = jnp.asarray([True, True, True, False])
    tokens = jnp.asarray([3, 7, 11, 0], jnp.int32)

    def step():
        return jax.jit(partial(paged.decode_forward_paged, cfg=cfg, max_len=nb * bs))(
            params, tokens, positions, k_pool, v_pool, jnp.asarray(table), active=active)

    want_logits, want_k, want_v = step()
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, tpu, **_: tpu(*args))
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        got_logits, got_k, got_v = step()
    # layer 0's new K/V come before any attention: the same bits; layer 1's follow layer 0's output
    # (the null block aside: the free row's write there follows its attention, zeros from the
    # kernel, whatever the null block held from the gather)
    assert np.array_equal(np.asarray(got_k[0]), np.asarray(want_k[0]))
    assert np.array_equal(np.asarray(got_v[0]), np.asarray(want_v[0]))
    for got, want in ((got_k[1], want_k[1]), (got_v[1], want_v[1])):
        np.testing.assert_allclose(np.asarray(got, np.float32)[:, 1:], np.asarray(want, np.float32)[:, 1:],
                                   rtol=0.05, atol=0.05)
    got, want = np.asarray(got_logits, np.float32)[:3], np.asarray(want_logits, np.float32)[:3]
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).all()
