"""Cache-aware routing: which prefill pod should get a prompt, the one likeliest to hold its prefix.

The prefill pods keep the KV of prompt prefixes they have prefilled (blocks of `block_size` tokens,
keyed by the hash chain of `tandem_core.prefix`). The gateway cannot see those caches, so it learns
from its own decisions, as SGLang's cache-aware router does: after routing a prompt to pod P, each
of the prompt's full blocks maps to P in a bounded LRU index. A prompt then goes to

1. the live pod owning the deepest of its blocks in the index (longest matching prefix), else
2. the live pod that rendezvous (highest-random-weight) hashing of its FIRST block's key picks, so
   every gateway replica sends the same cold prefix to the same pod with no shared state, and a
   pod joining or leaving moves only its own share of prefixes;

unless that pod's own admission stream already holds `max_backlog` entries: then the shared stream
(any pod takes it, nothing waits on a busy pod) and the index is left alone. With one live pod there
is nothing to choose, so the shared stream too. The index is only a hint: a wrong guess costs a
recomputed prefix, never a wrong token (the pods look each block up in their own cache).

Pure: no I/O, no clock. The caller passes the live (non-draining) prefill pods that take per-pod
entries (`prefix_route_pods` of the registry) and their per-pod backlog for the request's priority
(tandem_core/bus/admission.py reads it).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tandem_core.prefix import block_hashes

REASONS = ("prefix_hit", "rendezvous", "busy", "single_pod", "short", "off")


@dataclass(frozen=True)
class PrefixRoute:
    pod: str | None  # the worker id whose per-pod stream gets the prompt; None: the shared stream
    reason: str  # metric label, one of REASONS
    matched_blocks: int = 0  # index blocks the chosen (or busy) pod is believed to hold


def rendezvous(key: bytes, pods: Sequence[str]) -> str:
    """The pod with the highest hash(key, pod): stable for a key, uniform over pods, and removing a
    pod moves only the keys it won."""
    def weight(pod: str) -> bytes:
        return hashlib.blake2b(key + b"\x00" + pod.encode(), digest_size=8).digest()
    return max(pods, key=lambda p: (weight(p), p))


class PrefixRouter:
    """Longest-prefix match over a bounded LRU index block key -> worker id, rendezvous fallback.

    `choose` MUST only return a pod from `live_pods`, and MUST return None (shared stream) when that
    pod's backlog is at `max_backlog`. Every gateway replica MUST use the same `block_size` and
    `salt` (and the same block size as the pods' caches) for rendezvous to agree across replicas.
    """

    def __init__(self, block_size: int = 16, max_entries: int = 100_000, max_backlog: int = 4,
                 salt: bytes = b"", enabled: bool = True) -> None:
        if block_size < 1 or max_entries < 1 or max_backlog < 1:
            raise ValueError("block_size, max_entries and max_backlog must be >= 1")
        self.block_size = block_size
        self.max_entries = max_entries
        self.max_backlog = max_backlog
        self.salt = salt
        self.enabled = enabled
        self._index: OrderedDict[bytes, str] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._index)

    def choose(self, prompt_ids: Sequence[int], live_pods: Sequence[str],
               backlog_of: Mapping[str, int] | Callable[[str], int]) -> PrefixRoute:
        """Where to enqueue a prompt; records the choice in the index when a pod is chosen.
        `backlog_of`: entries in each pod's per-pod stream of the request's priority."""
        if not self.enabled:
            return PrefixRoute(None, "off")
        pods = sorted(set(live_pods))
        if len(pods) <= 1:
            return PrefixRoute(None, "single_pod")
        hashes = block_hashes(prompt_ids, self.block_size, self.salt)
        if not hashes:
            return PrefixRoute(None, "short")
        pod, matched = self.longest_match(hashes, set(pods))
        reason = "prefix_hit"
        if pod is None:
            pod, reason = rendezvous(hashes[0], pods), "rendezvous"
        backlog = backlog_of(pod) if callable(backlog_of) else backlog_of.get(pod, 0)
        if backlog >= self.max_backlog:
            return PrefixRoute(None, "busy", matched)
        self.record(hashes, pod)
        return PrefixRoute(pod, reason, matched)

    def longest_match(self, hashes: list[bytes], live: set[str]) -> tuple[str | None, int]:
        """The live pod owning the deepest indexed block, and how many blocks that covers. A block's
        key covers its whole prefix, so the pod that got block i has seen blocks 0..i too."""
        for i in range(len(hashes) - 1, -1, -1):
            owner = self._index.get(hashes[i])
            if owner is not None and owner in live:
                return owner, i + 1
        return None, 0

    def record(self, hashes: Sequence[bytes], pod: str) -> None:
        """Map each block key to `pod`, deepest first, so a prompt's shallow blocks (shared by more
        prompts) are the most recently used and the last evicted."""
        index = self._index
        for h in reversed(hashes):
            index[h] = pod
            index.move_to_end(h)
        while len(index) > self.max_entries:
            index.popitem(last=False)


def prefix_route_pods(prefill: list[dict], pool: str | None) -> tuple[str, ...]:
    """The prefill pods cache-aware routing may pick: those whose heartbeat `extra` says their prefix
    cache is on (`extra["prefix_cache"]["enabled"]`) and, when they publish one, that they serve
    `pool` (`extra["pool"]`). A pod MUST publish its cache only once it reads its per-pod streams,
    so an older pod in a rolling upgrade never gets entries it would not read. The registry is
    shared by every pool on one Redis and a pod never reads another pool's per-pod stream, so pods
    SHOULD publish `pool`: one that does not is taken to be in the gateway's pool."""
    out = []
    for w in prefill:
        extra = w.get("extra") or {}
        pc = extra.get("prefix_cache")
        if w.get("id") and isinstance(pc, dict) and pc.get("enabled") and extra.get("pool", pool) == pool:
            out.append(w["id"])
    return tuple(out)
