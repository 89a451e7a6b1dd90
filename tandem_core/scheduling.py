"""Scheduling decisions as pure functions, shared by the gateway and the workers and unit-tested
apart from any I/O: priority order with anti-starvation, where to prefill a prompt, and the
predicted time to first token that admission control compares with a request's deadline."""
from __future__ import annotations

from dataclasses import dataclass

from tandem_core import keys
from tandem_core.keys import KeySpace


class PriorityRotation:
    """Order in which a worker reads the admission streams.

    High priority goes first, so it is never starved by low. But every `high_weight + 1`-th read
    puts the lower class first, so low priority always gets at least 1/(high_weight + 1) of the
    reads that find it waiting: slowed under a flood of high, never starved forever. Within a
    priority, the shards (KeySpace.all_shards) are read starting one further along each time, so no
    shard waits behind the others.
    """

    def __init__(self, ks: KeySpace, pool: str, high_weight: int = 4) -> None:
        self.ks, self.pool = ks, pool
        self.high_weight = max(1, high_weight)
        self._n = 0

    def next_priorities(self) -> list[str]:
        self._n += 1
        if self._n % (self.high_weight + 1) == 0:
            return list(reversed(keys.PRIORITIES))
        return list(keys.PRIORITIES)

    def shard_order(self) -> list[int]:
        """Every shard, starting from the one this pass begins with (call after next_priorities)."""
        n = self.ks.shards
        return [(self._n + i) % n for i in range(n)]

    def next_order(self) -> list[str]:
        """The shared admission streams to read this pass, in order."""
        prios = self.next_priorities()
        shards = self.shard_order()
        return [self.ks.admission_stream(self.pool, p, s) for p in prios for s in shards]


@dataclass(frozen=True)
class Route:
    direct: bool  # True: a decode pod prefills it locally
    reason: str  # metric label: short_prompt | prefill_backlog | no_prefill_workers | remote


def choose_route(prompt_tokens: int, *, direct_max_tokens: int, backlog: int, prefill_workers: int,
                 decode_free_slots: int, backlog_threshold: int) -> Route:
    """Conditional disaggregation: send a prompt to local prefill on a decode pod when it is short
    (its prefill costs a decode step or two), when there is no prefill pool, or when the remote
    prefill backlog is deep enough that waiting for it would be slower than a local prefill on a
    decode pod that has free slots right now."""
    if prefill_workers == 0:
        return Route(True, "no_prefill_workers")
    if prompt_tokens <= direct_max_tokens:
        return Route(True, "short_prompt")
    if backlog >= backlog_threshold and decode_free_slots > 0:
        return Route(True, "prefill_backlog")
    return Route(False, "remote")


def predicted_ttft_s(backlog: int, prefill_workers: int, prefill_s_per_request: float,
                     queue_drain_factor: float = 1.0) -> float:
    """Time to first token for a request joining the admission queue now: the backlog ahead of it
    spread over the prefill workers, plus its own prefill."""
    workers = max(1, prefill_workers)
    return (backlog / workers + 1.0) * prefill_s_per_request * queue_drain_factor
