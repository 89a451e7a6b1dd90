"""Speculative decoding's host side of the engine (issue 45): `verify` checks each row's proposed
tokens in one call (speculative.verify_core: the rows' next inputs and one query per proposal,
each through its row's block table), keeps the row positions and blocks the call leaves, and gives
back the blocks only rejected proposals used; `verify_variants` / `warm_verify` are the call's
compiled shapes, which a decode pod compiles in its idle time. The proposers are the services'
(decode_svc/speculate.py); the device half and the acceptance rule are speculative.py's.
No I/O, no tokenizer, no settings here.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tandem_engine.api import StepVariant
from tandem_engine.cores import DecodeState
from tandem_engine.engine_decode import DecodeSide
from tandem_engine.speculative import extra_bucket, verify_core


@dataclass
class SpecOut:
    """What `verify` returns beside the state, on the host: row r emitted tokens[r, :counts[r]]
    (int32 [rows, k + 1]; [rows, k + 1, PACKED_WIDTH] with logprobs, logits.unpack_* read each
    row); `proposed[r]` of its proposals were checked (counts[r] - 1 of them kept). `final_q`
    (a `force` call's, on the device): float32 [rows, vocab], the distribution each row's last
    token was drawn from."""

    tokens: np.ndarray  # (a device array from a `force` call)
    counts: np.ndarray
    proposed: np.ndarray
    final_q: jax.Array | None = None


@partial(jax.jit, donate_argnums=(0,))
def rewind_core(state: DecodeState, slots, positions, tokens) -> DecodeState:
    """`SpeculativeSide.rewind`'s device half: rows `slots` (padding past the last: dropped) get
    these positions and next input tokens."""
    return state._replace(positions=state.positions.at[slots].set(positions, mode="drop"),
                          tokens=state.tokens.at[slots].set(tokens, mode="drop"))


class SpeculativeSide(DecodeSide):
    """`verify` and its compiled shapes over the decode side's rows and blocks."""

    def verify_variants(self, k: int, force: bool = False, masked: bool = False,
                        drafted: bool = False) -> list[StepVariant]:
        """The speculative verify call's compiled shapes for proposals of up to k tokens: every
        batch bucket with each of its proposal-query buckets (speculative.extra_bucket: 4, 8, ..
        up to rows x k); `force`: the draft model's catch-up call's (draft.py); `masked`: those
        that take grammar masks; `drafted`: those that take the proposals' distributions."""
        out: list[StepVariant] = []
        for rows in self.batch_buckets:
            extras = sorted({extra_bucket(n, rows * k) for n in range(1, rows * k + 1)})
            out += [StepVariant(rows, self.max_blocks_per_seq, k + 1, False, masked, k, e, force, drafted)
                    for e in extras]
        return out

    def verify(self, state: DecodeState, proposals: Mapping[int, Sequence[int]], k: int, rows: int | None = None, *,
               logprobs: bool = False, force: bool = False, masks: np.ndarray | None = None,
               draft_probs: jax.Array | None = None) -> tuple[DecodeState, SpecOut]:
        """One speculative call (donates `state`): every active row below `rows` takes one step,
        and a row in `proposals` (slot -> its proposed next tokens) also has up to `k` of them
        checked by the target in the same call (speculative.py: greedy rows keep the output they
        would have had, sampled rows its distribution). A row's proposals are cut where they would
        pass max_len - 1. Reserves the blocks the next k + 1 positions of every row fall in as
        `generate` does (RuntimeError when the pool is short: `reserve(state, k + 1)` first and
        hand rows back), and afterwards gives back the blocks that only rejected proposals used.
        Returns the state and a `SpecOut` on the host (the call waits for the counts: the next
        proposals need the tokens). `masks` (grammars): int32 [<= bucket, k + 1, ceil(vocab /
        32)], row r's allowed tokens at its query i (the position after i of its proposals; the
        caller cuts each proposal where its grammar rejects it, so every proposal is allowed
        where it is checked), all-ones for an unconstrained row; None runs the unmasked call. No
        prompt seated by `begin_prompt` may be pending (`generate_ragged` serves those). `force`: every proposal is kept (a
        draft model fed the target's tokens, draft.py; no cut but max_len's): the counts are the
        proposals' + 1 without a wait for the call, and `SpecOut.tokens` stays on the device.
        `draft_probs` (a sampling proposer's, on the device or the host): float32 [rows', k,
        vocab], row r's proposal i was drawn from draft_probs[r, i] (one-hot for one named
        token); best [slots, k, vocab], the one shape the call is compiled for (other row counts
        are padded or cut to it first: a small compiled call of their own). Sampled rows are
        judged by min(1, p / q) (speculative.verify_core); a compiled variant of its own."""
        if self._pending:
            raise RuntimeError("a prompt seated by begin_prompt is pending: generate_ragged serves it first")
        k = int(k)
        if self._short_rows(k + 1):
            state, failed = self.reserve(state, k + 1)
            if failed:
                raise RuntimeError(f"slots {failed} have no KV blocks for their next {k + 1} positions and the pool "
                                   f"has too few free: free some slots (reserve(state, {k + 1}) says which)")
        bucket = self.rows_for(rows)
        props = np.zeros((bucket, k), np.int32)
        n_prop = np.zeros(bucket, np.int32)
        for slot, ids in proposals.items():
            if not (0 <= slot < bucket and self._occupied[slot]):
                continue
            n = max(0, min(len(ids), k, self.max_len - 1 - int(self._pos[slot])))
            props[slot, :n] = np.asarray(ids[:n], np.int32)
            n_prop[slot] = n
        new, emitted, counts, packed, final_q = self._verify_call(state, props, n_prop, k, bucket,
                                                                  extra_bucket(int(n_prop.sum()), bucket * k),
                                                                  logprobs, self._table_width(k + 1), force, masks,
                                                                  draft_probs)
        live = np.flatnonzero(self._occupied[:bucket])
        if force:  # every proposal kept: the counts are known here, and the tokens stay on the device
            counts = np.where(self._occupied[:bucket], n_prop + 1, 0).astype(np.int32)
        else:
            counts = np.asarray(counts)
        self._pos[live] += counts[live]
        if self._trim_rejected(live):
            new = self._with_tables(new)
        out = packed if logprobs else emitted
        return new, SpecOut(out if force else np.asarray(out), counts, n_prop, final_q)

    def _verify_call(self, state: DecodeState, props: np.ndarray, n_prop: np.ndarray, k: int, bucket: int,
                     extra: int, logprobs: bool, width: int, force: bool = False, masks: np.ndarray | None = None,
                     draft_probs: jax.Array | None = None):
        """speculative.verify_core over rows [0, bucket) with `extra` proposal queries (row r's
        n_prop[r] proposals first, in row order; the rest padding); `masks` [<= bucket, k + 1,
        words] gathered into the queries' order (padding all-ones)."""
        total = int(n_prop.sum())
        extra_row = np.full(extra, bucket, np.int32)  # padding: a row past the batch, never live
        extra_off = np.zeros(extra, np.int32)
        extra_row[:total] = np.repeat(np.arange(bucket, dtype=np.int32), n_prop)
        extra_off[:total] = np.concatenate([np.arange(1, n + 1, dtype=np.int32) for n in n_prop])
        qmasks = None if masks is None else self._query_masks(masks, bucket, k, extra_row, extra_off)
        q = None
        if draft_probs is not None:  # every slot's rows (one compiled shape whatever rows the proposer had),
            # committed where the state is, as warm_verify's are (a jit compiles again for another placement)
            q = jax.device_put(_rows_to(draft_probs, self.slots, k, self.info.vocab_size), state.tokens.sharding)
        return verify_core(self.step_params, state, props, n_prop, extra_row, extra_off, np.bool_(logprobs), qmasks, q,
                           cfg=self.cfg, layout=self.layout, rows=bucket, k=k, max_len=self.max_len,
                           table_blocks=width, force=force)

    def _query_masks(self, masks: np.ndarray, bucket: int, k: int, extra_row: np.ndarray,
                     extra_off: np.ndarray) -> np.ndarray:
        """int32 [bucket + E, words]: each query's mask (row r's query i: masks[r, i])."""
        words = (self.info.vocab_size + 31) // 32
        m = np.asarray(masks)
        if m.dtype != np.int32 or m.ndim != 3 or m.shape[0] > bucket or m.shape[1] != k + 1 or m.shape[2] != words:
            raise ValueError(f"verify masks must be int32 [<= {bucket}, {k + 1}, {words}], got {m.dtype} {m.shape}")
        full = np.full((bucket + 1, k + 1, words), -1, np.int32)  # row `bucket`: the padding queries'
        full[:m.shape[0]] = m
        return np.concatenate([full[:bucket, 0], full[extra_row, extra_off]])

    def warm_verify(self, state: DecodeState, variant) -> DecodeState:
        """Run one of `verify_variants`' shapes over `state`, every row free (so nothing is
        proposed, and only the null block is written): compiled on its first run. Donates `state`."""
        v = variant
        q = np.zeros((self.slots, v.spec_k, self.info.vocab_size), np.float32) if v.drafted else None
        new, emitted, *_ = self._verify_call(state, np.zeros((v.rows, v.spec_k), np.int32), np.zeros(v.rows, np.int32),
                                             v.spec_k, v.rows, v.extra, v.logprobs, v.width, v.force,
                                             self._all_allowed(v) if v.masked else None, q)
        jax.block_until_ready(emitted)
        return new

    def _all_allowed(self, v: StepVariant) -> np.ndarray:
        return np.full((v.rows, v.spec_k + 1, (self.info.vocab_size + 31) // 32), -1, np.int32)

    def rewind(self, state: DecodeState, rows: Mapping[int, tuple[int, int]]) -> DecodeState:
        """Set active rows back (donates `state`): slot -> (position, token), the row's next input
        `token` at `position` (<= where it is; its KV before `position` is kept, what lies past it
        is written again by later calls), and its blocks past that position's back to the pool.
        What a draft model does after the target rejected some of its tokens (draft.py)."""
        if not rows:
            return state
        slots = np.full(self.slots, self.slots, np.int32)  # padding: past the last slot, dropped
        pos = np.zeros(self.slots, np.int32)
        toks = np.zeros(self.slots, np.int32)
        for i, (slot, (p, t)) in enumerate(sorted(rows.items())):
            if not (0 <= slot < self.slots and self._occupied[slot]):
                raise ValueError(f"slot {slot} holds no row to rewind")
            if not 0 <= p <= int(self._pos[slot]):
                raise ValueError(f"slot {slot} is at position {int(self._pos[slot])}: it cannot go to {p}")
            slots[i], pos[i], toks[i] = slot, p, t
            self._pos[slot] = p
        if self._trim_rejected(np.asarray(sorted(rows), np.int64)):
            state = self._with_tables(state)
        return rewind_core(state, slots, pos, toks)

    def _trim_rejected(self, slots: np.ndarray) -> bool:
        """Blocks past the one each row's next position falls in, reserved for proposals the
        call rejected, back to the pool (a block-table edit; their contents are never read).
        Returns whether a table changed."""
        changed = False
        with self._blocks_lock:
            for slot in slots.tolist():
                need = self._blocks_needed(slot, 1)
                held = int(self._held[slot])
                if held > need:
                    self._alloc.release([b for b in self._table[slot, need:held].tolist() if b])
                    self._table[slot, need:held] = 0
                    self._held[slot] = need
                    changed = True
        return changed


@partial(jax.jit, static_argnames=("rows", "k", "vocab"))
def _fit_rows(q, *, rows: int, k: int, vocab: int):
    q = q[:rows, :k].astype(jnp.float32)
    return jnp.pad(q, ((0, rows - q.shape[0]), (0, k - q.shape[1]), (0, 0)))


def _rows_to(q, rows: int, k: int, vocab: int):
    """draft_probs as float32 [rows, k, vocab] (extra rows and proposals dropped, missing ones zero)."""
    shape = tuple(q.shape)
    if len(shape) != 3 or shape[2] != vocab:
        raise ValueError(f"draft_probs must be [rows, k, {vocab}], got {shape}")
    if shape[:2] == (rows, k) and q.dtype == np.float32:
        return q
    return _fit_rows(q, rows=rows, k=k, vocab=vocab)
