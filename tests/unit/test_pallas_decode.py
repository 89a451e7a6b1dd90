"""Tandem's Pallas TPU decode kernel (tandem_engine/pallas_decode.py), with no TPU here.

- Run in Pallas's TPU interpret mode on this CPU (it simulates the kernel's DMAs and semaphores,
  fills scratch memory with NaN, and raises on a DMA out of a buffer), it equals the engine's
  gather path (attention.paged_attention) over the same pool: sliding windows shorter than a row
  (crossing block and compute-block boundaries), attention sinks, soft-capping with a query
  scale, head_dim 64 and 128, GQA groups 1, 2 and 4, rows of different lengths, free rows
  (length 0: zeros out), bfloat16 and float32 pools, compute blocks of one pool block and of
  several.
- The pool blocks a row does not attend to are never copied: their table entries point far
  outside the pool, where a copy would raise.
- It compiles for v5e and v6e chips (libtpu's compile-only devices): Mosaic takes head_dim 64, 128
  and 256 with windows and sinks, and float32 pools.
- A head_dim dividing 128 (64, 32) is read from a lane-folded pool [KV, blocks, B * hd / 128, 128]
  (interpreted: equal to the gather path; compiled: the pool read in place).
- Why the engine stores a head_dim-64 pool lane-folded (pool_layout.py): a pool [KV, blocks, B, 64]
  is laid out by the TPU compiler with its block axis minor, so the compiled call would copy the
  pool into the row-major layout the kernel reads; a head_dim of 128 is read in place.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem_engine.aot import libtpu_missing
from tandem_engine.pallas_decode import decode_attention, pages_per_compute_block
from tests.unit.test_paged_attention import config, gather, paged_case


# a kernel whose copies and waits disagree deadlocks in the interpreter (as it would on a chip)
# where the suite's signal timeout cannot reach it: the thread method ends the run instead
deadlock_guard = pytest.mark.timeout(120, method="thread")


def interpreted(q, k, v, lengths, tables, sinks, cfg, *, window, pages):
    from jax.experimental.pallas import tpu as pltpu

    scale = cfg.query_scale or cfg.head_dim ** -0.5
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        try:
            out = decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                   jnp.asarray(tables), None if sinks is None else jnp.asarray(sinks), scale=scale,
                                   softcap=cfg.attn_softcap, window=window, pages=pages)
            return np.asarray(out)
        except Exception:
            pltpu.reset_tpu_interpret_mode_state()  # what the interpreter asks for after a failure
            raise


def _name(case) -> str:
    return (case.values if hasattr(case, "marks") else case)[0]


# lengths: one position, a block exactly, one past, mid-table, a free row, the table full, two
# past a compute block of two pool blocks
LENGTHS = [1, 8, 9, 27, 0, 48, 18]
CASES = [  # name, cfg, window, sinks, pool dtype, pool blocks per compute block
    ("gqa4_hd64", config(8, 2, 64), 0, False, np.float32, 2),
    ("window_hd64", config(8, 2, 64, windows=(11,)), 11, False, np.float32, 2),
    pytest.param("window_one_block_a_step", config(8, 2, 64, windows=(11,)), 11, False, np.float32, 1,
                 marks=pytest.mark.slow),
    ("sinks_hd64", config(8, 2, 64, sinks=True), 0, True, np.float32, 2),
    ("window_sinks_gqa2", config(4, 2, 64, windows=(20,), sinks=True), 20, True, np.float32, 3),
    ("softcap_scale_mha_hd128", config(4, 4, 128, softcap=5.0, query_scale=0.05), 0, False, np.float32, 2),
    ("window_sinks_softcap_gqa4_hd128", config(8, 2, 128, windows=(13,), sinks=True, softcap=5.0), 13, True,
     np.float32, 6),
    ("bf16_window_sinks_hd64", config(8, 1, 64, windows=(11,), sinks=True), 11, True, jnp.bfloat16, 2),
]


@deadlock_guard
@pytest.mark.parametrize("name, cfg, window, sinks, dtype, pages", CASES, ids=[_name(c) for c in CASES])
def test_the_kernel_interpreted_equals_the_gather_path(name, cfg, window, sinks, dtype, pages):
    (q, k, v, lengths, tables), _ = paged_case(cfg, LENGTHS, block_size=8, blocks_per_seq=6, num_blocks=48,
                                               seed=len(name))
    sink = np.random.default_rng(5).normal(size=(cfg.num_heads,)).astype(np.float32) * 2 if sinks else None
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    q = jnp.asarray(q, dtype)  # q in the pool's dtype, as the engine's step
    got = interpreted(q, k, v, lengths, tables, sink, cfg, window=window, pages=pages)
    want = np.asarray(gather(q, k, v, lengths, tables, cfg, window=window, sinks=sink))
    live = lengths > 0
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32)[live], np.asarray(want, np.float32)[live],
                               rtol=tol, atol=tol)
    assert not np.asarray(got)[~live].any()  # a free row: zeros


FOLDED = [  # name, cfg, window, sinks, pool dtype
    ("folded_hd64_window_sinks", config(8, 2, 64, windows=(11,), sinks=True), 11, True, np.float32),
    ("folded_hd64_gqa1_softcap", config(4, 4, 64, softcap=5.0, query_scale=0.2), 0, False, np.float32),
    pytest.param("folded_hd32_window_gqa2", config(4, 2, 32, windows=(13,)), 13, False, np.float32,
                 marks=pytest.mark.slow),
    pytest.param("folded_bf16_hd64_window_sinks", config(8, 1, 64, windows=(11,), sinks=True), 11, True,
                 jnp.bfloat16, marks=pytest.mark.slow),
]


@deadlock_guard
@pytest.mark.parametrize("name, cfg, window, sinks, dtype", FOLDED, ids=[_name(c) for c in FOLDED])
def test_a_lane_folded_pool_equals_the_gather_path(name, cfg, window, sinks, dtype):
    """A head_dim dividing 128 read from a pool stored lane-folded: [KV, blocks, B * hd / 128, 128],
    the row-major bytes of [KV, blocks, B, hd] (row t of a block holds its positions
    t * 128 / hd + c in lanes [c * hd, (c + 1) * hd)). The same result as the gather path over
    the unfolded pool. (Broken on purpose, a lane group's share not masked out of the other
    groups' lanes, or its positions numbered t + c instead of t * fold + c, it fails.)"""
    (q, k, v, lengths, tables), _ = paged_case(cfg, LENGTHS, block_size=8, blocks_per_seq=6, num_blocks=48,
                                               seed=len(name))
    sink = np.random.default_rng(5).normal(size=(cfg.num_heads,)).astype(np.float32) * 2 if sinks else None
    q, k, v = jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    folded = (cfg.num_kv_heads, 48, 8 * cfg.head_dim // 128, 128)
    got = interpreted(q, k.reshape(folded), v.reshape(folded), lengths, tables, sink, cfg, window=window, pages=2)
    want = np.asarray(gather(q, k, v, lengths, tables, cfg, window=window, sinks=sink))
    live = lengths > 0
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32)[live], np.asarray(want, np.float32)[live],
                               rtol=tol, atol=tol)
    assert not np.asarray(got)[~live].any()


@deadlock_guard
def test_blocks_a_row_does_not_attend_to_are_never_copied():
    """Every table entry a row's window has passed, or its length has not reached, points far
    outside the pool: a copy of one would raise in the interpreter. The result is still the gather
    path's over the true table. (Broken on purpose, copying each compute block's every pool block,
    or every compute block from the first, raises an out-of-bounds read here.)"""
    window, bs = 20, 8
    cfg = config(8, 2, 64, windows=(window,), sinks=True)
    (q, k, v, lengths, tables), _ = paged_case(cfg, [40, 64, 0, 5, 21], block_size=bs, blocks_per_seq=8,
                                               num_blocks=40, seed=2)
    far = tables.copy()
    for r, n in enumerate(lengths):
        for j in range(far.shape[1]):
            if (j + 1) * bs <= n - window or j * bs >= n:
                far[r, j] = 10 ** 6
    assert (far == 10 ** 6).sum() > far.size // 2
    sink = np.linspace(-1, 1, cfg.num_heads).astype(np.float32)
    got = interpreted(q, k, v, lengths, far, sink, cfg, window=window, pages=2)
    want = np.asarray(gather(q, k, v, lengths, tables, cfg, window=window, sinks=sink))
    live = lengths > 0
    np.testing.assert_allclose(got[live], want[live], rtol=1e-5, atol=1e-5)


def test_pages_per_compute_block():
    assert pages_per_compute_block(256, 16) == 32  # 512 positions
    assert pages_per_compute_block(6, 16) == 6  # the whole table
    assert pages_per_compute_block(7, 1024) == 1  # one pool block over 512 positions


# ---------------------------------------------------------------------------------------------
# compiled for a TPU (no TPU here)

needs_libtpu = pytest.mark.skipif(libtpu_missing() is not None, reason=str(libtpu_missing()))


def _compile(tpu, topology, heads, kv_heads, hd, *, dtype=jnp.bfloat16, window=0, sinks=False, softcap=0.0,
             rows=8, block_size=16, blocks_per_seq=64, num_blocks=2048, folded=False):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tandem_engine import aot

    mesh = Mesh(np.asarray(aot.topology_devices(tpu, topology)[:1]), ("tp",))
    rep = NamedSharding(mesh, P())

    def s(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=rep)

    pool = s((kv_heads, num_blocks, block_size * hd // 128, 128) if folded else (kv_heads, num_blocks, block_size, hd),
             dtype)
    args = [s((rows, heads, hd), dtype), pool, pool, s((rows,), jnp.int32), s((rows, blocks_per_seq), jnp.int32)]
    if sinks:
        args.append(s((heads,), jnp.float32))

    def attend(q, k, v, lengths, tables, *sink):
        return decode_attention(q, k, v, lengths, tables, sink[0] if sink else None, scale=hd ** -0.5,
                                softcap=softcap, window=window)

    return jax.jit(attend).lower(*args).compile()


def pool_copies(compiled, kv_heads, num_blocks, block_size, hd) -> int:
    """How many ops of the compiled program make a whole pool-shaped array (a relayout copy)."""
    shape = rf"\[{kv_heads},{num_blocks},{block_size},{hd}\]"
    return len(re.findall(rf"= \w+{shape}\S* (copy|transpose|fusion)\(", compiled.as_text()))


@needs_libtpu
@pytest.mark.parametrize("tpu, heads, kv_heads, hd, dtype", [
    ("v5e", 64, 8, 64, jnp.bfloat16),  # gpt-oss 20b's attention: GQA 8, head_dim 64
    pytest.param("v6e", 64, 8, 64, jnp.bfloat16, marks=pytest.mark.slow),  # slow: the fast tier keeps one a kind
    pytest.param("v5e", 8, 2, 64, jnp.float32, marks=pytest.mark.slow),
    ("v5e", 32, 8, 128, jnp.bfloat16),  # Llama 3 8B's
    ("v5e", 8, 4, 256, jnp.bfloat16),  # Gemma 2's head_dim
    pytest.param("v6e", 16, 16, 128, jnp.float32, marks=pytest.mark.slow),  # MHA, float32
])
def test_mosaic_compiles_the_kernel_with_windows_and_sinks(tpu, heads, kv_heads, hd, dtype):
    """The TPU compiler takes the kernel (a Mosaic call in the compiled program, not an XLA
    fallback) with a window, sinks and a soft cap, at every head_dim the engine's families use."""
    compiled = _compile(tpu, "2x2", heads, kv_heads, hd, dtype=dtype, window=128, sinks=True, softcap=30.0)
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1


@needs_libtpu
@pytest.mark.parametrize("tpu, heads, kv_heads, hd, dtype", [
    ("v5e", 64, 8, 64, jnp.bfloat16), pytest.param("v6e", 64, 8, 64, jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("v5e", 8, 2, 64, jnp.float32, marks=pytest.mark.slow),
    pytest.param("v5e", 8, 2, 32, jnp.bfloat16, marks=pytest.mark.slow),
])
def test_a_lane_folded_pool_compiles_and_is_read_in_place(tpu, heads, kv_heads, hd, dtype):
    """A head_dim of 64 (or 32) from a lane-folded pool [KV, blocks, 16 * hd / 128, 128]: Mosaic
    takes it (window, sinks, soft cap), the TPU compiler lays the pool out row-major and the call
    reads it in place (no copy)."""
    compiled = _compile(tpu, "2x2", heads, kv_heads, hd, dtype=dtype, window=128, sinks=True, softcap=30.0,
                        folded=True)
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1
    assert compiled.input_formats[0][1].layout.major_to_minor == (0, 1, 2, 3)
    assert pool_copies(compiled, kv_heads, 2048, 16 * hd // 128, 128) == 0, compiled.as_text()


@needs_libtpu
def test_a_head_dim_of_64_pool_is_copied_for_the_kernel_and_128_is_read_in_place():
    """Why the engine's pool is lane-folded at head_dim 64 (pool_layout.py): the TPU compiler lays a bfloat16
    [KV, blocks, 16, 64] array out with its block axis minor (no lane padding), a Pallas kernel
    reads its operands row-major, so the compiled call copies each pool (K and V) first: a copy
    of the layer's pool per call, every layer of every step (the engine's paged step compiled so
    shows 1.9 GB of temporaries for a 0.5 GB pool). At head_dim 128 the pool is row-major already
    and is read in place (bfloat16 and float32), and so is a lane-folded head_dim-64 pool (the
    test above), which is how the engine stores it. Should the compiler lay the unfolded pool out
    row-major, this fails (and the fold could go)."""
    shape = dict(kv_heads=8, num_blocks=2048, block_size=16)
    hd64 = _compile("v5e", "2x2", 64, 8, 64, window=128, sinks=True, num_blocks=2048)
    hd128 = _compile("v5e", "2x2", 32, 8, 128, num_blocks=2048)
    hd128_f32 = _compile("v5e", "2x2", 32, 8, 128, dtype=jnp.float32, num_blocks=2048)
    assert hd64.input_formats[0][1].layout.major_to_minor == (0, 2, 3, 1)  # blocks minor
    assert pool_copies(hd64, hd=64, **shape) == 2, hd64.as_text()
    assert pool_copies(hd128, hd=128, **shape) == 0, hd128.as_text()
    assert pool_copies(hd128_f32, hd=128, **shape) == 0, hd128_f32.as_text()
