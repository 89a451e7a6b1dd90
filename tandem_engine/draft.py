"""A draft model's proposals for speculative decoding (issue 45): a smaller checkpoint with the
target's tokenizer runs beside the target on the decode pod and proposes each row's next k tokens;
the target checks them in its verify call (speculative.py), which keeps the target's output exact
whatever the draft says. Greedily (a greedy draft names one token: q(x) = 1), or, with `sample`,
for a row seated with sampling parameters, by sampling at them: each proposal x_i is drawn from the
draft's own filtered distribution q_i (sampling.distribution), and `last_q` hands the q_i on to
the verify call, which keeps x_i with probability min(1, p_i(x_i) / q_i(x_i)). A draft that
samples as the target does proposes what the target would sample more often than its argmax is
sampled, when the distribution is flat (open generation at temperature ~1).

The draft is an Engine of its own (its own weights and its own KV pool, with the target's slots
and max_len), its rows mirroring the target's: the draft row of slot s holds the KV of the tokens
it was fed, `fed`, positions 0 .. len(fed) - 1. One `propose` call, for every speculating row:

  1. rows whose request changed, or that are no longer asked for, are freed; a row not seated is
     seated: the draft prefills its tokens but the last (one prefill and insert; a context longer
     than the draft's largest prefill bucket, its first bucket's worth: step 2 feeds the rest);
  2. every row is set back to the first position where its fed tokens and the target's part
     (`rewind`: the rejected proposals' KV is left to be written again, its blocks go back) and
     fed the target's tokens from there, its last the target's next input, by verify calls with
     every token kept (`force`), `catch_up` + 1 tokens a row a call: the last call emits the
     draft's first proposal after them;
  3. k - 1 ordinary steps of the draft (one multi-step call) give the rest (with `sample`,
     `generate_drafts`: with their distributions).

After a verify call that kept j of k proposals, a row's draft parts from the target at most one
position before the target's next input, so step 2 feeds it one or two tokens in one call. Rows
that sat out dispatches (the target's ordinary steps: a colocated pod's chunked prefill of a new
prompt runs ~8 of them, a plain stretch of the pod's gate hundreds) are behind by more: step 2
feeds them over their kept KV in up to `max_rounds` calls (each call feeds every row, so the rows
behind least ride along in the calls the furthest one needs). A row further behind than that is
seated afresh by a prefill (one prefill costs less than more calls over every row) or, when its
context is longer than the draft can prefill, is fed `max_rounds` calls' worth and proposes
nothing this time (it catches up over the next dispatches). Three to five calls on the draft and
one copy to the host per dispatch in the common case, whatever the rows.
No I/O, no tokenizer, no settings here.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Hashable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tandem_core.errors import ModelNotFound
from tandem_core.models import ModelInfo
from tandem_core.types import SamplingParams
from tandem_engine.api import StepVariant

log = logging.getLogger(__name__)
GREEDY = SamplingParams()


@dataclass
class DraftRow:
    """The draft row of one target row: the request it holds and the tokens whose KV it holds."""

    key: Hashable
    fed: list[int]
    sure: int  # fed[:sure] is known to equal the target's tokens (the rest: the draft's own guesses)


@dataclass(frozen=True)
class DraftWarm:
    """One compiled shape of the draft's calls, for a decode pod's idle-time warm-up: a prefill
    bucket (with its insert), or a step / forced verify variant."""

    bucket: int = 0
    variant: StepVariant | None = None


def check_draft(target: ModelInfo, draft: ModelInfo) -> None:
    """ModelNotFound (a configuration error: the pod stops, saying why) unless `draft` can propose for `target`: the same vocabulary (its ids must mean the
    target's tokens): the same size and kind of tokenizer, and where both directories hold a
    tokenizer.json, the same vocabulary in it."""
    why = None
    if draft.vocab_size != target.vocab_size:
        why = f"a vocabulary of {draft.vocab_size} tokens against the target's {target.vocab_size}"
    elif draft.tokenizer != target.tokenizer:
        why = f"tokenizer kind {draft.tokenizer!r} against the target's {target.tokenizer!r}"
    elif draft.path and target.path:
        ours, theirs = (Path(p) / "tokenizer.json" for p in (draft.path, target.path))
        if ours.is_file() and theirs.is_file() and _vocab(ours) != _vocab(theirs):
            why = f"a tokenizer.json whose vocabulary differs from the target's ({theirs})"
    if why:
        raise ModelNotFound(f"the draft model {draft.name} cannot propose for {target.name}: it has {why}; a draft "
                         f"must share the target's tokenizer")


def _vocab(path: Path):
    model = json.loads(path.read_text()).get("model", {})
    return model.get("vocab"), model.get("merges")


class DraftProposer:
    """Proposals of a draft Engine for a target's rows (module docstring). One thread owns it (the
    target engine's): its state is donated through every call. `sample`: rows asked for with
    sampling parameters draw their proposals at them, and `last_q` holds the distributions."""

    def __init__(self, draft, k: int, catch_up: int | None = None, sample: bool = False,
                 max_rounds: int = 4) -> None:
        if k < 1:
            raise ValueError(f"a draft proposes k >= 1 tokens (got {k})")
        if max_rounds < 1:
            raise ValueError(f"a draft catches a row up in max_rounds >= 1 forced calls (got {max_rounds})")
        self.engine = draft
        self.k = int(k)
        self.sample = bool(sample)
        # with `sample`: float32 [slots, k, vocab] on the device, the distribution each of the last
        # `propose`'s tokens was drawn from (row = slot; one-hot for a greedy row); else None
        self.last_q: jax.Array | None = None
        self.catch_up = int(catch_up if catch_up is not None else k + 1)  # the forced call's width
        self.max_rounds = int(max_rounds)  # forced calls per propose, at most
        self.state = draft.init_state()
        self.rows: dict[int, DraftRow] = {}
        self.seats = 0  # prefills done to seat a row (first seats, and rows too far behind for max_rounds)
        self.calls = 0
        self.rounds = 0  # forced calls (one a propose, more while rows catch up)
        self.lagging = 0  # rows left behind by a propose (too far behind to prefill or to catch up at once)

    def warm_items(self) -> list[DraftWarm]:
        """Every shape `propose` may run: each prefill bucket and its insert, each batch bucket's
        k - 1 steps, each forced verify shape."""
        e = self.engine
        items = [DraftWarm(bucket=b) for b in e.buckets]
        if self.k > 1:
            items += [DraftWarm(variant=StepVariant(rows, e.max_blocks_per_seq, self.k - 1, False, False))
                      for rows in e.batch_buckets]
        items += [DraftWarm(variant=v) for v in e.verify_variants(self.catch_up, force=True)]
        return items

    def warm(self, item: DraftWarm) -> None:
        """Compile (run over free rows) one of `warm_items`; rows seated now are left as they are."""
        e = self.engine
        if item.variant is not None:
            if self.rows:  # a shape's warm run takes every row free
                self.reset()
            if self.sample and not item.variant.spec_k:  # the steps that give their distributions
                self.state, toks, q = e.generate_drafts(self.state, item.variant.rows, steps=item.variant.steps)
                first = q[0] * 0.0  # a final_q's shape, on the devices the draft's arrays are on
                jax.block_until_ready(_stack_q(first, q, slots=e.slots))
            else:
                self.state = e.warm_step(self.state, item.variant)
            return
        free = next((s for s in range(e.slots) if s not in self.rows), None)
        if free is None:
            return
        prefix = e.prefill([0] * item.bucket, GREEDY)
        self.state = e.insert(prefix, self.state, free, GREEDY)
        self.state = e.free(self.state, free)

    def reset(self) -> None:
        """Every row freed (the next `propose` seats them again)."""
        for slot in list(self.rows):
            self._drop(slot)

    def _drop(self, slot: int) -> None:
        del self.rows[slot]
        self.state = self.engine.free(self.state, slot)

    def propose(self, seqs: Mapping[int, tuple]) -> dict[int, list[int]]:
        """slot -> (the request it holds, its tokens: the prompt and every emitted token, the last
        the target's next input[, its SamplingParams]) for every row that may speculate now ->
        slot -> the draft's k proposals: greedy, or with `sample` and sampling parameters given
        (a row keeps those it was seated with), drawn at them (their distributions in `last_q`).
        Rows not in `seqs` are freed. A row with fewer than k positions left before max_len gets
        none, and so does a row still catching up (module docstring)."""
        e = self.engine
        self.last_q = None
        for slot in [s for s, r in self.rows.items() if s not in seqs or seqs[s][0] != r.key]:
            self._drop(slot)
        at: dict[int, int] = {}  # slot -> the position its feeding starts at
        ctx: dict[int, list[int]] = {}
        for slot, (key, seq, *more) in seqs.items():
            seq = list(seq)
            sampling = more[0] if more and more[0] is not None and self.sample else GREEDY
            if len(seq) < 2 or len(seq) + self.k > e.max_len:
                if slot in self.rows:
                    self._drop(slot)
                continue
            row = self.rows.get(slot)
            n = 0 if row is None else _agree(row, seq)
            far = self._calls_for(len(seq) - n) > self.max_rounds and len(seq) - 1 <= e.max_prompt_len()
            if row is None or n < 1 or far:
                if row is not None:
                    self._drop(slot)
                n = min(len(seq) - 1, e.max_prompt_len())
                self.state = e.insert(e.prefill(seq[:n], GREEDY), self.state, slot, sampling)
                self.seats += 1
                row = self.rows[slot] = DraftRow(key, seq[:n], n)
            at[slot], ctx[slot] = n, seq
        if not at:
            return {}
        self.calls += 1
        rows = max(at) + 1
        out = self._feed(at, ctx, rows=rows)
        ready = [s for s in at if at[s] == len(ctx[s])]
        for slot in at:
            self.rows[slot].fed = ctx[slot][:at[slot]]
            self.rows[slot].sure = at[slot]
        self.lagging += len(at) - len(ready)
        if not ready:
            return {}
        rest = None
        if self.k > 1 and self.sample:
            self.state, toks, q = e.generate_drafts(self.state, rows, steps=self.k - 1)
            self.last_q = _stack_q(out.final_q, q, slots=e.slots)
            rest = np.asarray(toks)  # [k - 1, bucket]
        elif self.k > 1:
            self.state, toks = e.generate(self.state, rows, steps=self.k - 1)
            rest = np.asarray(toks)  # [k - 1, bucket]
        elif self.sample:
            self.last_q = _stack_q(out.final_q, None, slots=e.slots)
        emitted = np.asarray(out.tokens)
        props: dict[int, list[int]] = {}
        for slot in ready:
            ids = [int(emitted[slot, int(out.counts[slot]) - 1])] + ([] if rest is None else rest[:, slot].tolist())
            self.rows[slot].fed += ids[:-1]  # the last proposal is the row's next input, not fed yet
            props[slot] = ids
        return props

    def _calls_for(self, tokens: int) -> int:
        """Forced calls that feed a row `tokens` tokens (catch_up + 1 a call)."""
        return -(-tokens // (self.catch_up + 1))

    def _feed(self, at: dict[int, int], ctx: dict[int, list[int]], rows: int):
        """Step 2 of the module docstring: every row in `at` set back to its position there and fed
        its context from it, `catch_up` + 1 tokens a forced call, until every row has been fed
        its last token or `max_rounds` calls ran (a row fed to its end early is fed its last
        token again: each call feeds every row, and the last call's output is the proposals').
        `at` ends at each row's fed length (its context's length: caught up). Returns the last
        call's SpecOut (tokens on the device)."""
        e = self.engine
        width = self.catch_up + 1
        out = None
        for _ in range(self.max_rounds):
            rewind: dict[int, tuple[int, int]] = {}
            forced: dict[int, list[int]] = {}
            for slot, p in at.items():
                p = min(p, len(ctx[slot]) - 1)
                chunk = ctx[slot][p:p + width]
                rewind[slot], forced[slot] = (p, chunk[0]), chunk[1:]
                at[slot] = p + len(chunk)
            self.state = e.rewind(self.state, rewind)
            self.state, out = e.verify(self.state, forced, self.catch_up, rows, force=True)  # (no wait: on the device)
            self.rounds += 1
            if all(at[s] == len(ctx[s]) for s in at):
                break
        return out


@partial(jax.jit, static_argnames=("slots",))
def _stack_q(first, rest, *, slots: int):
    """[slots, k, vocab] (rows past the bucket zero: one shape for the verify call whatever the
    bucket): the forced call's last token's distribution [bucket, vocab], then the steps' [k -
    1, bucket, vocab] (None for k = 1)."""
    q = first[:, None] if rest is None else jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
    return jnp.pad(q, ((0, slots - q.shape[0]), (0, 0), (0, 0)))


def _agree(row: DraftRow, seq: list[int]) -> int:
    """How many leading positions of the row's fed tokens are the target's (`seq`'s) too, at most
    len(seq) - 1 (the target's next input is fed again either way)."""
    n = min(row.sure, len(row.fed), len(seq) - 1)
    limit = min(len(row.fed), len(seq) - 1)
    while n < limit and row.fed[n] == seq[n]:
        n += 1
    return n
