"""A prefill pod's prefix cache: the KV of prompt prefixes already prefilled, kept in a pool of KV
blocks in device memory (paged.py's layout) that a later prompt's prefill reads in place.

Blocks of `block_size` tokens are keyed by the hash chain of tandem_core/prefix.py (a key covers
the whole prefix up to its block, salted with the model and dtype: `device_cache_for`), so a
lookup walks a prompt's keys until the first miss, always leaving at least the last token to
compute (the first token's logits come from the last prompt position). A hit is a list of pool blocks, pinned (block_cache.BlockCache, the index the decode side uses
too); the prompt's row is those blocks plus new ones for the rest, and the rest runs in chunks of
`prefix_chunk` tokens through the ragged call's forward and attention (`paged.decode_forward_paged`
with every row the chunk, as `cores.ragged_core` runs a prompt's chunk beside decode rows: each
layer writes the chunk's K/V into the new blocks, then `attention.chunk_attention` reads the chunk's
prefix from the pool through the row's block table, in place, attends to the chunk's own K/V
densely and causally, and merges the two by their log-sum-exps; windows, sinks and soft caps as
the step has them). One compiled chunk for every prompt (the table as wide as the largest bucket:
the attention reads only the blocks before the chunk): a hit computes only the rest and copies
nothing. The prompt's full blocks then join the index as they are (no copy either), and the Prefix handed on
(to the KV store and the transfer) is the row's blocks read out once, as any prefill's KV is
read out to the host.

A prompt that misses runs the engine's ordinary prefill (one pass, the fastest), and `insert`
writes its new full blocks into the pool from the prefill's KV where it lies (on the device): an
insert's copy, counted in `insert_copy_bytes`.

Memory: the pool is `budget_bytes` of device memory, allocated when the cache is made; a prompt's
blocks beyond the cached ones are taken for the prefill and given back after it (evicting
cached blocks least recently used first when the pool is short: then the prompt runs without
the cache). `enabled=False` (or a budget under one block): lookups miss without counting and
inserts keep nothing; only `computed` is counted (a pod with the cache off still reports the
prefill tokens it computed). Engine-thread only.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tandem_core.prefix import CacheStats, block_hashes, cache_salt
from tandem_engine.block_cache import BlockCache, CachingAllocator, PrefixMatch
from tandem_engine.cores import _first_tokens
from tandem_engine.paged import NULL_BLOCK, decode_forward_paged, paged_pool, write_prompt_blocks
from tandem_engine.pool_layout import unfold

if TYPE_CHECKING:
    from tandem_engine.engine import Engine


@dataclass
class BlockHit:
    """A prompt's first `length` tokens found in the pool: their blocks, pinned until the
    prefill over them runs (or `DevicePrefixCache.release`)."""

    length: int
    blocks: list[int]
    match: PrefixMatch
    cache: "DevicePrefixCache"


class DevicePrefixCache:
    """A prefill pod's prefix cache (see the module docstring): `lookup` a prompt, hand the hit to
    `Engine.prefill(cached=hit)` (or `release` it), then `insert` the prompt."""

    def __init__(self, engine: "Engine", block_size: int, budget_bytes: int, salt: bytes = b"",
                 enabled: bool = True) -> None:
        if block_size < 1 or budget_bytes < 0:
            raise ValueError(f"block_size ({block_size}) must be >= 1 and budget_bytes ({budget_bytes}) >= 0")
        self.block_size = int(block_size)
        self.budget_bytes = int(budget_bytes)
        self.salt = salt
        self.stats = CacheStats()
        c = engine.cfg
        itemsize = np.dtype(engine._jdtype).itemsize
        self.block_bytes = 2 * c.num_layers * c.num_kv_heads * self.block_size * c.head_dim * itemsize
        self.blocks_total = self.budget_bytes // self.block_bytes if enabled else 0
        self.enabled = self.blocks_total >= 1
        self.engine = engine
        self.insert_copy_bytes = 0  # KV bytes written into the pool for prompts that missed
        self._alloc = CachingAllocator(max(1, self.blocks_total))
        self._index = BlockCache(self._alloc, self.block_size, salt)
        self.k = self.v = None
        if self.enabled:  # tp > 1: split by KV head as the decode pool is (budget_bytes over all the chips)
            self.k, self.v = paged_pool(c.num_layers, c.num_kv_heads, self.blocks_total, self.block_size,
                                        c.head_dim, engine._jdtype, None if engine.layout is None else
                                        engine.layout.kv_pool())

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, ids: Sequence[int]) -> BlockHit | None:
        """The pool blocks of the longest cached run of `ids`' leading blocks, pinned (None on a
        miss), leaving at least the last token to compute. Nothing is copied."""
        if not self.enabled:
            return None
        self.stats.queries += len(ids)
        m = self._index.match(ids)
        if m is None:
            return None
        self.stats.hits += m.length
        return BlockHit(m.length, list(m.blocks), m, self)

    def release(self, hit: BlockHit) -> None:
        """Unpin a hit whose prefill did not run (the request failed before it)."""
        self._index.release(hit.match)

    def insert(self, ids: Sequence[int], kv: Callable[[], tuple]) -> int:
        """Cache the full blocks of `ids` the pool does not hold: `kv()` ([L, T, KV, hd], T >=
        len(ids): the prefill's own KV on the device, a Prefix's k and v, or host arrays) written
        into free blocks (a prompt that ran over a hit left its blocks in already: then nothing is
        written). Returns blocks added."""
        if not self.enabled:
            return 0
        keys = block_hashes(ids, self.block_size, self.salt)
        row: list[int] = []
        new: list[int] = []  # positions in `row` of blocks to write
        for i, key in enumerate(keys):
            block = self._index.block_of(key)
            if block is not None:
                self._alloc.share([block])
                row.append(block)
                continue
            self._index.make_room(1)
            got = self._alloc.alloc(1)
            if got is None:
                break  # the pool is full of blocks rows hold: cache the leading ones only
            row.append(got[0])
            new.append(i)
        if new:
            k, v = kv()
            self._write(k, v, row, new)
        added = self._index.keep(list(ids)[:len(row) * self.block_size], row)
        self._alloc.release(row)
        self.stats.inserted += added
        return added

    def _write(self, k, v, row: list[int], new: list[int]) -> None:
        """The blocks `new` (indices into `row`) from k, v [L, T, KV, hd] into the pool, in one call
        compiled per T (a prompt bucket): every block of the T positions is written, those not new
        (cached already, or past the prompt's full blocks) to the null block. On the device the
        prefill's own KV goes in as it is (before: through the host copy made for the transfer,
        padded there: one more host-to-device copy of every missed prompt's KV on an accelerator)."""
        bs = self.block_size
        ids = np.zeros(-(-k.shape[1] // bs), np.int32)
        for i in new:
            ids[i] = row[i]
        self.k, self.v = _write_core(self.k, self.v, k, v, ids)
        self.insert_copy_bytes += len(new) * self.block_bytes

    def prefill_over(self, engine: "Engine", hit: BlockHit, padded: np.ndarray, n: int, rest: tuple):
        """Engine.prefill over a hit: the prompt's rest in chunks through the pool, reading the
        hit's blocks in place. Returns (k, v [L, bucket, KV, hd], packed first tokens), or None
        when the pool has no blocks for the rest (the hit is let go; the caller prefills whole).
        The prompt's full blocks join the index; the row's blocks are given back."""
        bs, c = self.block_size, hit.length
        bucket = padded.shape[0]
        # one compiled chunk for every prompt: the table as wide as the largest bucket and the ids
        # padded to it (the chunk's attention reads only the blocks before its own positions,
        # attention.chunk_attention, whatever the width); the read-out is as wide as the prompt's bucket
        size = engine.buckets[-1]
        width = -(-size // bs)
        need = -(-n // bs) - len(hit.blocks)
        self._index.make_room(need)
        new = self._alloc.alloc(need)
        if new is None:
            self.release(hit)
            return None
        row = hit.blocks + new
        hit.match.done = True  # its pins are the row's references now
        try:
            table = np.zeros(width, np.int32)
            table[:len(row)] = row
            whole = np.zeros(size, np.int32)
            whole[:n] = padded[:n]
            chunk = engine.prefix_chunk
            packed = None
            for start in range(c, n, chunk):
                m = min(chunk, n - start)
                piece = np.zeros(chunk, np.int32)
                piece[:m] = padded[start:start + m]
                self.k, self.v, packed = _chunk_core(
                    engine.params, piece, np.int32(start), np.int32(m), table, self.k, self.v, whole, *rest,
                    cfg=engine.cfg, max_len=engine.max_len, mesh=engine.mesh)
            k, v = _gather_rows(self.k, self.v, table[:-(-bucket // bs)], head_dim=engine.cfg.head_dim)
            self._index.keep(list(padded[:n]), row)
        finally:
            self._alloc.release(row)
        return k[:, :bucket], v[:, :bucket], packed

    def warmup(self) -> None:
        """Compile what a hit and an insert run: per prompt bucket the insert's write (of a
        prefill's KV, as a miss writes it) and the read-out, and the chunk through the pool (one
        shape for every bucket), with the pool left as it was: every block free, nothing cached.
        Needs the prefill's buckets compiled first (Engine.warmup_prefill)."""
        if not self.enabled:
            return
        from tandem_core.types import SamplingParams

        e, bs = self.engine, self.block_size
        for b in e.buckets:
            if b <= bs or self.blocks_total * bs < b:
                continue
            ids = [1] * b
            # a prefill's own KV (on the device, committed, split by KV head under tp), as a miss
            # inserts it: KV made here instead compiled the insert again on the first real miss of
            # each bucket (an uncommitted array is another argument to jit than a committed one)
            whole = e.prefill(ids, SamplingParams())
            self.insert(ids, lambda whole=whole: (whole.k, whole.v))
            hit = self.lookup(ids)
            if hit is not None:
                e.prefill(ids, SamplingParams(), cached=hit)
            self._index.make_room(self.blocks_total)
        self._index = BlockCache(self._alloc, self.block_size, self.salt)
        self.stats = type(self.stats)()
        self.insert_copy_bytes = 0

    def summary(self) -> dict:
        s = self.stats
        return {"enabled": self.enabled, "block_size": self.block_size, "queries": s.queries,
                "hits": s.hits, "computed": s.computed, "bytes": len(self._index) * self.block_bytes,
                "budget_bytes": self.budget_bytes, "blocks": len(self._index), "evicted": self._index.stats.evicted,
                "hit_copy_bytes": s.hit_copy_bytes, "insert_copy_bytes": self.insert_copy_bytes}


def device_cache_for(engine: "Engine", block_size: int, budget_bytes: int, enabled: bool = True) -> DevicePrefixCache:
    """A cache whose keys are salted with this engine's model and dtype (as every pod's prefix
    keys are: the gateway's prefix routing needs only the block size to agree)."""
    info = engine.info
    return DevicePrefixCache(engine, block_size, budget_bytes,
                             cache_salt(info.name, info.path, engine.dtype, engine.cfg), enabled=enabled)


@partial(jax.jit, donate_argnums=(0, 1))
def _write_core(k_pool, v_pool, k, v, ids):
    return write_prompt_blocks(k_pool, v_pool, k, v, ids)


@partial(jax.jit, static_argnames=("cfg", "max_len", "mesh"), donate_argnums=(5, 6))
def _chunk_core(params, piece, start, length, table, k_pool, v_pool, tokens, true_length, output_from, index,
                temperature, top_k, top_p, seed, proc, masks=None, *, cfg, max_len, mesh=None):
    """One chunk of a prompt through the pool: `piece` [C] the tokens at positions start.., the
    first `length` real (the others write the null block); every row reads the prompt's block
    table (`mesh`: tp > 1, the pool split by KV head, each chip its heads: decode_forward_paged).
    Returns (k_pool, v_pool, packed first tokens from the chunk's last real row)."""
    rows = piece.shape[0]
    positions = start + jnp.arange(rows, dtype=jnp.int32)
    tables = jnp.broadcast_to(table[None], (rows, table.shape[0]))
    # every row is the chunk (a ragged call with no decode rows: cores.ragged_core's attention)
    logits, k_pool, v_pool = decode_forward_paged(params, piece, positions, k_pool, v_pool, tables, cfg,
                                                  max_len=max_len, active=jnp.arange(rows) < length,
                                                  logits_at=length - 1, mesh=mesh, chunk=rows)
    packed = _first_tokens(logits, tokens, true_length, output_from, index, temperature, top_k, top_p,
                           seed, proc, masks)
    return k_pool, v_pool, packed


@partial(jax.jit, static_argnames=("head_dim",))
def _gather_rows(k_pool, v_pool, table, *, head_dim: int):
    """The blocks of `table` [W] read out as rows: (k, v) [L, W * B, KV, hd], from the pool's
    layer buffers [KV, blocks, B / f, hd * f] (lane-folded: pool_layout.unfold)."""
    def rows(pool):
        return jnp.stack([rows_of_layer(p) for p in pool])

    def rows_of_layer(p):
        x = unfold(jnp.take(p, table, axis=1), head_dim)  # [KV, W, B, hd]
        kvh, w, bs, hd = x.shape
        return jnp.transpose(x, (1, 2, 0, 3)).reshape(w * bs, kvh, hd)

    return rows(k_pool), rows(v_pool)


__all__ = ["BlockHit", "DevicePrefixCache", "NULL_BLOCK", "device_cache_for"]
