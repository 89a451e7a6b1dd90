"""The decode side's prefix cache on the device: the full KV blocks of finished sequences kept in
the paged pool, shared by every later sequence that starts with the same tokens (issue 30's
decode-side reuse: a pod that holds a conversation's earlier turns pulls only the new rows).

Blocks are keyed by the hash chain of tandem_core/prefix.py (a key covers every token up to the
end of its block), so a sequence finds the longest run of its leading full blocks kept here.
What the cache holds is a reference to a pool block (paged.BlockAllocator's refcount), not a
copy: a hit shares the blocks into the new row's block table and copies nothing. Only full
blocks whose every position was written from the tokens named are kept; a row never writes a
position below its own length, so a shared block is never written again (no copy on write is
needed: a match ends on a block boundary and the row's own blocks start there).

Memory: cached blocks are pool blocks nobody else holds; they count as free (`evictable`) and go
back to the free list, least recently used first, when an allocation finds too few free
(`make_room`). A hit touches its blocks from the last to the first, so a chain's leading blocks
are always more recent than its later ones and eviction trims chains from the end.

A match pins its blocks (one reference each) until the caller inserts with it (the references
pass to the row) or releases it: what a decode pod holds while it pulls the rest of the KV.
Host state only, no JAX. Not thread-safe by itself: the engine calls it under its block lock.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from tandem_core.prefix import block_hashes
from tandem_engine.paged import NULL_BLOCK, BlockAllocator


class CachingAllocator(BlockAllocator):
    """A `BlockAllocator` that knows which blocks the cache holds (`cached`), and counts those
    only the cache holds (`cached_only`: blocks an allocation can have by evicting them)."""

    def __init__(self, total: int):
        super().__init__(total)
        self.cached = np.zeros(self.total + 1, bool)
        self.cached_only = 0

    def share(self, ids) -> None:
        super().share(ids)
        for b in ids:
            if self.cached[b] and self.refcount[b] == 2:
                self.cached_only -= 1

    def release(self, ids) -> None:
        for b in ids:
            if b != NULL_BLOCK and self.cached[b] and self.refcount[b] == 2:
                self.cached_only += 1
        super().release(ids)

    def mark_cached(self, block: int, cached: bool) -> None:
        """The cache took (True, holding a reference already) or dropped (False, before it
        releases its reference) `block`."""
        if bool(self.cached[block]) == cached:
            raise ValueError(f"block {block} is {'already' if cached else 'not'} cached")
        self.cached[block] = cached
        if self.refcount[block] == 1:
            self.cached_only += 1 if cached else -1


@dataclass
class PrefixMatch:
    """The leading `length` positions of a sequence found in the cache: `blocks`, pinned (one
    reference each) for the caller until `DecodeSide.insert_payload(..., cached=match)` hands
    them to a row or `release_prefix(match)` lets them go."""

    length: int
    blocks: list[int]
    done: bool = field(default=False, repr=False)  # inserted or released: the pins are gone
    key: bytes = field(default=b"", repr=False)  # the chain key of its last block
    # windowed layers beside global ones (paged.WindowGroup): the windowed blocks of the window
    # before `length`, pinned too, from logical block `window_from` on
    window_from: int = 0
    window_blocks: list[int] = field(default_factory=list)


@dataclass
class ReuseStats:
    """Cumulative (tokens, like the prefill pods' prefix-cache counters)."""

    queries: int = 0  # tokens of the sequences looked up
    hits: int = 0  # tokens found (their KV not pulled)
    kept: int = 0  # blocks added when rows finished
    evicted: int = 0  # blocks given back to the pool for room


class BlockCache:
    def __init__(self, alloc: CachingAllocator, block_size: int, salt: bytes = b"decode") -> None:
        self.alloc = alloc
        self.block_size = int(block_size)
        self.salt = salt
        self.stats = ReuseStats()
        self._keys: OrderedDict[bytes, int] = OrderedDict()  # key -> block, least recent first

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, ids: Sequence[int], limit_positions: int | None = None,
              usable: Callable[[bytes], bool] | None = None) -> PrefixMatch | None:
        """The longest run of `ids`' leading full blocks held here, pinned, leaving at least the
        last token of `ids` out (None when not even the first block is held). `limit_positions`:
        match no further than that many positions. `usable`: a run may end only at a block whose
        key it accepts (the windowed group's kept tails)."""
        n = len(ids)
        self.stats.queries += n
        limit = (n - 1) // self.block_size
        if limit_positions is not None:
            limit = min(limit, int(limit_positions) // self.block_size)
        found: list[tuple[bytes, int]] = []
        for key in block_hashes(ids, self.block_size, self.salt, limit=limit):
            block = self._keys.get(key)
            if block is None:
                break
            found.append((key, block))
        if usable is not None:
            while found and not usable(found[-1][0]):
                found.pop()
        if not found:
            return None
        self._touch([k for k, _ in found])
        blocks = [b for _, b in found]
        self.alloc.share(blocks)
        self.stats.hits += len(blocks) * self.block_size
        return PrefixMatch(len(blocks) * self.block_size, blocks, key=found[-1][0])

    def block_of(self, key: bytes) -> int | None:
        """The block holding the KV of the prefix `key` ends, or None (neither pins nor touches)."""
        return self._keys.get(key)

    def release(self, match: PrefixMatch) -> None:
        """Unpin a match not inserted (its pull failed, it was cancelled); twice is a no-op."""
        if not match.done:
            match.done = True
            self.alloc.release(match.blocks)

    def keep(self, ids: Sequence[int], blocks: Sequence[int]) -> int:
        """A finished row's KV: `ids` the tokens whose KV its positions [0, len(ids)) hold,
        `blocks` its block table. Its full blocks not held yet are kept (one more reference
        each); those held already are touched. Returns blocks added."""
        n = min(len(ids) // self.block_size, len(blocks))
        keys = block_hashes(ids, self.block_size, self.salt, limit=n)
        added = 0
        for key, block in zip(keys, blocks):
            if key in self._keys:
                continue
            if self.alloc.cached[block]:  # held under another key: not this sequence's KV
                break
            self.alloc.share([block])
            self.alloc.mark_cached(block, True)
            self._keys[key] = int(block)
            added += 1
        self._touch([k for k in keys if k in self._keys])
        self.stats.kept += added
        return added

    def make_room(self, need: int) -> int:
        """Give cached blocks that no row holds back to the free list, least recently used
        first, until `need` blocks are free (or none is left to give). Returns blocks freed."""
        freed = 0
        if self.alloc.free_count() >= need:
            return 0
        for key in list(self._keys):
            block = self._keys[key]
            if self.alloc.refcount[block] != 1:  # a row shares it: dropping it frees nothing
                continue
            del self._keys[key]
            self.alloc.mark_cached(block, False)
            self.alloc.release([block])
            freed += 1
            if self.alloc.free_count() >= need:
                break
        self.stats.evicted += freed
        return freed

    def _touch(self, chain: list[bytes]) -> None:
        for key in reversed(chain):
            self._keys.move_to_end(key)

    def summary(self) -> dict:
        s = self.stats
        return {"blocks": len(self._keys), "evictable": self.alloc.cached_only, "queries": s.queries,
                "hits": s.hits, "kept": s.kept, "evicted": s.evicted, "block_size": self.block_size}
