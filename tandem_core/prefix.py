"""Prefix identity: a hash chain over a prompt's token blocks, shared by the pods' prefix caches
and the gateway's cache-aware routing.

Block i of a prompt is tokens [i * block_size, (i + 1) * block_size). Its key covers the whole
prefix up to and including it: key_i = blake2b(key_{i-1} || tokens of block i), seeded with a
salt (the model and dtype on the pods, so a cache never hands KV across models). Only full blocks
get keys; a prompt's trailing partial block is always computed. Equal keys mean equal prefixes
(up to a 128-bit collision), so a lookup is a walk down the chain until the first miss.
No I/O, no JAX here.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

DIGEST_BYTES = 16


@dataclass
class CacheStats:
    """A pod's prefix-cache counters, cumulative since the cache was made (prompt tokens, like
    vLLM's prefix-cache counters): what its heartbeat reports (`extra["prefix_cache"]`)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached
    computed: int = 0  # prompt tokens prefilled (recorded by the caller)
    inserted: int = 0  # blocks added
    evicted: int = 0  # blocks dropped for room
    hit_copy_bytes: int = 0  # KV bytes the hits copied out of the cache into a prompt's buffer


def cache_salt(*parts: object) -> bytes:
    """The chain's seed from what must match for KV to be reusable (model name, dtype, ...)."""
    return hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=DIGEST_BYTES).digest()


def block_hashes(ids: Sequence[int], block_size: int, salt: bytes = b"", limit: int | None = None) -> list[bytes]:
    """The keys of the full blocks of `ids`, in order (at most `limit` of them)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(ids) // block_size
    if limit is not None:
        n = min(n, max(0, limit))
    arr = np.asarray(ids[: n * block_size], dtype=np.int32)
    out: list[bytes] = []
    prev = salt
    for i in range(n):
        prev = hashlib.blake2b(prev + arr[i * block_size:(i + 1) * block_size].tobytes(),
                               digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return out
