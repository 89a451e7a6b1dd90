"""The KV pool (every Engine's decode KV): the KV of every sequence in fixed-size blocks of one
shared pool, each sequence row reading its blocks through a block table.

The pool is one buffer per layer, for k and for v: two tuples of num_layers arrays, each
[num_kv_heads, num_blocks, block_size / f, head_dim * f], lane-folded (pool_layout.py: f = 128 /
head_dim for a head_dim dividing 128, e.g. [KV, blocks, 8, 128] for 64 at 16 positions a block;
f = 1, [KV, blocks, block_size, head_dim], for 128 and 256), one layout on every platform, the one
Tandem's Pallas TPU decode kernel reads in place (pallas_decode.py). A folded block is the same
bytes as [block_size, head_dim]: the gather path and the CPU kernel read it so (a reshape). One
buffer per layer because a Mosaic call reads only whole buffers: a pool stacked over the layers and sliced
per layer (`k_pool[i]`) made XLA copy that layer's whole pool for each kernel call, every layer
of every step (compiled for v5e: 448 MiB of temporaries against 0.25 MiB;
tests/unit/test_paged_attention.py). As tpu-inference and vLLM's
JAX runner hold theirs (a list of per-layer KV arrays, donated through the step). The step
donates all 2 * num_layers buffers, and each layer's write of the new token and its attention
read that layer's buffer in place.

Block 0 is the null block: never allocated, what a table entry holds where a row has no block.
A row writing a position it has no block for (a free row of the step's batch, or a slot the
caller did not `reserve` for) writes the null block, never another sequence's block.

`BlockAllocator` is host state (free list, per-block refcount); the device sees only the tables.

The step's attention (`decode_forward_paged`): on a TPU, where the family and the pool's dtype
allow it (paged_attention.kernel_gaps: head_dim a multiple of 128 or a lane-folded pool (64,
32), a bfloat16 or float32 pool; windows, sinks and soft caps are served), the Pallas kernel
(paged_attention.PagedAttention); everywhere else the gather path here (`paged_attention`: each row's blocks gathered through its
table, masked by position and window). The choice between the two is made when the step is
compiled, for the platform it is compiled for (`jax.lax.platform_dependent`: a TPU compile
holds only the kernel, a CPU compile only the gather), so an engine, and a TPU program compiled
ahead of time on a CPU host, need no flag.

Tensor parallelism (tp > 1, sharding.Layout.kv_pool): each layer buffer is split on its KV axis,
so each chip holds its heads' slice of every block; the block tables (and the allocator's ids)
are the same on every chip. Each layer's write of the new rows and its attention run per chip in
a `shard_map` over its heads (`_layer_attention`, given the chip's head counts): the Pallas kernel
is a Mosaic call, which XLA's partitioner cannot split (it refuses to compile it), and the gather
path left to the partitioner all-gathers across chips. Query head h reads KV head h // groups on
the same chip (sharding.py), so nothing crosses chips until the o projection's all-reduce.
No I/O, no host state in the functions.
"""
from __future__ import annotations

import logging
import math
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tandem_engine.arch import ModelConfig
from tandem_engine.cpu_kernels import paged_attention_kernel
from tandem_engine.model import (NO_WINDOW, PREFILL_BLOCK, _layer_rope_tables, _scores, causal_attention,
                                 decoder_layer, embed, layer_consts, layer_loop, logits_from_hidden)
from tandem_engine.paged_attention import PagedAttention, kernel_gaps
from tandem_engine.pool_layout import block_positions, block_shape, fold, unfold
from tandem_engine.sharding import AXIS

log = logging.getLogger(__name__)

NULL_BLOCK = 0
_NEG = -1e30  # a masked score: finite, so a row with nothing to attend to yields no NaN


class BlockAllocator:
    """The pool's blocks on the host: a free list and a refcount per block (block 0, the null
    block, is never handed out). `share` adds a reference (a prefix held by two sequences, copy
    on write for a partly filled last block); `release` drops one and returns the block to the
    free list at zero."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"a KV block pool needs at least one block (got {total})")
        self.total = int(total)
        self.refcount = np.zeros(self.total + 1, np.int32)  # [0] is the null block's, always 0
        self._free = list(range(self.total, 0, -1))  # pop() hands out the lowest ids first

    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n blocks, each with one reference; None (and nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self.refcount[ids] = 1
        return ids

    def share(self, ids) -> None:
        """One more reference to each block (all must be allocated)."""
        for b in ids:
            if b == NULL_BLOCK or self.refcount[b] < 1:
                raise ValueError(f"block {b} is not allocated: only an allocated block can be shared")
            self.refcount[b] += 1

    def shared(self, block: int) -> bool:
        """Whether more than one sequence holds `block` (a write to it must copy it first)."""
        return bool(self.refcount[block] > 1)

    def release(self, ids) -> None:
        """Drop one reference to each block; a block nobody holds goes back to the free list."""
        for b in ids:
            if b == NULL_BLOCK or self.refcount[b] < 1:
                raise ValueError(f"block {b} is not allocated: released twice?")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(int(b))

    def exclusive(self, ids) -> int:
        """How many of `ids` only one sequence holds (what releasing them frees)."""
        return sum(1 for b in ids if self.refcount[b] == 1)


def paged_pool(num_layers: int, kv_heads: int, blocks: int, block_size: int, head_dim: int, dtype,
               sharding: NamedSharding | None = None):
    """An all-zero pool (k, v): each a tuple of num_layers arrays [KV, blocks + 1, B / f, hd * f]
    (pool_layout.py: lane-folded, f = lane_fold(hd, B); block 0: the null block), one buffer per
    layer. `sharding` (tp > 1: Layout.kv_pool, split on the KV axis): each chip allocates only
    its heads' slice of every block."""
    shape = (kv_heads, blocks + 1, *block_shape(block_size, head_dim))  # lane-folded (pool_layout.py)
    return (tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)),
            tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)))


def write_prompt_blocks(k_pool: tuple, v_pool: tuple, k, v, ids):
    """A prompt's k, v [L, T, KV, hd] into the pool's blocks `ids` int32 [ceil(T / B)] in order
    (rows past T in the last block are zero padding; an id of 0 drops its rows into the null
    block). k_pool, v_pool: tuples of L layer buffers [KV, num_blocks, B / f, hd * f] (lane-folded,
    pool_layout.py). Returns the new (k_pool, v_pool)."""
    num_layers, t, kvh, hd = k.shape
    bs = block_positions(k_pool[0], hd)
    n = ids.shape[0]
    pad = n * bs - t

    def blocks(x, pool):
        x = jnp.pad(x.astype(pool[0].dtype), ((0, 0), (0, pad), (0, 0), (0, 0)))
        x = jnp.transpose(x.reshape(num_layers, n, bs, kvh, hd), (0, 3, 1, 2, 4))  # [L, KV, n, B, hd]
        x = fold(x, hd)  # [L, KV, n, B / f, hd * f]: the prompt's blocks as the pool stores them
        return tuple(layer.at[:, ids].set(x[i]) for i, layer in enumerate(pool))

    return blocks(k, k_pool), blocks(v, v_pool)


READ_CHUNK = 128  # positions per piece of a step's attention (gathered, then read while in cache)


def paged_attention(q, k_layer, v_layer, table, positions, cfg: ModelConfig, *, window: int = 0,
                    sinks: jax.Array | None = None, lengths: jax.Array | None = None):
    """Decode attention of one layer through block tables (the gather path).

    q [rows, 1, H, hd]; k_layer, v_layer [KV, num_blocks, B / f, hd * f] (one layer of the pool,
    lane-folded: its blocks read as the B * hd contiguous values they are); table
    int32 [rows, nb]: row r's positions [j * B, (j + 1) * B) sit in block table[r, j]; positions
    [rows]: row r attends to its positions <= positions[r] (and > positions[r] - window).
    `lengths` [rows] (optional): positions[r] + 1 for a row in use, 0 for a free row; it bounds
    what is read (below). The table's columns are read in pieces of READ_CHUNK positions by a
    `fori_loop` whose bounds are traced: from the first piece any used row's window reaches to
    the piece holding the longest used row's last position, so a step reads the blocks in use and
    not the table's width (one compiled width serves every length: the step no longer compiles a
    variant per table width). Each piece's blocks are gathered ([KV, rows, piece, hd], one
    contiguous B * hd row per block), scored and folded into an online softmax in float32
    (soft-capped by `_scores`; started from the sink logit where the family has one). In pieces
    because one gather of every row's whole table outgrew the CPU's caches: on the built-in model
    at 32 rows, 384 positions a row cost 13 ms a step where the slot layout's blocks (read in
    place) cost 6. Returns [rows, 1, H * hd] in q's dtype."""
    rows = q.shape[0]
    qg, carry = _fold_start(q, cfg, sinks)
    used = jnp.ones_like(positions, jnp.bool_) if lengths is None else lengths > 0
    last = jnp.max(jnp.where(used, positions, 0))
    reach = jnp.min(jnp.where(used, positions - (window - 1), last)) if window else None
    carry = _pool_fold(qg, carry, k_layer, v_layer, table, positions, cfg, window=window, last=last, reach=reach,
                       shared_table=False, below=None)
    return _fold_end(carry, q.dtype, rows, cfg)


def chunk_attention(q, k_new, v_new, k_layer, v_layer, table, start, cfg: ModelConfig, *, window: int = 0,
                    sinks: jax.Array | None = None):
    """Attention of a prompt's chunk (a ragged call's, cores.ragged_core): q [C, 1, H, hd] at
    positions start + [0, C), k_new, v_new [C, KV, hd] its own K/V (rotated). Its prefix,
    positions [0, start), is read from the pool through `table` [1, nb] (the sequence's row) in
    `paged_attention`'s pieces, gathered once for every query; the chunk attends to its own K/V
    as a prefill does (`_causal_partials`: head-major, blocked; the pool holds them too, written
    before, but they are not read from it), and the two softmax partials are merged. Measured on
    XLA CPU, built-in model, a layer of a 512-token chunk from position 0: 2.5 ms, against 3.6
    for `paged_attention`'s shared table (every piece of the chunk's own positions gathered from
    the pool, folded in pieces) and 2.2 for the prefill's own attention. Returns [C, 1, H * hd]."""
    c = q.shape[0]
    positions = start + jnp.arange(c, dtype=jnp.int32)
    qg, carry = _fold_start(q, cfg, sinks)
    last = start + c - 1
    reach = jnp.maximum(start - (window - 1), 0) if window else None
    carry = _pool_fold(qg, carry, k_layer, v_layer, table, positions, cfg, window=window, last=last, reach=reach,
                       shared_table=True, below=start)
    own, lse = _causal_partials(q, k_new, v_new, cfg, window)  # [KV, groups, C, hd], [KV, groups, C]
    m, denom, acc = (jnp.swapaxes(x, 1, 2) for x in carry)  # the prefix's, as [KV, groups, C](, hd)
    top = jnp.maximum(m, lse)
    wa, wc = jnp.exp(m - top), jnp.exp(lse - top)
    out = (acc * wa[..., None] + own * wc[..., None]) / (denom * wa + wc)[..., None]
    out = jnp.transpose(out, (2, 0, 1, 3))  # [C, KV, groups, hd]
    return out.astype(q.dtype).reshape(c, 1, cfg.num_heads * cfg.head_dim)


def _causal_partials(q, k, v, cfg: ModelConfig, window: int, block: int = PREFILL_BLOCK):
    """A chunk's causal attention over its own K/V (q [C, 1, H, hd], k, v [C, KV, hd]): the
    prefill's (model.causal_attention) with each row's log-sum-exp for a merge with the prefix's:
    (out [KV, groups, C, hd], lse [KV, groups, C])."""
    c = q.shape[0]
    i, j = np.arange(c)[:, None], np.arange(c)[None, :]
    mask = jnp.asarray((j <= i) & (i - j < (window or NO_WINDOW)))[None]
    out, lse = causal_attention(q.reshape(1, c, *q.shape[2:]), k[None], v[None], mask, cfg, block=block,
                                partials=True)
    return out[0], lse[0]


def _fold_start(q, cfg: ModelConfig, sinks):
    """q [rows, 1, H, hd] as [KV, rows, groups, hd] (small), so the dots batch over (KV, rows)
    in the gathered arrays' order and XLA transposes neither of them; and an empty online
    softmax (m, denom, acc), started from the sink logit where the family has one."""
    rows = q.shape[0]
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    groups = cfg.num_heads // kvh
    qg = jnp.transpose(q.reshape(rows, kvh, groups, hd), (1, 0, 2, 3))
    shape = (kvh, rows, groups)
    if sinks is None:
        m, denom = jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32)
    else:  # the sink is one more logit with no value: it only adds exp(sink - m) to the sum
        m = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(kvh, 1, groups), shape)
        denom = jnp.ones(shape, jnp.float32)
    return qg, (m, denom, jnp.zeros((*shape, hd), jnp.float32))


def _fold(carry, s, ok, vg, spec_o: str):
    """One piece into the online softmax: scores s [KV, rows, groups, n] (float32), where `ok`
    [rows, n] allows, over values vg."""
    m, denom, acc = carry
    s = jnp.where(ok[None, :, None, :], s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    denom = alpha * denom + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum(spec_o, p.astype(vg.dtype), vg, preferred_element_type=jnp.float32)
    return m_new, denom, acc


def _fold_end(carry, dtype, rows: int, cfg: ModelConfig):
    m, denom, acc = carry
    out = jnp.transpose(acc / denom[..., None], (1, 0, 2, 3))  # [rows, KV, groups, hd]
    return out.astype(dtype).reshape(rows, 1, cfg.num_heads * cfg.head_dim)


def _pool_fold(qg, carry, k_layer, v_layer, table, positions, cfg: ModelConfig, *, window: int, last, reach,
               shared_table: bool, below):
    """Fold the pool's positions the rows attend to into `carry`: the pieces from the one
    holding `reach` (the earliest position a window reaches; None: 0) to the one holding `last`,
    each piece's blocks gathered through the table ([KV, rows (1: shared), piece, hd]), masked by
    each row's position and window, and with `below` only positions before it."""
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    nb, bs = table.shape[1], block_positions(k_layer, hd)
    per = max(1, min(nb, READ_CHUNK // bs))  # blocks per piece
    pieces = -(-nb // per)
    n = per * bs
    if pieces * per > nb:  # the last piece's missing columns read the null block (masked: past every row)
        table = jnp.pad(table, ((0, 0), (0, pieces * per - nb)))
    k_rows, v_rows = k_layer.reshape(kvh, -1, bs * hd), v_layer.reshape(kvh, -1, bs * hd)
    win = window or NO_WINDOW
    hi = jnp.minimum(last // n + 1, pieces)
    if below is not None:  # nothing at or past `below`: no piece wholly past it
        hi = jnp.minimum(hi, (below + n - 1) // n)
    lo = jnp.int32(0)
    if reach is not None:  # a sliding-window layer: nothing before the earliest position a window reaches
        lo = jnp.clip(reach // n, 0, jnp.maximum(hi - 1, 0))
    src = table[:1] if shared_table else table
    spec_s = "krgd,ksd->krgs" if shared_table else "krgd,krsd->krgs"
    spec_o = "krgs,ksd->krgd" if shared_table else "krgs,krsd->krgd"

    def piece(i, carry):
        flat = jax.lax.dynamic_slice_in_dim(src, i * per, per, axis=1).reshape(-1)
        kg = jnp.take(k_rows, flat, axis=1, mode="clip").reshape(kvh, -1, n, hd)  # [KV, rows (1: shared), n, hd]
        vg = jnp.take(v_rows, flat, axis=1, mode="clip").reshape(kvh, -1, n, hd)
        if shared_table:
            kg, vg = kg[:, 0], vg[:, 0]
        if kg.dtype != qg.dtype:  # a pool of another element type (kv_dtype fp8): read in q's
            kg, vg = kg.astype(qg.dtype), vg.astype(qg.dtype)
        s = _scores(jnp.einsum(spec_s, qg, kg, preferred_element_type=jnp.float32), cfg)
        at = i * n + jnp.arange(n)
        ok = (at[None, :] <= positions[:, None]) & (positions[:, None] - at[None, :] < win)
        if below is not None:
            ok = ok & (at[None, :] < below)
        return _fold(carry, s, ok, vg, spec_o)

    return jax.lax.fori_loop(lo, hi, piece, carry)


def _write_rows(layer, new, flat, head_dim: int):
    """`new` [rows, KV, hd] into the layer buffer [KV, num_blocks, B / f, hd * f] (lane-folded,
    pool_layout.py) at each row's position `flat` [rows] (block * B + offset) of every head: that
    position sits in row offset // f of the block, lanes [(offset % f) * hd, (offset % f + 1) * hd).
    One scatter of hd-wide windows of the minor (lane) axis, indexed on every axis of the buffer as
    it is (no reshape: a TPU array's tiling follows its shape), keeps the buffer's row-major
    layout, the one the TPU kernel reads: scattered with a window over [KV, hd] at [:, block,
    offset] instead, XLA's TPU layout assignment gave a buffer carried through the multi-step scan
    another layout and copied every layer's buffer back for every kernel call, every step
    (compiled for v5e: a temporary the size of the whole pool). Two positions of one sequence (a
    prompt chunk's neighbours) write disjoint lanes. Rows that share a target (free rows, all at
    the null block) write it in any order."""
    kvh, _, _, lanes = layer.shape
    hd = int(head_dim)
    f = lanes // hd
    bs = block_positions(layer, hd)
    rows = flat.shape[0]
    block, offset = flat // bs, flat % bs
    idx = jnp.stack([jnp.broadcast_to(jnp.arange(kvh, dtype=flat.dtype)[None, :], (rows, kvh)),
                     jnp.broadcast_to(block[:, None], (rows, kvh)),
                     jnp.broadcast_to((offset // f)[:, None], (rows, kvh)),
                     jnp.broadcast_to((offset % f * hd)[:, None], (rows, kvh))], axis=-1).reshape(-1, 4)
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0, 1, 2),
                                           scatter_dims_to_operand_dims=(0, 1, 2, 3))
    return jax.lax.scatter(layer, idx, new.reshape(-1, hd).astype(layer.dtype), dims,
                           indices_are_sorted=False, unique_indices=False)


def cpu_step_kernel(q_dtype, pool_dtype):
    """Tandem's CPU kernel for the step's attention (cpu_kernels: the blocks read in place, no
    gather), or None where it is not built (no compiler, TANDEM_CPU_KERNELS=0: logged once) or
    cannot read these dtypes (float32 or bfloat16 only: an fp8 pool keeps the gather)."""
    ok = {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}
    if jnp.dtype(q_dtype) not in ok or jnp.dtype(pool_dtype) not in ok:
        return None
    if jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16) and jnp.dtype(pool_dtype) != jnp.dtype(jnp.bfloat16):
        return None
    if jax.default_backend() != "cpu":  # a TPU host compiles for its chips (and ships no compiler)
        return None
    return paged_attention_kernel()


@lru_cache(maxsize=None)
def step_kernel(cfg: ModelConfig, dtype, block_size: int) -> PagedAttention | None:
    """The Pallas kernel's attention for this family and pool dtype over a pool of `block_size`-
    position blocks, or None when the kernel cannot serve it (paged_attention.kernel_gaps). Logged
    once per (family, dtype, block size): a TPU compile of the paged step then runs the kernel;
    None, the gather path on a TPU too (a warning where JAX's default backend is a TPU)."""
    gaps = kernel_gaps(cfg, dtype, block_size)
    if gaps:
        reason = "the Pallas kernel lacks " + "; ".join(gaps)
        on_tpu = jax.default_backend() == "tpu"
        (log.warning if on_tpu else log.debug)("paged decode step: the gather path on every platform: %s", reason)
        return None
    # said where it matters (a TPU backend); a CPU pod (a prefill pod's device prefix cache) runs the gather path
    (log.info if jax.default_backend() == "tpu" else log.debug)(
        "paged decode step: the Pallas kernel where compiled for a TPU, the gather path elsewhere")
    return PagedAttention(cfg)


def decode_forward_paged(params: dict, tokens, positions, k_pool: tuple, v_pool: tuple, table, cfg: ModelConfig,
                         *, max_len: int, active: jax.Array | None = None, logits_at: jax.Array | None = None, mesh: Mesh | None = None, chunk: int = 0):
    """`decode_forward` over the paged pool: one step for `rows` = len(tokens) rows.

    k_pool, v_pool: tuples of L layer buffers [KV, num_blocks, B / f, hd * f] (lane-folded,
    pool_layout.py); table int32 [rows, nb]
    (each row's first nb blocks: the caller cuts the table to the step's compiled width, wide
    enough for every active row's blocks). The new K/V of row r go to position p =
    min(positions[r], max_len - 1), in block table[r, p // B] at row p % B; a row that is not
    `active`, or whose p falls past its table, writes the null block. Each layer then attends
    over its own buffer: the Pallas kernel when compiled for a TPU and `step_kernel` allows it
    (lengths p + 1, at most nb * B; 0 for a row that is not `active`, whose output is zeros),
    the gather path (`paged_attention`) otherwise. params["layers"]: stacked or per-layer
    (`split_layers`); the layers run unrolled. `logits_at`: the one row whose logits are
    wanted (then [vocab]). `mesh` (tensor parallelism: a "tp" axis over > 1 chips): the pool
    MUST be split on its KV axis (sharding.Layout.kv_pool) and q/k/v by head, as the layout's
    weights make them; each layer's write and attention then run per chip on its own heads
    (`_layer_attention` in a shard_map), the tables replicated. Returns (logits [rows, vocab],
    k_pool, v_pool). `chunk` (a ragged call, cores.ragged_core; a prefill pod's hit over its
    prefix pool, prefix_pool.py, where every row is the chunk): the last `chunk` rows are
    positions of one sequence (a prompt's chunk, every one with that sequence's table row); they
    attend as `chunk_attention` does (the prefix's blocks gathered once for all of them, the
    chunk's own K/V dense), the rows before them as decode rows."""
    nb, bs = table.shape[1], block_positions(k_pool[0], cfg.head_dim)
    write_pos = jnp.minimum(positions, max_len - 1)
    j = write_pos // bs
    block = jnp.take_along_axis(table, jnp.minimum(j, nb - 1)[:, None], axis=1)[:, 0]
    ok = j < nb
    if active is not None:
        ok = ok & active
    block = jnp.where(ok, block, NULL_BLOCK)
    flat = block * bs + write_pos % bs  # [rows]: each row's target position of a head's num_blocks * B
    lengths = jnp.minimum(write_pos + 1, nb * bs).astype(jnp.int32)
    if active is not None:
        lengths = jnp.where(active, lengths, 0)
    tp = 1 if mesh is None else int(mesh.shape[AXIS])
    local = cfg if tp == 1 else cfg._replace(num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp)
    x = embed(params, tokens, cfg)[:, None, :]  # [rows, 1, d]
    # the rotations once for every layer (as the prefill computes them: inside each layer XLA CPU
    # evaluated cos and sin again in every consumer, a ragged call's chunk of 512 rows included)
    stacked, shared = _layer_rope_tables(positions[:, None], layer_consts(cfg), cfg)
    new_k, new_v = [], []
    for i, lp, lc in layer_loop(params, cfg):
        tables = shared if stacked is None else jax.tree.map(lambda t, i=i: t[i], stacked)

        def attention(q, k, v, sinks, i=i):  # q [rows, 1, H, hd]; k, v [rows, 1, KV, hd]
            attend = partial(_layer_attention, cfg=local, window=cfg.window(i), has_sinks=sinks is not None,
                             chunk=chunk)
            args = (q, k[:, 0], v[:, 0], k_pool[i], v_pool[i], flat, table, write_pos, lengths,
                    jnp.zeros((), q.dtype) if sinks is None else sinks)
            if tp > 1:  # per chip, on its heads: XLA cannot partition a Mosaic call (see the module docstring)
                q_heads, kv_heads, pool, rep = (P(None, None, AXIS, None), P(None, AXIS, None),
                                                P(AXIS, None, None, None), P())
                specs = (q_heads, kv_heads, kv_heads, pool, pool, rep, rep, rep, rep, rep if sinks is None else P(AXIS))
                out = (P(None, None, AXIS), pool, pool)  # attn [rows, 1, H * hd]: each chip its heads' columns
                attend = jax.shard_map(attend, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False)
            attn, k_layer, v_layer = attend(*args)
            return attn, (k_layer, v_layer)

        x, (k_layer, v_layer) = decoder_layer(x, lp, lc, positions[:, None], cfg, attention, tables)
        new_k.append(k_layer)
        new_v.append(v_layer)
    hidden = x[:, 0] if logits_at is None else x[logits_at, 0]
    return logits_from_hidden(params, hidden, cfg), tuple(new_k), tuple(new_v)


def _layer_attention(q, k, v, k_layer, v_layer, flat, table, write_pos, lengths, sinks, *, cfg: ModelConfig,
                     window: int, has_sinks: bool, chunk: int = 0):
    """One layer of `decode_forward_paged` on the heads `cfg` counts (all of them, or under tp one
    chip's: cfg's num_heads and num_kv_heads are then the chip's): the rows' new K/V k, v
    [rows, KV, hd] written at `flat` [rows] (block * B + offset) of every head's blocks of the
    layer buffers [KV, num_blocks, B / f, hd * f] (lane-folded), then q [rows, 1, H, hd] attends
    over them. `sinks`:
    the layer's [H] when `has_sinks`, else a placeholder (a shard_map argument must be an array).
    `chunk`: the last `chunk` rows are one sequence's consecutive positions (decode_forward_paged's):
    they attend as `chunk_attention` does (their prefix read through the table's row of the first
    of them, their own K/V `k`, `v` as one dense causal piece). Returns (attn [rows, 1, H * hd], k_layer,
    v_layer)."""
    hd = cfg.head_dim
    k_layer, v_layer = _write_rows(k_layer, k, flat, hd), _write_rows(v_layer, v, flat, hd)
    if chunk:
        r = q.shape[0] - chunk
        ahead = chunk_attention(q[r:], k[r:], v[r:], k_layer, v_layer, table[r:r + 1], write_pos[r], cfg, window=window,
                                sinks=sinks if has_sinks else None)
        if r == 0:
            return ahead, k_layer, v_layer
        rows = _rows_attention(q[:r], k_layer, v_layer, table[:r], write_pos[:r], lengths[:r], sinks, cfg=cfg,
                               window=window, has_sinks=has_sinks)
        return jnp.concatenate([rows, ahead]), k_layer, v_layer
    attn = _rows_attention(q, k_layer, v_layer, table, write_pos, lengths, sinks, cfg=cfg, window=window,
                           has_sinks=has_sinks)
    return attn, k_layer, v_layer


def _rows_attention(q, k_layer, v_layer, table, write_pos, lengths, sinks, *, cfg: ModelConfig, window: int,
                    has_sinks: bool):
    """Rows q [rows, 1, H, hd] attend over the layer buffers already written: the Pallas kernel
    where compiled for a TPU and the family allows it, Tandem's CPU kernel on a CPU, the gather
    path otherwise. Returns [rows, 1, H * hd]."""
    hd = cfg.head_dim
    gather = partial(paged_attention, table=table, positions=write_pos, cfg=cfg, window=window,
                     sinks=sinks if has_sinks else None, lengths=lengths)
    cpu = gather
    native = cpu_step_kernel(jnp.dtype(q.dtype), jnp.dtype(k_layer.dtype))
    if native is not None:  # a CPU compile reads the blocks in place (cpu_kernels), no gather

        def cpu(q, k_layer, v_layer):
            # the blocks as [KV, num_blocks, B, hd]: a reshape of the folded buffer (a bitcast on a CPU)
            out = native(q[:, 0], unfold(k_layer, hd), unfold(v_layer, hd), table, write_pos, lengths,
                         sinks if has_sinks else None,
                         scale=cfg.query_scale or 1.0 / math.sqrt(cfg.head_dim), softcap=cfg.attn_softcap or 0.0,
                         window=window)
            return out.astype(q.dtype).reshape(q.shape[0], 1, cfg.num_heads * cfg.head_dim)

    kernel = None
    if cfg.paged_kernel:
        kernel = step_kernel(cfg, jnp.dtype(k_layer.dtype), block_positions(k_layer, hd))
    if kernel is None:
        return jax.lax.platform_dependent(q, k_layer, v_layer, cpu=cpu, default=gather)

    def pallas(q, k_layer, v_layer):
        out = kernel(q[:, 0], k_layer, v_layer, lengths, table, window=window,
                     sinks=sinks if has_sinks else None)  # [rows, H, hd]
        return out.reshape(q.shape[0], 1, cfg.num_heads * cfg.head_dim)

    return jax.lax.platform_dependent(q, k_layer, v_layer, tpu=pallas, cpu=cpu, default=gather)
