"""Grammar masks for the decode engine thread (structured outputs, tandem_core/grammar.py).

Each constrained slot keeps a Matcher, rebuilt at insert from the output so far (prompt_ids
[output_from:], then token `start_index`), so a request resumed on another pod carries on where its
stream left off. Before a masked step the thread feeds the pending step's tokens to the matchers
(the loop runs unpipelined meanwhile) and `masks` computes the next step's masks. A complete grammar
finishes its request with EOS ("stop") without another step; a matcher error finishes that request
with "error", never the loop. Matchers live with their slot: `forget` drops one when it is freed.
Each mask is told the request's budget (max_tokens - the next index), so the matcher forces the
shortest closing once the budget would no longer let the output close (tandem_core/grammar.py);
a request closed that way ends with EOS and finish "length".
"""
from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import NamedTuple

import numpy as np

from decode_svc.items import Emitted
from decode_svc.requests import Active
from tandem_core.grammar import GrammarError, Grammars, Matcher
from tandem_core.types import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, GenerationRequest, TokenLogprobs

log = logging.getLogger(__name__)


class SlotGrammars:
    def __init__(self, info, cache_size: int, mask_deadline_s: float) -> None:
        self.grammars = Grammars(info, cache_size=cache_size, deadline_s=mask_deadline_s)
        self._words = (info.vocab_size + 31) // 32
        self._matchers: dict[int, Matcher] = {}  # slot -> its request's matcher, while it lives

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def matcher_for(self, req: GenerationRequest, first_token: int) -> Matcher | None:
        """The request's matcher past its output so far (None: unconstrained); raises TandemError."""
        if req.grammar is None:
            return None
        return self.grammars.matcher(req.grammar, [*req.prompt_ids[req.output_from:], first_token])

    def attach(self, slot: int, matcher: Matcher | None) -> None:
        if matcher is not None:
            self._matchers[slot] = matcher

    def get(self, slot: int) -> Matcher | None:
        return self._matchers.get(slot)

    def forget(self, slot: int) -> None:
        self._matchers.pop(slot, None)

    def masks(self, running: list[Active], rows: int) -> tuple[np.ndarray, list[Emitted], list[Active], float]:
        """(masks [rows, words], what finished the grammar or failed it, the slots to free, host
        seconds spent). Requests whose grammar is complete emit EOS, certain under the grammar."""
        t0 = time.perf_counter()
        out: list[Emitted] = []
        done: list[Active] = []
        masks = np.full((rows, self._words), -1, np.int32)
        for act in running:
            m = self._matchers.get(act.slot)
            if m is None:
                continue
            budget = act.req.max_tokens - act.next_index  # tokens it may still emit, this one included
            try:
                if not m.done() and not m.ends_now(budget):
                    m.mask_into(masks[act.slot], budget)
                    continue
                k = act.req.sampling.logprobs  # EOS is certain under the grammar: logprob 0
                lp = TokenLogprobs(0.0, ((m.eos, 0.0),)[:k]).encode() if k is not None else None
                finish = FINISH_LENGTH if m.closed_early else FINISH_STOP
                out.append(Emitted(act.req.request_id, act.next_index, m.eos, finish, logprobs=lp))
            except GrammarError as e:
                log.warning("grammar failed request_id=%s: %s", act.req.request_id, e.message)
                out.append(Emitted(act.req.request_id, act.next_index, -1, FINISH_ERROR, error=e.message))
            done.append(act)
        return masks, out, done, time.perf_counter() - t0

    def proposal_masks(self, running: list[Active], proposals: dict[int, list[int]], masks: np.ndarray,
                       k: int, drawn: Collection[int] = ()) -> tuple[dict[int, list[int]], np.ndarray, float]:
        """A verify call's masks (speculative decoding): (the proposals, each constrained row's cut
        where its grammar says (Matcher.proposal_masks), masks int32 [rows, k + 1, words]: row r's
        mask for its query i, the position after i of its proposals (i = 0: `masks`' row, this
        step's; all-ones where a row is unconstrained or proposes fewer), host seconds spent).
        `drawn`: the slots whose proposals a sampling draft drew (kept up to their first token the
        grammar rejects, which the call then surely rejects: Matcher.proposal_masks)."""
        t0 = time.perf_counter()
        rows = masks.shape[0]
        out = np.full((rows, k + 1, self._words), -1, np.int32)
        out[:, 0] = masks
        cut = dict(proposals)
        for act in running:
            m = self._matchers.get(act.slot)
            ids = proposals.get(act.slot)
            if m is None or not ids or act.slot >= rows:
                continue
            budget = act.req.max_tokens - act.next_index
            try:
                n = m.proposal_masks(ids[:k], budget, out[act.slot], drawn=act.slot in drawn)
            except GrammarError as e:  # (a rollback llguidance refused: its next mask fails the request)
                log.warning("grammar proposal check failed request_id=%s: %s", act.req.request_id, e.message)
                n = 0
            if n:
                cut[act.slot] = ids[:n]
            else:
                del cut[act.slot]
        return cut, out, time.perf_counter() - t0

    def consume(self, slot: int, token: int) -> Fed:
        """Feed a sampled token to the slot's matcher (see Fed)."""
        m = self._matchers.get(slot)
        if m is None:
            return Fed(None, False, False)
        forced = m.done()  # only EOS may follow: a verify call's query after a completing token
        try:
            m.consume(token)
        except GrammarError as e:
            return Fed(e.message, False, False)
        return Fed(None, m.done() and token == m.eos, forced)

    def forced_logprobs(self, slot: int, k: int) -> str:
        """The logprobs of an EOS the grammar forced, as `masks` gives them (logprob 0, alone)."""
        return TokenLogprobs(0.0, ((self._matchers[slot].eos, 0.0),)[:k]).encode()


class Fed(NamedTuple):
    """A sampled token fed to a slot's matcher (SlotGrammars.consume)."""

    error: str | None  # why the grammar rejected it (None: it did not)
    done: bool  # the token is the EOS that completes the grammar
    forced: bool  # the grammar was complete before it: only EOS was allowed (logprob 0, as `masks` emits it)
