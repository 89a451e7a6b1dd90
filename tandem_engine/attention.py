"""The engine's attention: one entry point, `ragged_attention`, for every query the engine runs.

A call is a ragged batch over one layer (tpu-inference's ragged paged attention is the model):
decode rows first, one query each, reading their KV from the pool through their block tables;
then prompt chunks, each a run of consecutive positions of one sequence, attending causally to
their own K/V and to the prefix their sequence already holds in the pool. The three shapes the
engine serves are three fillings of it:

- a decode step (paged.decode_forward_paged): decode rows only;
- a ragged call (cores.ragged_core: a seated prompt's chunk beside the decode rows) and a prefill
  pod's prompt over its cached prefix (prefix_pool.py): decode rows (or none) and one chunk over
  a prefix in the pool;
- a whole prompt's prefill (model.py's prefill forwards): chunks from position 0 with no pool,
  their K/V returned to the caller (the prefill pod's KV leaves as dense rows for the pull, so
  it is never written to a pool first).

Under it, two computations, each written once:
- `causal_attention`: a chunk's queries over its own K/V, dense (head-major grouped queries,
  float32 scores, soft caps, windows, sinks, in query blocks of PREFILL_BLOCK rows); with
  `partials` it also gives each row's log-sum-exp, merged with the prefix's (`chunk_attention`).
- the fold over pool blocks (`_pool_fold`, online softmax in float32 over pieces of READ_CHUNK
  positions): a chunk's prefix, and the decode rows on the gather path (`paged_attention`).
For decode rows the platform picks the fast path when the step is compiled (`_rows_attention`:
`jax.lax.platform_dependent`): the Pallas kernel on a TPU where the family allows it
(paged_attention.py), Tandem's C++ kernel on a CPU (cpu_kernels: the blocks read in place), the
gather path otherwise. The pool's layout (lane-folded blocks) is pool_layout.py's; the pool, its
allocator and the step around this attention are paged.py's. No I/O, no host state.
"""
from __future__ import annotations

import logging
import math
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from tandem_engine.arch import ModelConfig
from tandem_engine.cpu_kernels import paged_attention_kernel
from tandem_engine.paged_attention import PagedAttention, kernel_gaps
from tandem_engine.pool_layout import block_positions, unfold

log = logging.getLogger(__name__)

NO_WINDOW = 1 << 30  # a global layer's window: farther than any position
_NEG = -1e30  # a masked score: finite, so a row with nothing to attend to yields no NaN


def ragged_attention(q, k, v, k_layer, v_layer, flat, table, write_pos, lengths, sinks, *, cfg: ModelConfig,
                     window, has_sinks: bool, chunk: int = 0, chunks: int = 1):
    """One layer's attention over a ragged batch, on the heads `cfg` counts (all of them, or under
    tp one chip's: cfg's num_heads and num_kv_heads are then the chip's; paged.decode_forward_paged
    runs it per chip in a shard_map).

    q [N, 1, H, hd], k, v [N, KV, hd] (rotated): the decode rows first, then `chunks` chunks of
    `chunk` consecutive positions each (N = rows + chunks * chunk; `chunk` 0: decode rows only).
    `sinks`: the layer's [H] when `has_sinks`, else a placeholder (a shard_map argument must be an
    array). `window`: the layer's (0: global).

    With a pool (k_layer, v_layer: one layer's buffers [KV, num_blocks, B / f, hd * f],
    lane-folded): every query's new K/V is written at `flat` [N] (block * B + offset) first; each
    decode row then attends to its positions <= write_pos through its `table` row (`lengths`: 0
    for a free row), and each chunk attends to its prefix in the pool (through the table row of
    its first position, from its first position write_pos back) and to its own K/V densely
    (`chunk_attention`). Without one (k_layer None: a whole prompt's prefill): every query is a
    chunk's from position 0, no decode rows; `flat`, `table`, `write_pos` and `lengths` are
    unused, and `window` may be traced (the prefill's layer scan carries it per layer).

    Returns (attn [N, 1, H * hd], k_layer, v_layer: the buffers written, or None without a pool)."""
    sink = sinks if has_sinks else None
    n = q.shape[0]
    r = n - chunk * chunks  # decode rows
    if k_layer is None:
        if r:
            raise ValueError(f"{r} decode rows with no pool to read their KV from")
        return _prompt_attention(q, k, v, cfg, window, sink, chunk, chunks), None, None
    hd = cfg.head_dim
    k_layer, v_layer = _write_rows(k_layer, k, flat, hd), _write_rows(v_layer, v, flat, hd)
    out = []
    if r:
        out.append(_rows_attention(q[:r], k_layer, v_layer, table[:r], write_pos[:r], lengths[:r], sinks, cfg=cfg,
                                   window=window, has_sinks=has_sinks))
    for c in range(chunks if chunk else 0):
        a = r + c * chunk
        out.append(chunk_attention(q[a:a + chunk], k[a:a + chunk], v[a:a + chunk], k_layer, v_layer,
                                   table[a:a + 1], write_pos[a], cfg, window=window, sinks=sink))
    return (out[0] if len(out) == 1 else jnp.concatenate(out)), k_layer, v_layer


def _prompt_attention(q, k, v, cfg: ModelConfig, window, sinks, chunk: int, chunks: int):
    """`chunks` prompts of `chunk` positions each from position 0, each over its own K/V only:
    `causal_attention` of the prompts as a batch [chunks, chunk]. Returns [N, 1, H * hd]."""
    pos = jnp.arange(chunk, dtype=jnp.int32)
    if isinstance(window, int):
        window = window or NO_WINDOW
    mask = _window_mask(pos[:, None], pos[None, :], window)[None]  # [1, T, T]
    out = causal_attention(q.reshape(chunks, chunk, *q.shape[2:]), k.reshape(chunks, chunk, *k.shape[1:]),
                           v.reshape(chunks, chunk, *v.shape[1:]), mask, cfg, sinks)
    return out.reshape(chunks * chunk, 1, out.shape[-1])


def _scores(raw: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Scaled (and soft-capped) float32 attention scores."""
    s = raw * (cfg.query_scale or 1.0 / math.sqrt(cfg.head_dim))
    if cfg.attn_softcap:
        s = jnp.tanh(s / cfg.attn_softcap) * cfg.attn_softcap
    return s


PREFILL_BLOCK = 128  # query rows per block of a prompt's causal self-attention (`causal_attention`)


def _grouped_attention(q, k, v, mask, cfg: ModelConfig, sinks: jax.Array | None = None) -> jax.Array:
    """q [B, T, H, hd]; k, v [B, S, KV, hd]; mask [B or 1, T, S] (True = attend). Returns [B, T, H*hd].

    Query heads are grouped per KV head (no repeat of K/V); softmax runs in float32. `sinks` [H]
    (gpt-oss): one more logit per head in the softmax whose value is dropped. (`causal_attention`
    in one block: every query row against all S keys.)
    """
    return causal_attention(q, k, v, mask, cfg, sinks, block=max(q.shape[1], 1))


def causal_attention(q, k, v, mask, cfg: ModelConfig, sinks: jax.Array | None = None, *,
                     block: int = PREFILL_BLOCK, partials: bool = False):
    """The engine's one dense softmax attention: a prompt's (or a ragged call's chunk's) queries
    over its own keys, the prefill's and the chunk's alike (`chunk_attention` merges it with
    the prefix read from the pool). q [B, T, H, hd]; k, v [B, S, KV, hd]; mask [B or 1, T, S]
    (True = attend: causal and within the layer's window, or any mask when T <= block).

    Query heads grouped per KV head (no repeat of K/V), scores and softmax in float32, soft-capped
    where the family caps; `sinks` [H] (gpt-oss) one more logit per head whose value is dropped.
    Past `block` rows the queries run in blocks, each against the keys up to its own last row (S ==
    T: the rows after it are masked for every query of the block): a [T, T] score matrix is about
    half computed (10 of 16 blocks at T = 4 x block), each row's softmax the one over all T keys up
    to float rounding (masked keys add exp(-1e30 - m) = 0).

    Returns [B, T, H * hd] in v's dtype; with `partials`, (out [B, KV, groups, T, hd], lse [B, KV,
    groups, T] float32: each row's log-sum-exp, sink included) for a merge with another span's."""
    b, t = q.shape[:2]
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    groups = cfg.num_heads // kvh
    # head-major: with each head's rows contiguous the scores come out of the dot as [.., T, S]
    # rows, the layout the softmax reads; XLA CPU given the token-major einsum picked [KV, S,
    # groups*T] and transposed the whole [H, T, S] score matrix twice around the softmax (measured:
    # the attention of a 512-token prompt 2.6x slower, the whole prefill 1.7x)
    qg = jnp.transpose(q.reshape(b, t, kvh, groups, hd), (0, 2, 3, 1, 4))  # [B, KV, groups, T, hd]
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, KV, S, hd]
    if kt.dtype != q.dtype:
        kt, vt = kt.astype(q.dtype), vt.astype(q.dtype)
    s_all = kt.shape[2]
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, kvh, groups, 1)
    outs, lses = [], []
    for start in range(0, t, block):
        end = min(start + block, t)
        n, keys = end - start, (s_all if t <= block else end)
        sc = jnp.einsum("bkqd,bksd->bkqs", qg[:, :, :, start:end].reshape(b, kvh, groups * n, hd), kt[:, :, :keys],
                        preferred_element_type=jnp.float32)
        sc = _scores(sc, cfg).reshape(b, kvh, groups, n, keys)
        sc = jnp.where(mask[:, None, None, start:end, :keys], sc, -1e30)
        m = jnp.max(sc, axis=-1)
        if sink is not None:
            m = jnp.maximum(m, sink)
        p = jnp.exp(sc - m[..., None])
        d = jnp.sum(p, axis=-1)
        if sink is not None:
            d = d + jnp.exp(sink - m)
        probs = (p / d[..., None]).astype(vt.dtype).reshape(b, kvh, groups * n, keys)
        outs.append(jnp.einsum("bkqs,bksd->bkqd", probs, vt[:, :, :keys]).reshape(b, kvh, groups, n, hd))
        lses.append(m + jnp.log(d))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    if partials:
        return out, (lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=3))
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, cfg.num_heads * hd)


def _window_mask(q_pos: jax.Array, k_pos: jax.Array, window: jax.Array) -> jax.Array:
    """Causal and inside the window: k <= q and q - k < window ([..., T, S] from [..., T, 1] and
    [..., 1, S])."""
    return (k_pos <= q_pos) & (q_pos - k_pos < window)



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
    prefill's (`causal_attention`) with each row's log-sum-exp for a merge with the prefix's:
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
