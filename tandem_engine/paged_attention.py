"""The Pallas TPU decode attention as the engine's paged decode step calls it on a TPU.

The pool of one layer (the layout paged.py holds and the kernel reads):

    k_pages, v_pages  [num_kv_heads, num_blocks, block_size / f, head_dim * f] (lane-folded,
                      pool_layout.py: f = 128 / head_dim for a head_dim dividing 128, else 1)
    block_tables      int32 [rows, blocks_per_seq]: row r's positions [j*block_size, (j+1)*block_size)
                      live in pool block block_tables[r, j]; entries a row does not read may hold
                      any value (clamped into [0, num_blocks) here; the kernel never copies them)
    lengths           int32 [rows]: how many positions row r attends to, i.e. its new token's
                      position + 1 with that token's K/V already written, at most blocks_per_seq *
                      block_size; 0 is a free row (zeros out)
    q                 [rows, num_heads, head_dim], num_heads = groups * num_kv_heads (GQA: query
                      head h reads KV head h // groups, as model.py groups them)

`PagedAttention(cfg)(q, k_pages, v_pages, lengths, block_tables, window=, sinks=)` returns
[rows, num_heads, head_dim] in q's dtype; it is a frozen, hashable value (a static argument of a
jitted core, as `cfg` is). It runs Tandem's own kernel, pallas_decode.decode_attention (one program
per row; a layer's sliding window skips the compute blocks the window has passed, unread; sinks,
soft-capping and the query scale as the gather path defines them; its module docstring says how).
Under tensor parallelism (`mesh` with a "tp" axis over > 1 chips) the kernel runs per chip in a
`shard_map` over the chip's KV heads, its query heads and their sinks; a Mosaic call is not split by
XLA's partitioner. (The engine's step does this itself: attention.ragged_attention runs per chip with
the chip's head counts and calls this with no mesh.) Hold the pool as one buffer per layer for it,
as the engine's paged pool is (paged.py): a pool stacked [L, KV, blocks, block_size, hd] and sliced
per layer (`k_pool[i]`) makes XLA copy that layer's whole pool for the call, at every layer of
every step (compiled for v5e: 448 MiB of temporaries for 4 layers of 64 MiB pools, against 0.25 MiB
with per-layer buffers; the test holds this).

The engine's paged decode step (paged.decode_forward_paged) calls this kernel on a TPU through
`attention.step_kernel` (`kernel_gaps` decides, when the step is compiled for a platform:
`jax.lax.platform_dependent`), and its gather path (attention.paged_attention) or the CPU kernel
(cpu_kernels) elsewhere and for the families the kernel cannot serve.

It replaces JAX's stock kernel (jax.experimental.pallas.ops.tpu.paged_attention), which had no
window, no sinks, refused a head_dim of 64 and read K and V as bfloat16. A head_dim under 128
that divides it (gpt-oss, the built-in model, Llama 3.2 1B, Qwen2.5 0.5B: 64) is served from the
engine's pool as it stores it, lane-folded [KV, blocks, B * hd / 128, 128] (pool_layout.py; the
TPU lays that out row-major and the call reads it in place: tests/unit/test_paged_step_tpu.py).
What is still not served, so which families take the gather path on a TPU (logged as a warning):
- a head_dim that neither divides 128 nor is a multiple of it (96, 80: no family Tandem serves
  today), or a head_dim of 64 over blocks of an odd number of positions: the pool is not folded
  then, and the TPU compiler lays a [KV, blocks, B, hd] pool out with its block axis minor (no
  lanes padded), which a Pallas kernel (it reads operands row-major) could not read in place:
  each call would copy the layer's whole pool (the engine's step compiled for v5e with the kernel
  forced on an unfolded head_dim of 64: 1.9 GB of temporaries for a 0.5 GB pool, against 3 MB
  at 128; test_pallas_decode.py holds the copy);
- a pool of another dtype than bfloat16 or float32 (fp8: its TPU layout and casts unchecked).
Everything else runs the kernel where compiled for a TPU: every family Tandem serves (llama,
qwen2 with or without windows, qwen3, mistral, gemma2, gemma3 at head_dim 256, mixtral,
qwen3_moe, gpt_oss and the built-in model at 64) with bfloat16 or float32 pools.

Nothing here ran on a TPU: tests/unit/test_pallas_decode.py and test_paged_attention.py run the
kernel in Pallas's TPU interpret mode on the CPU against the engine's gather path (alone, and
inside the engine's paged step) and compile it ahead of time for v5e, v6e and v5p chips (libtpu's
compile-only devices); tests/unit/test_paged_step_tpu.py compiles the engine's whole paged step
for a v5e chip with the kernel in it, each layer's buffer read in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tandem_engine.arch import ModelConfig
from tandem_engine.pallas_decode import COMPUTE_BLOCK_TOKENS, decode_attention, pages_per_compute_block
from tandem_engine.pool_layout import lane_fold
from tandem_engine.sharding import AXIS

__all__ = ["COMPUTE_BLOCK_TOKENS", "PagedAttention", "kernel_gaps", "pages_per_compute_block"]

POOL_DTYPES = ("bfloat16", "float32")  # what the kernel reads (and was compiled and interpreted for)


def kernel_gaps(cfg: ModelConfig, dtype, block_size: int) -> list[str]:
    """What this family (at this pool dtype, over a pool of `block_size`-position blocks) needs
    that the Pallas TPU kernel lacks; empty: it can run the kernel."""
    gaps = []
    if cfg.head_dim % 128 and lane_fold(cfg.head_dim, block_size) == 1:
        why = (f"the block size {block_size} is not a multiple of {128 // cfg.head_dim}, so the pool is not "
               f"lane-folded" if 128 % cfg.head_dim == 0 else "it does not divide 128, so the pool is not lane-folded")
        gaps.append(f"head_dim {cfg.head_dim} ({why} (pool_layout.py): a pool [KV, blocks, B, {cfg.head_dim}] is "
                    f"laid out on a TPU with its block axis minor, not row-major as a Pallas kernel reads it, so each "
                    f"call would copy the layer's whole pool)")
    if jnp.dtype(dtype).name not in POOL_DTYPES:
        gaps.append(f"a {jnp.dtype(dtype).name} pool (the kernel reads bfloat16 or float32)")
    return gaps


@dataclass(frozen=True)
class PagedAttention:
    """Tandem's Pallas decode attention over a paged pool (pallas_decode.decode_attention; see the
    module docstring for the shapes), for a family `kernel_gaps` finds nothing missing in.
    Hashable: a static argument of a jitted core."""

    cfg: ModelConfig
    mesh: Mesh | None = None  # tp > 1: the kernel runs per chip over its own heads

    def __call__(self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                 block_tables: jax.Array, *, window: int = 0, sinks: jax.Array | None = None) -> jax.Array:
        """q [rows, H, hd]; k_pages, v_pages [KV, num_blocks, block_size, hd] (or lane-folded: see
        pallas_decode); lengths int32 [rows];
        block_tables int32 [rows, blocks_per_seq]; `window` the layer's (0: none); `sinks` [H]
        float32 where the family has them. Returns [rows, H, hd] in q's dtype (zeros for a row of
        length 0)."""
        q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
        _check_shapes(self.cfg, q, k_pages, v_pages, lengths, block_tables)
        if (sinks is not None) != bool(self.cfg.sinks):
            raise ValueError(f"sinks {'given' if sinks is not None else 'missing'}: the model "
                             f"{'has' if self.cfg.sinks else 'has no'} attention sinks")
        cfg = self.cfg
        scale = cfg.query_scale or cfg.head_dim ** -0.5

        def run(q, k, v, lengths, tables, *sinks):
            return decode_attention(q, k, v, lengths, tables, sinks[0] if sinks else None, scale=scale,
                                    softcap=cfg.attn_softcap, window=window)

        # a table entry no row reads may hold anything (the kernel never copies it); clamped anyway, so
        # an entry a row does read (a caller's mistake) stays inside the pool (a DMA out of it faults)
        tables = jnp.clip(jnp.asarray(block_tables, jnp.int32), 0, k_pages.shape[1] - 1)
        args = (q, k_pages, v_pages, jnp.asarray(lengths, jnp.int32), tables)
        if sinks is not None:
            args += (jnp.asarray(sinks, jnp.float32),)
        if self.mesh is None or self.mesh.shape.get(AXIS, 1) == 1:
            return run(*args)
        heads, pool, rep = P(None, AXIS, None), P(AXIS, None, None, None), P()
        specs = (heads, pool, pool, rep, rep) + ((P(AXIS),) if sinks is not None else ())
        return jax.shard_map(run, mesh=self.mesh, in_specs=specs, out_specs=heads, check_vma=False)(*args)


def _check_shapes(cfg: ModelConfig, q, k_pages, v_pages, lengths, block_tables) -> None:
    rows, heads, hd = q.shape
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be "
                         f"[num_kv_heads, num_blocks, block_size, head_dim]")
    folded = hd < 128 and 128 % hd == 0 and k_pages.shape[3] == 128  # pallas_decode's lane-folded pool
    if (heads, hd) != (cfg.num_heads, cfg.head_dim) or k_pages.shape[0] != cfg.num_kv_heads \
            or (k_pages.shape[3] != hd and not folded):
        raise ValueError(f"q {q.shape} / pool {k_pages.shape} disagree with the model: {cfg.num_heads} heads, "
                         f"{cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}")
    if lengths.shape != (rows,) or block_tables.ndim != 2 or block_tables.shape[0] != rows:
        raise ValueError(f"lengths {lengths.shape} must be [rows] and block_tables {block_tables.shape} "
                         f"[rows, blocks_per_seq] for rows={rows}")
