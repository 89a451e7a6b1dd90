"""Speculative decoding on a decode pod: which rows propose, what, and when a row stops trying
(issue 45; the verify call is the engine's, tandem_engine/speculative.py).

The proposer is n-gram prompt lookup (vLLM's `ngram` method): a row's last n tokens, n from
`max_n` down to `min_n`, matched against its prompt and output so far; the k tokens that followed
the latest earlier match are its proposal. It costs no model and nothing on the device; a row with
no match proposes nothing and takes an ordinary step inside the verify call.

Adaptive k: a proposal of which nothing is kept is a miss. After `miss_limit` misses in a row the
row sits out 2, 4, 8 .. up to `max_backoff` dispatches, and a kept token resets it; a row whose
output does not repeat its context soon stops paying for proposals, and while no row is proposing
the loop runs its ordinary pipelined multi-step calls. A proposal is also cut to what the row may
still emit (max_tokens, the context), so a proposal never asks for blocks the row cannot use.

Counters as vLLM names them (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens):
`drafts` proposals checked, `draft_tokens` tokens in them, `accepted` tokens kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from decode_svc.settings import SpeculativeConfig
from tandem_engine.speculative import ngram_propose


@dataclass
class SpecRow:
    """One running request's proposer state: its tokens so far (prompt, then every emitted one)."""

    seq: list[int]
    misses: int = 0  # proposals in a row of which nothing was kept
    pause: int = 0  # dispatches left to sit out
    backoff: int = 1  # the next pause's length


@dataclass
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    calls: int = 0  # verify calls dispatched
    paused_rows: int = 0  # times a row started a pause

    def summary(self) -> dict:
        rate = self.accepted / self.draft_tokens if self.draft_tokens else 0.0
        mean = 1 + self.accepted / self.drafts if self.drafts else 0.0  # tokens a checked row emitted a call
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted,
                "calls": self.calls, "paused_rows": self.paused_rows, "acceptance_rate": round(rate, 4),
                "mean_accepted_length": round(mean, 3)}


@dataclass
class Speculator:
    config: SpeculativeConfig
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def k(self) -> int:
        return self.config.k

    def start(self, prompt_ids: Sequence[int], first_token: int) -> SpecRow | None:
        """A row's state when its request goes into a slot (None while speculation is off)."""
        return SpecRow(list(prompt_ids) + [int(first_token)]) if self.config.on else None

    def proposing(self, rows: Sequence[SpecRow | None]) -> bool:
        """Whether some row may propose at the next dispatch (else the loop pipelines as usual)."""
        return any(r is not None and r.pause == 0 for r in rows)

    def tick(self, rows: Sequence[SpecRow | None]) -> None:
        """One dispatch went by (a verify call or an ordinary one): pauses count down."""
        for r in rows:
            if r is not None and r.pause:
                r.pause -= 1

    def propose(self, row: SpecRow | None, room: int) -> list[int]:
        """The row's proposal for this dispatch ([] when it sits out, has no match or no room)."""
        if row is None or row.pause:
            return []
        k = min(self.config.k, room)
        if k < 1:
            return []
        return ngram_propose(row.seq, k, self.config.max_n, self.config.min_n)

    def observe(self, row: SpecRow | None, proposed: int, emitted: Sequence[int], kept: int) -> None:
        """After a call: the row's emitted tokens join its context; a checked proposal of which
        `kept` tokens were kept counts, and a miss streak starts a pause."""
        if row is None:
            return
        row.seq.extend(emitted)
        if not proposed:
            return
        self.stats.drafts += 1
        self.stats.draft_tokens += proposed
        self.stats.accepted += kept
        if kept:
            row.misses, row.backoff = 0, 1
            return
        row.misses += 1
        if row.misses >= self.config.miss_limit:
            row.backoff = min(row.backoff * 2, self.config.max_backoff)
            row.pause, row.misses = row.backoff, 0
            self.stats.paused_rows += 1
