"""Decode attention over a paged KV pool: one call, two implementations chosen once at start.

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

`attn = select_paged_attention(cfg, dtype=..., platform=...)` picks the implementation for the
platform and the family and logs which and why; `attn(q, k_pages, v_pages, lengths, block_tables,
window=..., sinks=...)` returns [rows, num_heads, head_dim] in q's dtype. `attn` is a frozen,
hashable value: pass it to `jax.jit` as a static argument, as the cores pass `cfg`.

Implementations:
- "gather" (any platform; the only one on CPU and GPU): jnp. A `lax.while_loop` over the block
  table `chunk_blocks` columns at a time, from the first chunk any row's window reaches up to the
  longest row: each step gathers those blocks of every row (`k_pages[:, table_chunk]`), masks by
  length and window, and folds them into an online softmax in float32 started from the sink logit
  where the family has one: the math of model.py's `chunked_decode_attention` (scale, soft-cap,
  masked scores -1e30, probabilities cast to V's dtype before the PV dot, one division at the end).
- "pallas" (TPU only): `jax.experimental.pallas.ops.tpu.paged_attention.paged_attention`, imported
  and traced only when chosen, so a CPU pod never builds it. The kernel takes no softmax scale, so
  q is scaled in float32 first (`query_scale` or head_dim ** -0.5), and the kernel's
  `attn_logits_soft_cap` is the family's `attn_softcap` (the same tanh after the scale).
  `pages_per_compute_block` is the largest divisor of the table's width whose compute block holds
  at most `COMPUTE_BLOCK_TOKENS` positions (a guess: never timed on a TPU). `megacore_mode` stays
  None unless asked (the kernel's own advice: set only where megacore is on, else it may hang).
  Under tensor parallelism (`mesh` with a "tp" axis over > 1 chips) the kernel runs per chip in a
  `shard_map` over the chip's KV heads and its query heads; a Mosaic call is not split by XLA's
  partitioner. A row of length 0 comes back as zeros, as from the gather (the kernel skips it and
  leaves its output unwritten). Hold the pool as one buffer per layer for it, as the engine's
  paged pool is (paged.py): a pool stacked [L, KV, blocks, block_size, hd] and sliced per layer
  (`k_pool[i]`) makes XLA copy that layer's whole pool for the call, at every layer of every step
  (compiled for v5e: 448 MiB of temporaries for 4 layers of 64 MiB pools, against 0.25 MiB with
  per-layer buffers; the test holds this).

The engine's paged decode step (paged.decode_forward_paged) calls this kernel on a TPU through
`paged.step_kernel` (the same `kernel_gaps`, decided when the step is compiled for a platform:
`jax.lax.platform_dependent`), and its own gather path (paged.paged_attention, tuned for the CPU)
elsewhere; `select_paged_attention` is the standalone choice, for a caller that holds a pool.

What the kernel lacks, and so which families fall back to "gather" on a TPU (logged as a warning):
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

Nothing here ran on a TPU: tests/unit/test_paged_attention.py compiles the TPU path ahead of time
for v5e, v6e and v5p chips (libtpu's compile-only devices) and runs the kernel itself in Pallas's TPU
interpret mode on the CPU against the gather path (alone, and inside the engine's paged step);
tests/unit/test_paged_step_tpu.py compiles the engine's whole paged step for a v5e chip with the
kernel in it, each layer's buffer read in place.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tandem_engine.arch import ModelConfig
from tandem_engine.model import _NEG, NO_WINDOW, _scores, _window_mask
from tandem_engine.sharding import AXIS

log = logging.getLogger(__name__)

__all__ = ["COMPUTE_BLOCK_TOKENS", "GATHER_CHUNK_BLOCKS", "PagedAttention", "kernel_gaps", "pages_per_compute_block",
           "select_paged_attention"]

COMPUTE_BLOCK_TOKENS = 512  # positions per compute block of the Pallas kernel, at most
GATHER_CHUNK_BLOCKS = 8  # block-table columns the gather path reads per loop step
IMPLS = ("gather", "pallas")


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
    """Decode attention over a paged pool with the implementation chosen at start (see the module
    docstring for the shapes). Hashable: a static argument of a jitted core."""

    cfg: ModelConfig
    impl: str  # "gather" | "pallas"
    reason: str  # why this one (logged at selection)
    mesh: Mesh | None = None  # pallas under tp > 1: the kernel runs per chip over its own heads
    megacore_mode: str | None = None  # pallas only: None, "kv_head" or "batch" (the kernel's option)
    chunk_blocks: int = GATHER_CHUNK_BLOCKS  # gather only

    def __call__(self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                 block_tables: jax.Array, *, window: jax.Array | int | None = None,
                 sinks: jax.Array | None = None) -> jax.Array:
        """q [rows, H, hd]; k_pages, v_pages [KV, num_blocks, block_size, hd]; lengths int32 [rows];
        block_tables int32 [rows, blocks_per_seq]; `window` (this layer's: None, 0 or NO_WINDOW
        for a global layer; may be traced, as a layer scan carries it); `sinks` [H] (this layer's,
        gpt-oss) or None. Returns [rows, H, hd] in q's dtype (zeros for a row of length 0)."""
        q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
        _check_shapes(self.cfg, q, k_pages, v_pages, lengths, block_tables)
        lengths = jnp.asarray(lengths, jnp.int32)
        block_tables = jnp.clip(jnp.asarray(block_tables, jnp.int32), 0, k_pages.shape[1] - 1)
        if self.impl == "gather":
            return gather_attention(q, k_pages, v_pages, lengths, block_tables, self.cfg, window=window,
                                    sinks=sinks, chunk_blocks=self.chunk_blocks)
        if sinks is not None or (self.cfg.windows and window is not None):
            raise ValueError("the pallas paged attention was given sinks or a window, which it cannot apply; "
                             "select_paged_attention picks it only for families with neither")
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
        # the kernel skips a row of length 0 and leaves its output block unwritten: zeros, as the gather gives
        return jnp.where((lengths > 0)[:, None, None], out, jnp.zeros((), out.dtype))


def select_paged_attention(cfg: ModelConfig, *, dtype, platform: str | None = None, mesh: Mesh | None = None,
                           impl: str = "auto", megacore_mode: str | None = None,
                           chunk_blocks: int = GATHER_CHUNK_BLOCKS) -> PagedAttention:
    """Choose the decode attention for this platform and family, once, at start, and log it.

    `platform`: "tpu", "cpu", "gpu"...; default: the platform of `mesh`'s devices, else of JAX's
    first device (pass "tpu" to compile for TPU devices described ahead of time on a machine whose
    default backend is the CPU). `impl`: "auto" (the kernel on a TPU where the family and dtype
    allow it, else the gather path), or "gather" / "pallas" to force one; forcing "pallas" for a
    family the kernel cannot serve, or off a TPU, raises ValueError saying why."""
    if impl not in ("auto", *IMPLS):
        raise ValueError(f"impl must be 'auto', 'gather' or 'pallas', not {impl!r}")
    if platform is None:
        platform = (next(iter(mesh.devices.flat)) if mesh is not None else jax.devices()[0]).platform
    gaps = kernel_gaps(cfg, dtype)
    if impl == "pallas":
        if platform != "tpu":
            raise ValueError(f"the Pallas paged-attention kernel runs only on a TPU, not on {platform!r}; "
                             f"use impl='gather' (or 'auto')")
        if gaps:
            raise ValueError("the Pallas paged-attention kernel cannot serve this model: it lacks "
                             + "; ".join(gaps) + "; use impl='gather' (or 'auto')")
    if impl == "gather":
        chosen, reason = "gather", "forced (impl='gather')"
    elif platform != "tpu":
        chosen, reason = "gather", f"the platform is {platform!r} (the Pallas kernel is TPU-only)"
    elif gaps and impl == "auto":
        chosen, reason = "gather", "the Pallas kernel lacks " + "; ".join(gaps)
    else:
        chosen, reason = "pallas", "TPU, and the family needs nothing the kernel lacks"
    attn = PagedAttention(cfg, chosen, reason, mesh=mesh if chosen == "pallas" else None,
                          megacore_mode=megacore_mode if chosen == "pallas" else None, chunk_blocks=chunk_blocks)
    if platform == "tpu" and chosen == "gather":
        log.warning("paged decode attention on TPU: the jnp gather path, not the Pallas kernel: %s", reason)
    else:
        log.info("paged decode attention: %s (%s)", chosen, reason)
    return attn


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


def gather_attention(q, k_pages, v_pages, lengths, block_tables, cfg: ModelConfig, *, window=None, sinks=None,
                     chunk_blocks: int = GATHER_CHUNK_BLOCKS) -> jax.Array:
    """The gather path (see the module docstring): `block_tables` already clamped into the pool,
    `lengths` int32, each <= blocks_per_seq * block_size."""
    rows, heads, hd = q.shape
    kvh, _, size, _ = k_pages.shape
    groups = heads // kvh
    cb = max(1, min(chunk_blocks, block_tables.shape[1]))
    pad = -block_tables.shape[1] % cb  # padded columns sit past every length: masked
    if pad:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    chunk = cb * size
    qpos = lengths - 1  # each row's query position
    win = jnp.int32(NO_WINDOW) if window is None else jnp.where(jnp.asarray(window) > 0, window, NO_WINDOW)
    live = lengths > 0
    n = (jnp.max(lengths) + chunk - 1) // chunk  # chunks up to the longest row
    reach = jnp.where(live, jnp.maximum(qpos - win + 1, 0), jnp.iinfo(jnp.int32).max)
    first = jnp.min(reach) // chunk  # the first chunk any row's window reaches
    qg = q.reshape(rows, kvh, groups, hd)

    def body(carry):
        c, m, denom, acc = carry
        cols = jax.lax.dynamic_slice(block_tables, (0, c * cb), (rows, cb))  # [rows, cb]
        k = k_pages[:, cols].reshape(kvh, rows, chunk, hd)  # row r's positions [c*chunk, (c+1)*chunk)
        v = v_pages[:, cols].reshape(kvh, rows, chunk, hd)
        pos = c * chunk + jnp.arange(chunk)
        ok = _window_mask(qpos[:, None], pos[None, :], win)  # pos <= qpos (< length), inside the window
        s = _scores(jnp.einsum("rkgd,krtd->rkgt", qg, k, preferred_element_type=jnp.float32), cfg)
        s = jnp.where(ok[:, None, None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("rkgt,krtd->rkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return c + 1, m_new, alpha * denom + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

    shape = (rows, kvh, groups)
    if sinks is None:
        m0, l0 = jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32)
    else:  # the sink is one more logit with no value: it only adds exp(sink - m) to the sum
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kvh, groups), shape)
        l0 = jnp.ones(shape, jnp.float32)
    init = (first.astype(jnp.int32), m0, l0, jnp.zeros((*shape, hd), jnp.float32))
    _, _, denom, acc = jax.lax.while_loop(lambda carry: carry[0] < n, body, init)
    out = jnp.where(live[:, None, None, None], acc / denom[..., None], 0.0)
    return out.reshape(rows, heads, hd).astype(q.dtype)
