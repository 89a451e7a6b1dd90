"""Tandem's Pallas TPU decode attention over the paged pool: one query token per row, GQA, sliding
windows, attention sinks, soft-capping, head_dim 128 or 256 (and 64 or 32 from a lane-folded pool),
bfloat16 or float32 pools.

The shapes (one layer of the pool, as paged.py holds it):

    q          [rows, H, hd]             H = groups * KV: query head h reads KV head h // groups
    k, v       [KV, num_blocks, B, hd]   row r's positions [j*B, (j+1)*B) sit in block tables[r, j];
               or, hd dividing 128, lane-folded [KV, num_blocks, B * hd / 128, 128] (how the
               engine stores a pool of such a head_dim: pool_layout.py): the same
               bytes (row-major), row t of a block holding its positions t * f + c, f = 128 / hd,
               in lanes [c * hd, (c + 1) * hd)
    lengths    int32 [rows]              positions row r attends to (its query is at length - 1,
                                         its K/V already written); 0: a free row (zeros out)
    tables     int32 [rows, nb]          the entries a row reads (those holding a position it
                                         attends to) must be in [0, num_blocks); the others may
                                         hold anything (never copied)
    sinks      float32 [H] or None       one more logit per head, with no value (gpt-oss)

`decode_attention(q, k, v, lengths, tables, sinks, scale=, softcap=, window=)` returns
[rows, H, hd] in q's dtype. It computes exactly what the gather path (attention.paged_attention) and
the CPU kernel (cpu_kernels) compute: scores q.k in float32 times `scale`, soft-capped
(tanh(s / cap) * cap) where `softcap` > 0; row r attends to positions p with p < length and, on a
layer with a window w > 0, length - 1 - p < w (the window's first position is length - w); the
softmax runs online in float32 from the sink logit (m = sink, sum = 1) where there are sinks, K and
V read in q's dtype, the probabilities cast to it before the second dot (as the gather path).

How it runs. The grid is the rows (one program per row, sequential: "arbitrary"). A row's program
loops over its KV heads and, for each, over the compute blocks (`pages` pool blocks, at most
COMPUTE_BLOCK_TOKENS positions) its window reaches: blocks [lo, hi) with lo = first // bk and
hi = ceil(length / bk), first = max(0, length - window). Blocks wholly before the window or past
the length are never read, so a windowed layer reads about `window` positions a row however long
the row is, and a short row reads its own blocks, not the table's width. Inside a compute block
only the pool blocks holding a position the row attends to are copied (one DMA per pool block, K
and V, from HBM into VMEM); the rest of the compute block's buffer holds whatever it held (stale
or never written), and the mask drops it (V is zeroed there too: uninitialised VMEM may hold
NaN, and 0 * NaN is NaN). The copies are double-buffered as one pipeline over every (row, KV
head, compute block) unit in grid order: while one unit is computed, the next one's DMAs run, and
the last unit of a row starts the first of the next row (when that row has any: a free row
breaks the chain and the next used row starts its own). The pipeline's state (which buffer holds
the next unit, whether it was started) lives in SMEM scratch across grid steps, which is why the
rows run in order.

Layouts Mosaic takes. q is passed as [rows, KV, f, groups, lanes] (f = 1 and lanes = hd unless
folded) and the output comes back as [rows, KV, groups, lanes], blocked whole per row: a block's
last two dimensions are the array's own, whatever groups and hd are (the stock kernel blocks q by
[groups, hd] slices of H and its running max and sum like q, which a head_dim of 64 breaks). The
running max and sum are loop carries of shape [groups, 1] and the accumulator [groups, lanes] in
float32; nothing is stored to a ref at a lane offset. A pool block is a DMA of one contiguous
B * hd run; B should be a multiple of 16 for bfloat16 (8 for float32), the engine's default is 16.
The sinks come in as [KV, groups, 128] (broadcast over lanes), read whole.

Why a lane fold. The TPU compiler lays an array whose minor dimension is under 128 out with
another axis minor (no lanes padded): a [KV, blocks, B, 64] pool gets its block axis minor, and
a Pallas kernel reads its operands row-major, so XLA copies the whole pool before each call
(test_pallas_decode.py shows it). The same bytes as [KV, blocks, B * hd / 128, 128] are laid out
row-major and read in place. Folded, a compute block's K is [bk / f, 128]: q goes in once per lane
group c (q in lanes [c * hd, (c + 1) * hd), zeros elsewhere), so the f dots give the scores of the
positions t * f + c, all f folded into one running max and sum; each P.V dot is kept only in its
own lane group, and the f groups of the output are summed outside the kernel (in float32). The
MXU then does f times the multiply-adds of the unfolded head (the rest against zeros); decode is
bound by reading K and V, not by the MXU, so that should cost little (unmeasured).
(tpu-inference's head_dim-64 kernel folds K and V of one position into one 128-lane row instead.)

Nothing here ran on a TPU. tests/unit/test_pallas_decode.py runs the kernel in Pallas's TPU
interpret mode on the CPU (which simulates the DMAs and semaphores, and fills scratch with NaN)
against the gather path, and compiles it for v5e and v6e chips with libtpu's compile-only
devices (Mosaic accepts it: head_dim 64, 128 and 256 unfolded, 64 and 32 folded, windows, sinks,
bfloat16 and float32). Its speed on a TPU, and COMPUTE_BLOCK_TOKENS, are unmeasured guesses.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["COMPUTE_BLOCK_TOKENS", "decode_attention", "pages_per_compute_block"]

COMPUTE_BLOCK_TOKENS = 512  # positions per compute block, at most (a guess: never timed on a TPU)
_NEG = -1e30  # a masked score, as the gather path's: finite, so exp(_NEG - m) is 0, never NaN


def pages_per_compute_block(blocks_per_seq: int, block_size: int, tokens: int = COMPUTE_BLOCK_TOKENS) -> int:
    """Pool blocks per compute block: as many as fit `tokens` positions (at least one), at most the
    table's width (the table is padded to a multiple of it)."""
    return max(1, min(blocks_per_seq, tokens // block_size))


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tables: jax.Array,
                     sinks: jax.Array | None = None, *, scale: float, softcap: float = 0.0, window: int = 0,
                     pages: int | None = None, interpret=None) -> jax.Array:
    """One decode token per row over one layer of the paged pool (module docstring: shapes and
    semantics). `pages`: pool blocks per compute block (default `pages_per_compute_block`).
    `interpret`: passed to pallas_call (None: compiled for the TPU, or the interpret mode a
    `pltpu.force_tpu_interpret_mode` context sets). Returns [rows, H, hd] in q's dtype."""
    rows, heads, hd = q.shape
    kvh, num_blocks, block_rows, lanes = k.shape
    fold = lanes // hd if lanes != hd and lanes == 128 and 128 % hd == 0 else 1
    if k.shape != v.shape or lanes != hd * fold or heads % kvh:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: need [rows, H, hd] and two "
                         f"[KV, num_blocks, B, hd] (or, hd dividing 128, [KV, num_blocks, B * hd / 128, 128]) "
                         f"with H a multiple of KV")
    if lengths.shape != (rows,) or tables.ndim != 2 or tables.shape[0] != rows:
        raise ValueError(f"lengths {lengths.shape} must be [rows] and tables {tables.shape} [rows, nb] "
                         f"for rows={rows}")
    bs = block_rows * fold  # positions a pool block holds
    groups = heads // kvh
    nb = tables.shape[1]
    pages = pages or pages_per_compute_block(nb, bs)
    nbp = -(-nb // pages) * pages
    tables = jnp.asarray(tables, jnp.int32)
    if nbp > nb:  # the last compute block's missing columns: never copied (past every length)
        tables = jnp.pad(tables, ((0, 0), (0, nbp - nb)))
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, nb * bs)  # never past the table
    q4 = q.reshape(rows, kvh, groups, hd)
    # q once per lane group c of a folded row, in lanes [c * hd, (c + 1) * hd), zeros elsewhere
    qf = jnp.stack([jnp.pad(q4, ((0, 0),) * 3 + ((c * hd, lanes - (c + 1) * hd),)) for c in range(fold)], axis=2)
    has_sinks = sinks is not None

    q_block = pl.BlockSpec((None, kvh, fold, groups, lanes), lambda r, *_: (r, 0, 0, 0, 0))
    o_block = pl.BlockSpec((None, kvh, groups, lanes), lambda r, *_: (r, 0, 0, 0))
    in_specs = [q_block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    args = [qf, k, v]
    if has_sinks:
        in_specs.append(pl.BlockSpec((kvh, groups, 128), lambda r, *_: (0, 0, 0)))
        s = jnp.asarray(sinks, jnp.float32).reshape(kvh, groups, 1)
        args.append(jnp.broadcast_to(s, (kvh, groups, 128)))
    kernel = functools.partial(_kernel, kvh=kvh, pages=pages, nbp=nbp, bs=bs, hd=hd, fold=fold, scale=float(scale),
                               softcap=float(softcap or 0.0), window=int(window or 0), has_sinks=has_sinks)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,  # lengths, tables (flat)
            grid=(rows,),
            in_specs=in_specs,
            out_specs=o_block,
            scratch_shapes=[
                pltpu.VMEM((2, pages, block_rows, lanes), k.dtype),  # K, double-buffered
                pltpu.VMEM((2, pages, block_rows, lanes), v.dtype),  # V
                pltpu.SemaphoreType.DMA((2,)),  # one a buffer, K and V copies both
                pltpu.SMEM((2,), jnp.int32),  # [buffer of the next unit, whether it was started]
            ]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        # folded: each lane group holds its positions' share of the output, summed here (in float32)
        out_shape=jax.ShapeDtypeStruct((rows, kvh, groups, lanes), q.dtype if fold == 1 else jnp.float32),
        interpret=interpret if interpret is not None else False,
        name="tandem_paged_decode",
    )(lengths, tables.reshape(-1), *args)
    if fold > 1:
        out = out.reshape(rows, kvh, groups, fold, hd).sum(axis=3).astype(q.dtype)
    return out.reshape(rows, heads, hd)


def _kernel(lengths_ref, tables_ref, q_ref, k_hbm, v_hbm, *rest, kvh: int, pages: int, nbp: int, bs: int,
            hd: int, fold: int, scale: float, softcap: float, window: int, has_sinks: bool):
    if has_sinks:
        sinks_ref, o_ref, k_buf, v_buf, sems, state = rest
    else:
        sinks_ref = None
        o_ref, k_buf, v_buf, sems, state = rest
    r = pl.program_id(0)
    rows = pl.num_programs(0)
    bk = pages * bs  # positions a compute block holds
    groups, lanes = q_ref.shape[2], q_ref.shape[3]
    n = bk // fold  # rows of a compute block's K and V buffers (lanes wide)

    def lane_group(shape):
        """Which of a folded row's positions each lane holds: lane // hd (0 unfolded)."""
        lane = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
        return sum(((lane >= c * hd).astype(jnp.int32) for c in range(1, fold)), jnp.zeros(shape, jnp.int32))

    def span(length):
        """The compute blocks [lo, hi) and the positions [first, length) a row of `length` reads."""
        first = jnp.maximum(length - window, 0) if window else jnp.int32(0)
        return lax.div(first, bk), lax.div(length + bk - 1, bk), first  # lax.div: `//` lowers through sign, which needs a chip to ask

    def copies(row, head, i, slot, length):
        """The DMAs of unit (row, head, compute block i) into buffer `slot`: one per pool block the
        row reads (each with the condition it is copied under, the same at start and at wait)."""
        _, _, first = span(length)
        out = []
        for j in range(pages):
            p = i * pages + j
            page = tables_ref[row * nbp + p]
            needed = (p >= lax.div(first, bs)) & (p * bs < length)
            out.append((needed,
                        pltpu.make_async_copy(k_hbm.at[head, page], k_buf.at[slot, j], sems.at[slot]),
                        pltpu.make_async_copy(v_hbm.at[head, page], v_buf.at[slot, j], sems.at[slot])))
        return out

    def start(row, head, i, slot, length):
        for needed, ck, cv in copies(row, head, i, slot, length):
            @pl.when(needed)
            def _():
                ck.start()
                cv.start()

    def wait(row, head, i, slot, length):
        for needed, ck, cv in copies(row, head, i, slot, length):
            @pl.when(needed)
            def _():
                ck.wait()
                cv.wait()

    @pl.when(r == 0)
    def _():
        state[0] = 0
        state[1] = 0

    length = lengths_ref[r]
    lo, hi, first = span(length)
    nxt = jnp.minimum(r + 1, rows - 1)
    next_length = jnp.where(r + 1 < rows, lengths_ref[nxt], 0)
    next_lo = span(next_length)[0]

    @pl.when(hi <= lo)  # a free row: nothing read, zeros out
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        state[1] = 0

    @pl.when(hi > lo)
    def _():
        @pl.when(state[1] == 0)  # not started by the previous row
        def _():
            start(r, 0, lo, state[0], length)

        def head_loop(h, slot):
            qs = [q_ref[h, c] for c in range(fold)]  # [groups, lanes] each: q in lane group c
            if has_sinks:
                m0 = jnp.max(sinks_ref[h], axis=1, keepdims=True)  # [groups, 1] (128 equal lanes)
                total0 = jnp.ones((groups, 1), jnp.float32)
            else:
                m0 = jnp.full((groups, 1), _NEG, jnp.float32)
                total0 = jnp.zeros((groups, 1), jnp.float32)
            acc0 = jnp.zeros((groups, lanes), jnp.float32)

            def block_loop(i, carry):
                m, total, acc, slot = carry
                # the next unit: this head's next block, the next head's first, or the next row's first
                last_block = i + 1 >= hi
                last_head = h + 1 >= kvh
                n_row = jnp.where(last_block & last_head, r + 1, r)
                n_head = jnp.where(last_block, jnp.where(last_head, 0, h + 1), h)
                n_i = jnp.where(last_block, jnp.where(last_head, next_lo, lo), i + 1)
                n_len = jnp.where(last_block & last_head, next_length, length)
                has_next = jnp.logical_not(last_block & last_head) | (next_length > 0)

                @pl.when(has_next)
                def _():
                    start(n_row, n_head, n_i, 1 - slot, n_len)

                wait(r, h, i, slot, length)
                kb = k_buf[slot].reshape(n, lanes)  # row t: positions i * bk + t * fold + c, c < fold
                vb = v_buf[slot].reshape(n, lanes)
                if kb.dtype != qs[0].dtype:
                    kb, vb = kb.astype(qs[0].dtype), vb.astype(qs[0].dtype)
                scores = []
                for c, q in enumerate(qs):  # the positions in lane group c of each row
                    sc = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                    sc = sc * scale
                    if softcap:
                        sc = jnp.tanh(sc / softcap) * softcap
                    pos = i * bk + lax.broadcasted_iota(jnp.int32, sc.shape, 1) * fold + c
                    scores.append(jnp.where((pos < length) & (pos >= first), sc, _NEG))
                m_new = m
                for sc in scores:
                    m_new = jnp.maximum(m_new, jnp.max(sc, axis=1, keepdims=True))
                alpha = jnp.exp(m - m_new)
                probs = [jnp.exp(sc - m_new) for sc in scores]
                total = alpha * total + sum(jnp.sum(p, axis=1, keepdims=True) for p in probs)
                vpos = i * bk + lax.broadcasted_iota(jnp.int32, vb.shape, 0) * fold + lane_group(vb.shape)
                vb = jnp.where((vpos < length) & (vpos >= first), vb, jnp.zeros((), vb.dtype))  # unread: maybe NaN
                pv = None
                for c, p in enumerate(probs):
                    part = lax.dot_general(p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())),
                                           preferred_element_type=jnp.float32)
                    if fold > 1:  # lane group c holds what positions c of the rows contribute
                        part = jnp.where(lane_group(part.shape) == c, part, 0.0)
                    pv = part if pv is None else pv + part
                acc = alpha * acc + pv
                return m_new, total, acc, 1 - slot

            _, total, acc, slot = lax.fori_loop(lo, hi, block_loop, (m0, total0, acc0, slot))
            o_ref[h] = (acc / total).astype(o_ref.dtype)
            return slot

        slot = lax.fori_loop(0, kvh, head_loop, state[0])
        state[0] = slot
        state[1] = (next_length > 0).astype(jnp.int32)
