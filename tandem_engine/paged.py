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

The step's attention is attention.py's one entry point (`ragged_attention`): decode rows through
their tables, a seated prompt's chunk over its prefix; on a TPU the Pallas kernel where the family
and the pool's dtype allow it, Tandem's C++ kernel on a CPU, the gather path otherwise, chosen
when the step is compiled, for the platform it is compiled for (`jax.lax.platform_dependent`), so
an engine, and a TPU program compiled ahead of time on a CPU host, need no flag.

Tensor parallelism (tp > 1, sharding.Layout.kv_pool): each layer buffer is split on its KV axis,
so each chip holds its heads' slice of every block; the block tables (and the allocator's ids)
are the same on every chip. Each layer's write of the new rows and its attention run per chip in
a `shard_map` over its heads (`attention.ragged_attention`, given the chip's head counts): the Pallas kernel
is a Mosaic call, which XLA's partitioner cannot split (it refuses to compile it), and the gather
path left to the partitioner all-gathers across chips. Query head h reads KV head h // groups on
the same chip (sharding.py), so nothing crosses chips until the o projection's all-reduce.
No I/O, no host state in the functions.
"""
from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tandem_engine.arch import ModelConfig
from tandem_engine.attention import ragged_attention
from tandem_engine.model import decoder_layer, embed, layer_consts, layer_loop, logits_from_hidden, _layer_rope_tables
from tandem_engine.pool_layout import block_positions, block_shape, fold
from tandem_engine.sharding import AXIS

NULL_BLOCK = 0


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
               sharding: NamedSharding | None = None, layer_blocks: Sequence[int] | None = None):
    """An all-zero pool (k, v): each a tuple of num_layers arrays [KV, blocks + 1, B / f, hd * f]
    (pool_layout.py: lane-folded, f = lane_fold(hd, B); block 0: the null block), one buffer per
    layer. `sharding` (tp > 1: Layout.kv_pool, split on the KV axis): each chip allocates only
    its heads' slice of every block. `layer_blocks`: each layer's own block count instead (a
    family whose windowed layers keep their blocks in a smaller group of their own: WindowGroup)."""
    counts = [int(blocks)] * num_layers if layer_blocks is None else [int(b) for b in layer_blocks]

    def shape(n):
        return (kv_heads, n + 1, *block_shape(block_size, head_dim))  # lane-folded (pool_layout.py)

    return (tuple(jnp.zeros(shape(n), dtype, device=sharding) for n in counts),
            tuple(jnp.zeros(shape(n), dtype, device=sharding) for n in counts))


def window_blocks_per_row(window: int, block_size: int, span: int, reuse: bool) -> int:
    """The most windowed blocks a row holds (WindowGroup.per_row before max_len's cap): the blocks
    [lo - behind, hi] reaches, lo = p - window + 1 the window's first position, hi = p + span - 1
    the last one a call writes (span: the most positions one call writes to a row), behind = span +
    a block with reuse (where a row's last full block boundary can lie behind its position)."""
    behind = int(span) + int(block_size) if reuse else 0
    return -(-(int(window) + behind + int(span) - 1) // int(block_size)) + 1


class WindowGroup:
    """The blocks of a family's windowed layers where some layers are global (gemma2, gemma3,
    gpt-oss): those layers' buffers hold `per_row` blocks a row, in a block-id space and a table
    of their own (vLLM's hybrid KV cache manager keeps a block table per layer group alike). A
    row's windowed table has a block only where its window still reaches: `fit(slot, lo, hi)`
    gives back the blocks wholly before position `lo` and takes the ones [lo, hi] falls in, so a
    row never holds more than `per_row` (sized for the widest window plus the most positions one
    call writes) and the group never runs short. The global layers keep every block in the
    engine's own table and allocator, as before. Host state only; the device sees the table.

    With `reuse` (the engine's block cache keeps finished rows' global blocks): a row keeps
    `behind` positions more than its window (a prefix chunk and a block: where its last full
    block boundary can lie behind its position), and a finished row leaves the windowed blocks
    of the window before that boundary as a kept tail (`keep_tail`), keyed by the chain key of
    its last full block: a later sequence that matches the chain to exactly there takes the tail
    into its windowed table (`take_tail`, `place`), as a conversation's next turn does. A tail takes
    no room of its own: its blocks are the finished row's, and they count as free to the rows (the
    least recently used tails are dropped when a row needs their blocks, as the block cache's are;
    the rows never hold more than slots x per_row, and a pinned tail is bound for a free row)."""

    def __init__(self, slots: int, max_blocks: int, block_size: int, window: int, span: int,
                 reuse: bool = False):
        self.block_size = int(block_size)
        self.window = int(window)
        self.behind = int(span) + self.block_size if reuse else 0
        self.per_row = min(window_blocks_per_row(window, block_size, span, reuse), int(max_blocks))
        self.reuse = bool(reuse)
        self.total = int(slots) * self.per_row
        self.alloc = BlockAllocator(self.total)
        self.table = np.zeros((int(slots), int(max_blocks)), np.int32)
        self._tails: OrderedDict[bytes, tuple[int, list[int]]] = OrderedDict()  # key -> (first, blocks)
        self.taken = 0  # tails placed into rows (a sequence started on a kept chain's end)

    def fit(self, slot: int, lo: int, hi: int) -> bool:
        """Row `slot`'s windowed blocks: those wholly before position `lo` back, the ones [lo, hi]
        falls in taken (hi clamped by the caller to max_len - 1). Returns whether the table changed."""
        row = self.table[slot]
        first = max(0, int(lo) - self.behind) // self.block_size
        last = min(int(hi) // self.block_size, row.shape[0] - 1)
        passed = [int(b) for b in row[:first] if b]
        if passed:
            self.alloc.release(passed)
            row[:first] = 0
        missing = [j for j in range(first, last + 1) if not row[j]]
        if missing:
            if len(missing) + sum(1 for b in row if b) > self.per_row:
                raise RuntimeError(f"row {slot} would hold more than {self.per_row} windowed blocks "
                                   f"(positions {lo}..{hi}): a call writes more positions than the group was sized for")
            while self.alloc.free_count() < len(missing) and self._tails:  # the tails give way
                self._drop_tail(next(iter(self._tails)))
            ids = self.alloc.alloc(len(missing))
            if ids is None:  # rows and pinned tails beyond slots x per_row: a caller broke the rules
                raise RuntimeError(f"the windowed group has {self.alloc.free_count()} free blocks of {self.total}; "
                                   f"row {slot} needs {len(missing)}")
            row[missing] = ids
        return bool(passed or missing)

    def release(self, slot: int) -> None:
        """Every windowed block of row `slot` back."""
        row = self.table[slot]
        held = [int(b) for b in row if b]
        if held:
            self.alloc.release(held)
        row[:] = 0

    def free_count(self) -> int:
        """Blocks free for the rows: the free list and the blocks only kept tails hold."""
        only_tails = {b for _, blocks in self._tails.values() for b in blocks if self.alloc.refcount[b] == 1}
        return self.alloc.free_count() + len(only_tails)

    def usable(self, key: bytes) -> bool:
        """Whether a tail is kept for the chain ending at `key`."""
        return key in self._tails

    def keep_tail(self, slot: int, key: bytes, length: int) -> bool:
        """Row `slot`'s windowed blocks of the window before position `length` (a block boundary:
        its kept chain's end, `key`) kept for a later sequence (one more reference each). Not
        kept when the row no longer holds them all. Returns whether a tail is kept under `key`."""
        if key in self._tails:
            self._tails.move_to_end(key)
            return True
        if not self.reuse or length < self.block_size:
            return False
        first, end = max(0, int(length) - self.window + 1) // self.block_size, int(length) // self.block_size
        blocks = [int(b) for b in self.table[slot, first:end]]
        if not blocks or not all(blocks):
            return False
        self.alloc.share(blocks)
        self._tails[key] = (first, blocks)
        return True

    def take_tail(self, key: bytes) -> tuple[int, list[int]]:
        """The tail kept under `key`, pinned for the caller (one more reference each):
        (its first logical block, its blocks). KeyError when none is kept."""
        first, blocks = self._tails[key]
        self._tails.move_to_end(key)
        self.alloc.share(blocks)
        return first, list(blocks)

    def place(self, slot: int, first: int, blocks: Sequence[int]) -> None:
        """A taken tail into empty row `slot` from logical block `first` (its pins pass to the row)."""
        row = self.table[slot]
        if row.any():
            raise ValueError(f"row {slot} holds windowed blocks already")
        row[first:first + len(blocks)] = blocks
        self.taken += 1

    def _drop_tail(self, key: bytes) -> None:
        _, blocks = self._tails.pop(key)
        self.alloc.release(blocks)

    def ids_for(self, slot: int, blocks: int) -> np.ndarray:
        """The row's first `blocks` table entries (0 where the window passed): where an insert
        writes a prompt's windowed layers."""
        return self.table[slot, :blocks].copy()


def write_prompt_blocks(k_pool: tuple, v_pool: tuple, k, v, ids, window_ids=None, windowed: Sequence[bool] = ()):
    """A prompt's k, v [L, T, KV, hd] into the pool's blocks `ids` int32 [ceil(T / B)] in order
    (rows past T in the last block are zero padding; an id of 0 drops its rows into the null
    block). k_pool, v_pool: tuples of L layer buffers [KV, num_blocks, B / f, hd * f] (lane-folded,
    pool_layout.py). `window_ids` (a WindowGroup's): the blocks of the layers `windowed` marks
    (0 where the window passed). Returns the new (k_pool, v_pool)."""
    num_layers, t, kvh, hd = k.shape
    bs = block_positions(k_pool[0], hd)
    n = ids.shape[0]
    pad = n * bs - t

    def blocks(x, pool):
        x = jnp.pad(x.astype(pool[0].dtype), ((0, 0), (0, pad), (0, 0), (0, 0)))
        x = jnp.transpose(x.reshape(num_layers, n, bs, kvh, hd), (0, 3, 1, 2, 4))  # [L, KV, n, B, hd]
        x = fold(x, hd)  # [L, KV, n, B / f, hd * f]: the prompt's blocks as the pool stores them
        return tuple(layer.at[:, window_ids if window_ids is not None and windowed[i] else ids].set(x[i])
                     for i, layer in enumerate(pool))

    return blocks(k, k_pool), blocks(v, v_pool)


def decode_forward_paged(params: dict, tokens, positions, k_pool: tuple, v_pool: tuple, table, cfg: ModelConfig,
                         *, max_len: int, active: jax.Array | None = None, logits_at: jax.Array | None = None, mesh: Mesh | None = None, chunk: int = 0,
                         window_table=None):
    """`decode_forward` over the paged pool: one step for `rows` = len(tokens) rows.

    k_pool, v_pool: tuples of L layer buffers [KV, num_blocks, B / f, hd * f] (lane-folded,
    pool_layout.py); table int32 [rows, nb]
    (each row's first nb blocks: the caller cuts the table to the step's compiled width, wide
    enough for every active row's blocks). The new K/V of row r go to position p =
    min(positions[r], max_len - 1), in block table[r, p // B] at row p % B; a row that is not
    `active`, or whose p falls past its table, writes the null block. Each layer then attends
    over its own buffer (attention.ragged_attention: lengths p + 1, at most nb * B; 0 for a row
    that is not `active`, whose output is zeros). params["layers"]: stacked or per-layer
    (`split_layers`); the layers run unrolled. `logits_at`: the one row whose logits are
    wanted (then [vocab]). `mesh` (tensor parallelism: a "tp" axis over > 1 chips): the pool
    MUST be split on its KV axis (sharding.Layout.kv_pool) and q/k/v by head, as the layout's
    weights make them; each layer's write and attention then run per chip on its own heads
    (`ragged_attention` in a shard_map), the tables replicated. Returns (logits [rows, vocab],
    k_pool, v_pool). `chunk` (a ragged call, cores.ragged_core; a prefill pod's hit over its
    prefix pool, prefix_pool.py, where every row is the chunk): the last `chunk` rows are
    positions of one sequence (a prompt's chunk, every one with that sequence's table row); they
    attend as attention.chunk_attention does (the prefix's blocks gathered once for all of them, the
    chunk's own K/V dense), the rows before them as decode rows. `window_table` int32 [rows, nb]
    (a WindowGroup's, of the same width): the tables the windowed layers' buffers are read and
    written through (None: every layer reads `table`)."""
    nb, bs = table.shape[1], block_positions(k_pool[0], cfg.head_dim)
    write_pos = jnp.minimum(positions, max_len - 1)
    j = write_pos // bs
    ok = j < nb
    if active is not None:
        ok = ok & active

    def targets(tab):  # [rows]: each row's target position of a head's num_blocks * B
        block = jnp.take_along_axis(tab, jnp.minimum(j, nb - 1)[:, None], axis=1)[:, 0]
        return jnp.where(ok, block, NULL_BLOCK) * bs + write_pos % bs

    flat = targets(table)
    flat_w = None if window_table is None else targets(window_table)
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
            attend = partial(ragged_attention, cfg=local, window=cfg.window(i), has_sinks=sinks is not None,
                             chunk=chunk)
            grouped = window_table is not None and cfg.window(i) > 0  # a windowed layer's own blocks
            args = (q, k[:, 0], v[:, 0], k_pool[i], v_pool[i], flat_w if grouped else flat,
                    window_table if grouped else table, write_pos, lengths,
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

