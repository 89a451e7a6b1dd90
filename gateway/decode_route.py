"""Cache-aware routing to decode pods: which decode pod should decode a prompt, the one likeliest to
hold its leading KV blocks.

A paged decode pod with block reuse keeps the KV blocks of the requests it finished (the prompt and
the tokens it generated: tandem_engine/block_cache.py) and pulls from the prefill pod only the
positions after those it holds (decode_svc/claims.py). A conversation's next turn repeats the last
turn's prompt and answer, so it moves least KV on the pod that decoded the last turn. The gateway
cannot see the pods' caches; it learns from its own decisions, as prefix_route.py does for prefill
pods: after steering a prompt to decode pod D, each of the prompt's full blocks maps to D in a
bounded LRU index. A prompt then goes to

1. the steerable pod owning the deepest of its blocks in the index, if that pod has room for it
   (free rows, and blocks for the prompt, as of its last heartbeat (`DecodeRoom.takes`), less the
   prompts steered to it since that read), else
2. the steerable pod with the most room for it (ties: the lowest id), if any has room;

and its blocks then map to that pod. No room anywhere, or fewer than two steerable pods: not
steered (the shared ready stream: any decode pod). There is no rendezvous for cold prompts, unlike
the prefill router: a shared system prompt would send every new conversation to one decode pod.

The choice reaches the prefill pod as `GenerationRequest.decode_pod`; it writes the ready notice
to that pod's per-pod ready stream (tandem_core/bus/ready.py). The steered pod reads it first; if
it leaves it unread for `affinity_wait_ms` (busy, paused, dead) any pod with room takes it
(tandem_core/bus/steal.py). So the index is only a hint: a wrong guess costs a whole pull and a
wait of at most `affinity_wait_ms`, never a wrong or lost token.

"Steerable": the heartbeat says the pod reads its per-pod ready stream (`extra.ready_affinity`,
decode pods with paged KV and block reuse); pods that do not (slot layout, an older version) are
never steered to, so nothing waits in a stream its pod does not read.

Pure: no I/O, no clock.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.cluster_view import DecodeRoom
from gateway.prefix_route import PrefixRouter
from tandem_core.prefix import block_hashes

REASONS = ("prefix_hit", "roomiest", "busy", "single_pod", "short", "off")


@dataclass(frozen=True)
class DecodeRoute:
    pod: str | None  # the decode pod's worker id; None: not steered (the shared ready stream)
    reason: str  # metric label, one of REASONS
    matched_blocks: int = 0  # index blocks the chosen pod is believed to hold


class DecodeRouter:
    """Longest-prefix match over a bounded LRU index (block key -> decode pod), else the roomiest
    steerable pod. `choose` MUST only return a steerable pod with room for the prompt."""

    def __init__(self, block_size: int = 16, max_entries: int = 100_000, salt: bytes = b"",
                 enabled: bool = True) -> None:
        # the prefill router's index and matching, without its backlog rule or rendezvous
        self.index = PrefixRouter(block_size, max_entries, salt=salt)
        self.enabled = enabled
        # prompts steered to each pod since the rooms were read (their heartbeats do not show them
        # yet): a burst of new conversations spreads instead of all going to the pod first roomiest
        self._rooms: Sequence[DecodeRoom] | None = None
        self._sent: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.index)

    def choose(self, prompt_ids: Sequence[int], rooms: Sequence[DecodeRoom]) -> DecodeRoute:
        """Which decode pod to steer the prompt to; records the choice in the index."""
        if not self.enabled:
            return DecodeRoute(None, "off")
        steerable = {r.worker_id: r for r in rooms if r.affinity and r.worker_id}
        if len(steerable) <= 1:
            return DecodeRoute(None, "single_pod")
        hashes = block_hashes(prompt_ids, self.index.block_size, self.index.salt)
        if not hashes:
            return DecodeRoute(None, "short")
        if rooms is not self._rooms:  # a new read of the registry: its rooms count what was sent
            self._rooms, self._sent = rooms, {}
        n = len(prompt_ids)
        room = {pod: r.takes(n) - self._sent.get(pod, 0) for pod, r in steerable.items()}
        pod, matched = self.index.longest_match(hashes, set(steerable))
        reason = "prefix_hit"
        if pod is None or room[pod] <= 0:
            best = max(sorted(room), key=lambda p: room[p])
            if room[best] <= 0:
                return DecodeRoute(None, "busy", matched)
            pod, reason = best, "roomiest"
        self.index.record(hashes, pod)
        self._sent[pod] = self._sent.get(pod, 0) + 1
        return DecodeRoute(pod, reason, matched)
