"""The Pallas TPU paged-attention kernel as the engine's paged decode step calls it on a TPU.

The pool of one layer (the layout JAX's Pallas TPU kernel reads):

    k_pages, v_pages  [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables      int32 [rows, blocks_per_seq]: row r's positions [j*block_size, (j+1)*block_size)
                      live in pool block block_tables[r, j]; entries a row does not reach may hold
                      any value (they are clamped into [0, num_blocks): the kernel DMAs whole
                      compute blocks, so an index out of the pool would fault on a TPU)
    lengths           int32 [rows]: how many positions row r attends to, i.e. its new token's
                      position + 1 with that token's K/V already written, at most blocks_per_seq *
                      block_size; 0 is a free row (zeros out)
    q                 [rows, num_heads, head_dim], num_heads = groups * num_kv_heads (GQA: query
                      head h reads KV head h // groups, as model.py groups them)

`PagedAttention(cfg)(q, k_pages, v_pages, lengths, block_tables)` returns [rows, num_heads,
head_dim] in q's dtype; it is a frozen, hashable value (a static argument of a jitted core, as
`cfg` is). It runs `jax.experimental.pallas.ops.tpu.paged_attention.paged_attention`, imported and
traced only when called, so a CPU pod never builds it. The kernel takes no softmax scale, so q is
scaled in float32 first (`query_scale` or head_dim ** -0.5), and the kernel's
`attn_logits_soft_cap` is the family's `attn_softcap` (the same tanh after the scale).
`pages_per_compute_block` is the largest divisor of the table's width whose compute block holds at
most `COMPUTE_BLOCK_TOKENS` positions (a guess: never timed on a TPU). `megacore_mode` stays None
unless asked (the kernel's own advice: set only where megacore is on, else it may hang). Under
tensor parallelism (`mesh` with a "tp" axis over > 1 chips) the kernel runs per chip in a
`shard_map` over the chip's KV heads and its query heads; a Mosaic call is not split by XLA's
partitioner. A row of length 0 comes back as zeros (the kernel skips it and leaves its output
unwritten). Hold the pool as one buffer per layer for it, as the engine's paged pool is
(paged.py): a pool stacked [L, KV, blocks, block_size, hd] and sliced per layer (`k_pool[i]`)
makes XLA copy that layer's whole pool for the call, at every layer of every step (compiled for
v5e: 448 MiB of temporaries for 4 layers of 64 MiB pools, against 0.25 MiB with per-layer
buffers; the test holds this).

The engine's paged decode step (paged.decode_forward_paged) calls this kernel on a TPU through
`paged.step_kernel` (`kernel_gaps` decides, when the step is compiled for a platform:
`jax.lax.platform_dependent`), and its own gather path (paged.paged_attention, tuned for the CPU)
elsewhere and for the families the kernel cannot serve.

What the kernel lacks, and so which families take the gather path on a TPU (logged as a warning):
- a sliding window (it masks only positions >= length): mistral (sliding_window set), gemma2,
  gemma3, gpt-oss, and qwen2 where its config turns windows on;
- attention sinks (its softmax has no extra logit, and the wrapper drops the running max and sum
  it would take to add one afterwards): gpt-oss;
- a head_dim that is not a multiple of 128 (the kernel's running max and sum are blocked like q, and
  Pallas's TPU lowering refuses a last block dimension of 64 over their size-1 axis; the test
  compiles it to show this holds): gpt-oss, the built-in model, Llama 3.2 1B (all 64);
- a pool in another dtype than bfloat16: it reads K and V as bfloat16 whatever they are (an
  int8 pool would need its QuantizedTensor form, not wired here).
Soft-capping alone is supported (gemma2 also has windows, so it falls back anyway). Llama, qwen2
without windows, qwen3, mixtral and qwen3_moe in bfloat16 run the kernel where their head_dim is a
multiple of 128 (Llama 3.1 8B, Qwen3: 128; Llama 3.2 1B, Qwen2.5 0.5B: 64, so the gather path).

Nothing here ran on a TPU: tests/unit/test_paged_attention.py compiles the kernel ahead of time
for v5e, v6e and v5p chips (libtpu's compile-only devices) and runs it in Pallas's TPU interpret
mode on the CPU against the engine's gather path (alone, and inside the engine's paged step);
tests/unit/test_paged_step_tpu.py compiles the engine's whole paged step for a v5e chip with the
kernel in it, each layer's buffer read in place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tandem_engine.arch import ModelConfig
from tandem_engine.sharding import AXIS

__all__ = ["COMPUTE_BLOCK_TOKENS", "PagedAttention", "kernel_gaps", "pages_per_compute_block"]

COMPUTE_BLOCK_TOKENS = 512  # positions per compute block of the Pallas kernel, at most


def kernel_gaps(cfg: ModelConfig, dtype) -> list[str]:
    """What this family (at this pool dtype) needs that the Pallas TPU kernel lacks; empty: it can
    run the kernel."""
    gaps = []
    windowed = [i for i, w in enumerate(cfg.windows) if w]
    if windowed:
        gaps.append(f"sliding windows on {len(windowed)} of {cfg.num_layers} layers (the kernel masks only by length)")
    if cfg.sinks:
        gaps.append("attention sinks (the kernel's softmax has no sink logit)")
    if cfg.head_dim % 128:
        gaps.append(f"head_dim {cfg.head_dim} (the kernel's blocks need a multiple of 128: its lowering refuses "
                    f"others)")
    if jnp.dtype(dtype) != jnp.bfloat16:
        gaps.append(f"a {jnp.dtype(dtype).name} pool (the kernel reads K and V as bfloat16)")
    return gaps


def pages_per_compute_block(blocks_per_seq: int, block_size: int, tokens: int = COMPUTE_BLOCK_TOKENS) -> int:
    """The largest divisor of `blocks_per_seq` (the kernel requires one) whose compute block of
    `block_size`-position pages holds at most `tokens` positions; 1 when even one page is larger."""
    best = 1
    for d in range(1, blocks_per_seq + 1):
        if blocks_per_seq % d == 0 and d * block_size <= tokens:
            best = d
    return best


@dataclass(frozen=True)
class PagedAttention:
    """The Pallas kernel's decode attention over a paged pool (see the module docstring for the
    shapes), for a family `kernel_gaps` finds nothing missing in. Hashable: a static argument of a
    jitted core."""

    cfg: ModelConfig
    mesh: Mesh | None = None  # tp > 1: the kernel runs per chip over its own heads
    megacore_mode: str | None = None  # None, "kv_head" or "batch" (the kernel's option)

    def __call__(self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                 block_tables: jax.Array) -> jax.Array:
        """q [rows, H, hd]; k_pages, v_pages [KV, num_blocks, block_size, hd]; lengths int32 [rows];
        block_tables int32 [rows, blocks_per_seq]. Returns [rows, H, hd] in q's dtype (zeros for a
        row of length 0)."""
        q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
        _check_shapes(self.cfg, q, k_pages, v_pages, lengths, block_tables)
        lengths = jnp.asarray(lengths, jnp.int32)
        block_tables = jnp.clip(jnp.asarray(block_tables, jnp.int32), 0, k_pages.shape[1] - 1)
        return self._pallas(q, k_pages, v_pages, lengths, block_tables)

    def _pallas(self, q, k_pages, v_pages, lengths, block_tables):
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        cfg = self.cfg
        scale = cfg.query_scale or 1.0 / math.sqrt(cfg.head_dim)
        ppcb = pages_per_compute_block(block_tables.shape[1], k_pages.shape[2])
        softcap = cfg.attn_softcap or None
        megacore = self.megacore_mode

        def run(q, k, v, lengths, tables):
            # q in float32 scaled here: the kernel computes in float32 and takes no scale
            out = paged_attention(q.astype(jnp.float32) * scale, k, v, lengths, tables,
                                  attn_logits_soft_cap=softcap, pages_per_compute_block=ppcb,
                                  megacore_mode=megacore)
            return out.astype(q.dtype)

        if self.mesh is None or self.mesh.shape.get(AXIS, 1) == 1:
            out = run(q, k_pages, v_pages, lengths, block_tables)
        else:
            heads, pool, rep = P(None, AXIS, None), P(AXIS, None, None, None), P()
            out = jax.shard_map(run, mesh=self.mesh, in_specs=(heads, pool, pool, rep, rep), out_specs=heads,
                                check_vma=False)(q, k_pages, v_pages, lengths, block_tables)
        # the kernel skips a row of length 0 and leaves its output block unwritten: zeros instead
        return jnp.where((lengths > 0)[:, None, None], out, jnp.zeros((), out.dtype))


def _check_shapes(cfg: ModelConfig, q, k_pages, v_pages, lengths, block_tables) -> None:
    rows, heads, hd = q.shape
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be "
                         f"[num_kv_heads, num_blocks, block_size, head_dim]")
    if (heads, hd) != (cfg.num_heads, cfg.head_dim) or k_pages.shape[0] != cfg.num_kv_heads \
            or k_pages.shape[3] != hd:
        raise ValueError(f"q {q.shape} / pool {k_pages.shape} disagree with the model: {cfg.num_heads} heads, "
                         f"{cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}")
    if lengths.shape != (rows,) or block_tables.ndim != 2 or block_tables.shape[0] != rows:
        raise ValueError(f"lengths {lengths.shape} must be [rows] and block_tables {block_tables.shape} "
                         f"[rows, blocks_per_seq] for rows={rows}")
