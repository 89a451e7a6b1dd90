"""A decode pod's prefix cache for the prompts it prefills itself (decode_svc/local_prefill.py):
the KV of prompt prefixes already prefilled, in blocks, on the host. (A prefill pod's is a pool of
blocks on the device, prefix_pool.py; this host cache goes once the decode pod's local prefills
use its own pool.)

Blocks of `block_size` tokens are keyed by the hash chain of tandem_core/prefix.py (a key covers
the whole prefix up to its block, salted with the model and dtype), so a lookup walks a prompt's
keys until the first miss and hands `Engine.prefill(cached=...)` the KV of the blocks found; the
engine then runs only the rest. A lookup always leaves at least one token to compute (the first
token's logits come from the last prompt position). Cached blocks are copies, shared by every
request that hits them and never mutated.

Memory: `bytes` never exceeds `budget_bytes`; inserting past it evicts least recently used blocks.
A hit touches its blocks from the last to the first, and an insert likewise, so a chain's leading
blocks are always more recent than its later ones and eviction trims chains from the end (a lost
middle block would strand every block after it).
Blocks live in host memory (numpy), apart from the held-KV budget of results waiting to be pulled;
on an accelerator a hit costs one host -> device copy of its rows (`hit_copy_bytes` counts the
bytes every hit copied out of the cache: bench/kv_capacity.py reads it).
Not thread-safe: the thread that owns the engine owns the cache. No I/O, no JAX here.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tandem_core.prefix import CacheStats, block_hashes, cache_salt

if TYPE_CHECKING:  # the type only: no JAX import
    from tandem_engine.api import ServingEngine


@dataclass
class Hit:
    """The KV of a prompt's first `length` tokens: k, v [num_layers, length, num_kv_heads, head_dim]."""

    k: np.ndarray
    v: np.ndarray
    length: int
    blocks: int


class PrefixCache:
    """`enabled=False`: lookups miss without counting and inserts keep nothing; only `computed`
    is counted (so a pod with the cache off still reports the prefill tokens it computed)."""

    def __init__(self, block_size: int, budget_bytes: int, salt: bytes = b"", enabled: bool = True) -> None:
        if block_size < 1 or budget_bytes < 0:
            raise ValueError(f"block_size ({block_size}) must be >= 1 and budget_bytes ({budget_bytes}) >= 0")
        self.enabled = bool(enabled) and budget_bytes > 0
        self.block_size = int(block_size)
        self.budget_bytes = int(budget_bytes)
        self.salt = salt
        self.bytes = 0
        self.stats = CacheStats()
        self._blocks: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, ids: Sequence[int]) -> Hit | None:
        """The cached KV of the longest cached run of `ids`' leading blocks (None on a miss),
        leaving at least the last token to compute. Counts the prompt in the stats."""
        if not self.enabled:
            return None
        self.stats.queries += len(ids)
        found = []
        for key in block_hashes(ids, self.block_size, self.salt, limit=(len(ids) - 1) // self.block_size):
            kv = self._blocks.get(key)
            if kv is None:
                break
            found.append((key, kv))
        if not found:
            return None
        self._touch([key for key, _ in found])
        length = len(found) * self.block_size
        self.stats.hits += length
        hit = Hit(k=np.concatenate([kv[0] for _, kv in found], axis=1),
                  v=np.concatenate([kv[1] for _, kv in found], axis=1), length=length, blocks=len(found))
        self.stats.hit_copy_bytes += hit.k.nbytes + hit.v.nbytes  # then host -> device in the prefill
        return hit

    def insert(self, ids: Sequence[int], kv: Callable[[], tuple[np.ndarray, np.ndarray]]) -> int:
        """Cache the full blocks of `ids` not cached yet; `kv()` returns the prompt's KV on the host
        ([num_layers, >= len(ids), ...]), called only when some block is new. Returns blocks added."""
        keys = block_hashes(ids, self.block_size, self.salt)
        new = [i for i, key in enumerate(keys) if key not in self._blocks]
        if not self.enabled:
            return 0
        if not new:
            self._touch([key for key in keys if key in self._blocks])
            return 0
        k, v = kv()
        bs, added = self.block_size, 0
        for i in new:
            kb = np.ascontiguousarray(k[:, i * bs:(i + 1) * bs])
            vb = np.ascontiguousarray(v[:, i * bs:(i + 1) * bs])
            size = kb.nbytes + vb.nbytes
            if size > self.budget_bytes:
                break
            self._blocks[keys[i]] = (kb, vb)
            self.bytes += size
            added += 1
        self._touch([key for key in keys if key in self._blocks])
        self._evict()
        self.stats.inserted += added
        return added

    def _touch(self, chain: list[bytes]) -> None:
        """Most recent: the chain's first block, then the second, ... (eviction trims from the end)."""
        for key in reversed(chain):
            self._blocks.move_to_end(key)

    def _evict(self) -> None:
        while self.bytes > self.budget_bytes and self._blocks:
            _key, (kb, vb) = self._blocks.popitem(last=False)
            self.bytes -= kb.nbytes + vb.nbytes
            self.stats.evicted += 1

    def summary(self) -> dict:
        """What a pod reports in its heartbeat (`extra["prefix_cache"]`)."""
        s = self.stats
        return {"enabled": self.enabled, "block_size": self.block_size, "queries": s.queries, "hits": s.hits,
                "computed": s.computed, "bytes": self.bytes, "budget_bytes": self.budget_bytes,
                "blocks": len(self._blocks), "evicted": s.evicted,
                "hit_copy_bytes": s.hit_copy_bytes}


def prefill(engine: ServingEngine, cache: PrefixCache, prompt_ids: Sequence[int], sampling, *, export: bool = False, **kw):
    """`engine.prefill` over the longest cached prefix of the prompt, then its new full blocks
    cached. Returns (Prefix, KVPayload when `export` else None). The KV is copied to the host for
    the cache only when a block is new (the prefill pod exports it anyway)."""
    hit = cache.lookup(prompt_ids)
    prefix = engine.prefill(prompt_ids, sampling, cached=hit, **kw)
    payload = engine.export_prefix(prefix) if export else None
    cache.stats.computed += len(prompt_ids) - (hit.length if hit else 0)

    def host_kv():
        return (payload.k, payload.v) if payload is not None else (np.asarray(prefix.k), np.asarray(prefix.v))

    cache.insert(prompt_ids, host_kv)
    return prefix, payload


def cache_for(engine: ServingEngine, block_size: int, budget_bytes: int, enabled: bool = True) -> PrefixCache:
    """A cache whose keys are salted with this engine's model and dtype."""
    info = engine.info
    return PrefixCache(block_size, budget_bytes, cache_salt(info.name, info.path, engine.dtype, engine.cfg),
                       enabled=enabled)
