"""Speculative decoding on a decode pod: which rows propose, how much, and when the pod stops
trying (issue 45; the verify call is the engine's, tandem_engine/speculative.py).

Two proposers. N-gram prompt lookup (vLLM's `ngram` method): a row's last n tokens, n from
`max_n` down to `min_n`, matched against its prompt and output so far; the tokens that followed
the latest earlier match are its proposal. It costs no model and nothing on the device; a row with
no match proposes nothing and takes an ordinary step inside the verify call. A draft model
(`draft`: tandem_engine/draft.py, a smaller checkpoint with the target's tokenizer on this pod):
its k tokens after every speculating row's context, two calls on the draft for all rows; greedy,
or for a sampled request (`draft_sample`) drawn at the request's temperature, top-k and top-p,
their distributions handed to the verify call (`Speculator.draft_q`). Under a grammar a drawn
proposal is kept up to its first rejected token, which the call rejects surely (a cut that
depends on the draw would bias the output: tandem_core/grammar.py Matcher.proposal_masks).

Adaptive k, per row: `rate` is an estimate of the chance the row's next proposed token is kept
(each token the target judged moves it: kept 1, rejected 0). A row proposes the tokens whose
chance of being reached and kept is at least `min_gain` (rate^j >= min_gain: rate 0.8 -> 5, capped
at k; 0.6 -> 2; 0.4 -> 1). Below `min_gain` it pauses 2, 4, 8 .. `max_backoff` dispatches, then
tries one token again. A row whose last tokens recur nowhere sits out `no_match_pause` dispatches
(a dispatch that may be a verify call waits for the call before it: while no row can propose, the
loop pipelines).

The pod's gate: on a CPU a verify call over q queries costs more than a step of one (the built-in
model's step at one row is a matrix-vector product; five queries take 2-2.5x its time, and a
verify call forgoes multi-step dispatch and pipelining), so accepted tokens may not pay for it.
The gate measures both: tokens emitted per second over `window` dispatches with speculation, then
`window` without; the better one runs for `hold` dispatches (the plain one for twice as long each
time it wins again, up to `max_hold`), then both are measured again. Each load (the running rows'
power of two) has a gate of its own: a decision taken at 32 streams is not carried to one stream
(it was: one stream then ran up to `hold` speculating dispatches that 32 streams had chosen). So speculation runs where it
pays on this machine, workload and batch, and costs at most a trial window where it does not.

Counters as vLLM names them (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens):
`drafts` proposals checked, `draft_tokens` tokens in them, `accepted` tokens kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Sequence

from decode_svc.settings import SpeculativeConfig
from tandem_core.types import SamplingParams
from tandem_engine.speculative import NgramIndex

if TYPE_CHECKING:  # the type only: no JAX import
    from tandem_engine.draft import DraftProposer

START_RATE = 0.6  # a new row's estimate: two tokens proposed at first


@dataclass
class SpecRow:
    """One running request's proposer state: its tokens so far (prompt, then every emitted one),
    indexed by n-gram for the n-gram proposer (tandem_engine.speculative.NgramIndex: a proposal is
    a few lookups), a plain list for a draft model's."""

    index: NgramIndex | None
    tokens: list[int] = field(default_factory=list)  # (without an index)
    serial: int = 0  # which request: a draft row re-seats when its slot's serial changes
    sampling: SamplingParams | None = None  # how its draft row samples its proposals (None: greedily)
    rate: float = START_RATE  # the chance its next proposed token is kept (estimate)
    pause: int = 0  # dispatches left to sit out
    backoff: int = 1  # the next pause's length

    @property
    def seq(self) -> list[int]:
        return self.tokens if self.index is None else self.index.seq

    def extend(self, tokens: Sequence[int]) -> None:
        if self.index is None:
            self.tokens.extend(int(t) for t in tokens)
        else:
            self.index.extend(tokens)


@dataclass
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    calls: int = 0  # verify calls dispatched
    paused_rows: int = 0  # times a row started a pause
    gate_spec: int = 0  # gate decisions for speculation ...
    gate_plain: int = 0  # ... and against it
    gate_rates: dict = field(default_factory=dict)  # per load bucket, its last trial's tokens/s with and without
    accepted_per_pos: list = field(default_factory=list)  # [i]: proposals whose token i (0-based) was kept

    def summary(self) -> dict:
        rate = self.accepted / self.draft_tokens if self.draft_tokens else 0.0
        mean = 1 + self.accepted / self.drafts if self.drafts else 0.0  # tokens a checked row emitted a call
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted,
                "calls": self.calls, "paused_rows": self.paused_rows, "acceptance_rate": round(rate, 4),
                "mean_accepted_length": round(mean, 3),
                "accepted_per_pos": {str(i): n for i, n in enumerate(self.accepted_per_pos)},
                "gate": {"spec": self.gate_spec, "plain": self.gate_plain, "rates": self.gate_rates}}


def load_bucket(rows: int) -> int:
    """The load a gate decision belongs to: the running rows' power of two (1, 2, 4, .. 32)."""
    return 1 << max(int(rows), 1).bit_length() - 1


class Gate:
    """Speculation on or off at one load, by measured tokens per second (module docstring)."""

    def __init__(self, window: int, hold: int, max_hold: int, stats: SpecStats, load: int = 0) -> None:
        self.window, self.hold, self.max_hold, self.stats = window, hold, max_hold, stats
        self.load = load  # the load_bucket whose decisions these are (0: every load)
        self.phase = "try_spec"
        self.left = window
        self.plain_hold = hold
        self._tokens = self._seconds = 0.0
        self.rates: dict[str, float] = {}

    @property
    def speculate(self) -> bool:
        return self.phase in ("try_spec", "spec")

    def account(self, tokens: int, seconds: float) -> None:
        """One dispatch with rows running: the tokens it emitted and the time it took."""
        self._tokens += tokens
        self._seconds += seconds
        self.left -= 1
        if self.left > 0:
            return
        rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
        self._tokens = self._seconds = 0.0
        if self.phase == "try_spec":
            self.rates["spec"] = rate
            self.phase, self.left = "try_plain", self.window
        elif self.phase == "try_plain":
            self.rates["plain"] = rate
            self.stats.gate_rates[str(self.load)] = {m: round(r, 1) for m, r in self.rates.items()}
            if self.rates["spec"] >= rate:
                self.phase, self.left, self.plain_hold = "spec", self.hold, self.hold
                self.stats.gate_spec += 1
            else:
                self.phase, self.left = "plain", self.plain_hold
                self.plain_hold = min(2 * self.plain_hold, self.max_hold)
                self.stats.gate_plain += 1
        else:  # a hold ran out: measure both again
            self.phase, self.left = "try_spec", self.window


@dataclass
class Speculator:
    config: SpeculativeConfig
    draft: DraftProposer | None = None  # method "draft": the draft model's proposer (on the engine thread)
    stats: SpecStats = field(default_factory=SpecStats)
    gates: dict[int, Gate] = field(init=False, default_factory=dict)  # load_bucket -> its own decisions

    def __post_init__(self) -> None:
        self._serials = count(1)
        if self.config.method == "draft" and self.draft is None:
            raise ValueError("speculative method 'draft' needs the draft model's proposer")

    @property
    def k(self) -> int:
        return self.config.k

    def gate(self, rows: int) -> Gate:
        """The gate of this load (`load_bucket` of the running rows): a decision taken at 32
        streams is not the one at one stream, and a change of load does not restart a trial."""
        load = load_bucket(rows)
        gate = self.gates.get(load)
        if gate is None:
            c = self.config
            gate = self.gates[load] = Gate(c.gate_window, c.gate_hold, c.gate_max_hold, self.stats, load)
        return gate

    def summary(self) -> dict:
        """The counters (SpecStats.summary) with the method, and the draft model's own: its
        name, the calls that asked it, the rows it seated by a prefill, its forced calls (more
        than one a call while rows catch up) and the rows it left behind (draft.py)."""
        out = {"method": self.config.method, **self.stats.summary()}
        if self.draft is not None:
            d = self.draft
            out["draft"] = {"model": d.engine.info.name, "calls": d.calls, "seats": d.seats, "rounds": d.rounds,
                            "lagging": d.lagging}
        return out

    def start(self, prompt_ids: Sequence[int], first_token: int, wanted: bool = True,
              sampling: SamplingParams | None = None) -> SpecRow | None:
        """A row's state when its request goes into a slot (None while speculation is off, or
        the request opted out: `wanted` False). `sampling`: the request's (a draft that samples
        does so for a sampled request)."""
        if not (self.config.on and wanted):
            return None
        seq = list(prompt_ids) + [int(first_token)]
        if self.draft is not None:
            return SpecRow(None, seq, next(self._serials), self._draft_sampling(sampling))
        return SpecRow(NgramIndex(seq, self.config.max_n, self.config.min_n), serial=next(self._serials))

    def _draft_sampling(self, sampling: SamplingParams | None) -> SamplingParams | None:
        """The draft row's sampling for a request: its temperature, top-k and top-p, and a seed of
        its own (derived from a seeded request's: the draws stay independent of the target's),
        when the draft samples and the request does; else None (greedy)."""
        if not (self.draft is not None and self.draft.sample and sampling is not None
                and sampling.temperature > 0):
            return None
        seed = None if sampling.seed is None else (int(sampling.seed) * 0x9E3779B97F4A7C15 + 0x5EED) % (1 << 64)
        return SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=seed)

    @property
    def draft_q(self):
        """The distributions of the draft's last proposals (DraftProposer.last_q: [slots, k,
        vocab] on the device), for the verify call; None for n-gram lookup or a greedy draft."""
        return None if self.draft is None else self.draft.last_q

    def proposing(self, rows: Sequence[SpecRow | None]) -> bool:
        """Whether the next dispatch may be a verify call: the gate says so and some row may
        propose (else the loop runs its ordinary pipelined calls)."""
        return self.gate(len(rows)).speculate and any(r is not None and r.pause == 0 for r in rows)

    def tick(self, rows: Sequence[SpecRow | None]) -> None:
        """One dispatch went by (a verify call or an ordinary one): pauses count down."""
        for r in rows:
            if r is not None and r.pause:
                r.pause -= 1

    def propose_all(self, rows: Sequence[tuple[int, SpecRow | None, int]]) -> dict[int, list[int]]:
        """(slot, row, room) for every running row -> slot -> its proposal for this dispatch (none
        where it sits out, has no match or no room). A draft model is asked for every speculating
        row, those sitting out too (its rows stay in step with the target's: draft.py)."""
        if self.draft is None:
            out = {slot: self.propose(row, room) for slot, row, room in rows}
            return {slot: ids for slot, ids in out.items() if ids}
        want = {slot: min(self.config.k, room, self.length(row.rate)) for slot, row, room in rows
                if row is not None and not row.pause}
        if not any(n >= 1 for n in want.values()):
            return {}
        drafted = self.draft.propose({slot: (row.serial, row.seq, row.sampling) for slot, row, _room in rows
                                      if row is not None})
        return {slot: drafted[slot][:n] for slot, n in want.items() if n >= 1 and drafted.get(slot)}

    def propose(self, row: SpecRow | None, room: int) -> list[int]:
        """The row's n-gram proposal for this dispatch ([] when it sits out, has no match or no room)."""
        if row is None or row.pause or row.index is None:
            return []
        k = min(self.config.k, room, self.length(row.rate))
        if k < 1:
            return []
        ids = row.index.propose(k)
        if not ids:  # nothing recurs: look again a few dispatches on (meanwhile the loop can pipeline)
            row.pause = self.config.no_match_pause
        return ids

    def length(self, rate: float) -> int:
        """Tokens worth proposing at this rate: those reached and kept with chance >= min_gain."""
        if rate <= self.config.min_gain:
            return 0
        if rate >= 1.0:
            return self.config.k
        return max(1, min(self.config.k, int(math.log(self.config.min_gain) / math.log(rate))))

    def observe(self, row: SpecRow | None, proposed: int, emitted: Sequence[int], kept: int) -> None:
        """After a call: the row's emitted tokens join its context; each proposed token the target
        judged (the kept ones and the first rejected) moves its rate, and a rate below min_gain
        starts a pause."""
        if row is None:
            return
        row.extend(emitted)
        if not proposed:
            return
        self.stats.drafts += 1
        self.stats.draft_tokens += proposed
        self.stats.accepted += kept
        per_pos = self.stats.accepted_per_pos
        per_pos.extend([0] * (kept - len(per_pos)))
        for i in range(kept):
            per_pos[i] += 1
        judged = min(kept + 1, proposed)
        for j in range(judged):
            row.rate += self.config.rate_step * ((1.0 if j < kept else 0.0) - row.rate)
        if kept:
            row.backoff = 1
        if row.rate <= self.config.min_gain:
            row.pause = row.backoff
            row.backoff = min(row.backoff * 2, self.config.max_backoff)
            row.rate = (self.config.min_gain + START_RATE) / 2  # after the pause: a token or two again
            self.stats.paused_rows += 1
