"""Speculative decoding's device half: a row's proposed tokens checked by the target model in one
call, and the proposer that needs no second model (issue 45).

A verify call (`verify_core`) runs each row of the decode batch as k + 1 queries: the row's next
input token and its proposals x_1 .. x_k at the positions after it. The queries of one row share
its block table, and every query's K/V is written before any query attends
(paged.decode_forward_paged), so query i sees the row's KV and the proposals before it: causal
attention over the proposals through the decode step's own attention (the CPU kernel or the
Pallas one read the pool in place; nothing new to compile but the wider batch).

Acceptance is the standard rule (Leviathan et al. 2023; vLLM's rejection sampler): with a
proposer that names one token (n-gram lookup, a greedy draft), q(x_i) = 1, so x_i is kept with
probability p_i(x_i), p_i the target's distribution at i after the row's processing (penalties
see the proposals before i as output, min_tokens counts i) and its temperature, top-k and top-p
filters. At the first rejection the row's token is drawn from p_i with x_i taken out and
renormalised; when all are kept, a bonus token is drawn from p_k. The emitted tokens are then
distributed exactly as the target's own. A greedy row keeps x_i when it is p_i's argmax and
emits the argmax at the first miss: its output is the non-speculative output, token for token.

Rejected proposals need no undo: their K/V sit past the row's new position, where nothing reads
until a later step writes that position again. The host (`DecodeSide.verify`) hands back the
blocks that only they used.
No I/O, no host state here but the proposer's plain lists.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tandem_engine.cores import DecodeState, _pin_pool
from tandem_engine.logits import PACKED_WIDTH, SlotLogits, apply, apply_mask, logprobs_of, pack
from tandem_engine.paged import decode_forward_paged
from tandem_engine.sampling import distribution, filter_candidates, greedy_tokens, sample, token_keys

ACCEPT_SALT = 0x5EC0DE  # folded into a token's key for its acceptance draw (the token's own draw keeps the key)


def ngram_propose(tokens: Sequence[int] | np.ndarray, k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: the last n tokens (n from max_n down to min_n) matched against everything
    before them; the up to k tokens that followed the latest match with k tokens after it (else
    the latest match) are the proposal. [] when no suffix recurs. vLLM's n-gram proposer does the
    same over the prompt and the output so far."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    if k < 1 or size < 2:
        return []
    for n in range(min(max_n, size - 1), max(min_n, 1) - 1, -1):
        tail = arr[size - n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)  # starts 0 .. size - 1 - n
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            # the latest earlier occurrence with k tokens after it, else the latest (in a repeating
            # tail the latest match is a period back, and only that many tokens follow it)
            whole = hits[hits + n + k <= size]
            start = int(whole[-1] if whole.size else hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramIndex:
    """`ngram_propose` over a growing token list, incrementally: every n-gram's start positions
    (n from min_n to max_n) are indexed as tokens arrive, so a proposal costs a few dictionary
    lookups, not a scan of the context (ngram_propose: ~90 µs at 1,000 tokens on this CPU, per row
    and dispatch). The proposals are ngram_propose's, token for token."""

    def __init__(self, tokens: Sequence[int], max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = int(max_n), max(1, int(min_n))
        self.seq: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}  # an n-gram -> where it starts, ascending
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seq, starts = self.seq, self._starts
        for t in tokens:
            seq.append(int(t))
            end = len(seq)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                starts.setdefault(tuple(seq[end - n:]), []).append(end - n)

    def propose(self, k: int) -> list[int]:
        seq, size = self.seq, len(self.seq)
        if k < 1 or size < 2:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            starts = self._starts.get(tuple(seq[size - n:]), ())
            latest = None
            for s in reversed(starts):  # the tail's own start first (skipped), then earlier ones
                if s + n > size - 1:
                    continue
                if latest is None:
                    latest = s
                if s + n + k <= size:  # the latest with k tokens after it
                    return seq[s + n:s + n + k]
            if latest is not None:
                return seq[latest + n:latest + n + k]
        return []


def extra_bucket(proposed: int, most: int) -> int:
    """The compiled count of a verify call's proposal queries for `proposed` of them: powers of
    two from 4, at most `most` (the batch's rows x k), so a pod compiles a few per batch bucket."""
    size = 4
    while size < proposed:
        size *= 2
    return max(1, min(size, most))


@partial(jax.jit, static_argnames=("cfg", "layout", "rows", "k", "max_len", "table_blocks", "force"),
         donate_argnums=(1,))
def verify_core(params, state: DecodeState, proposals, n_prop, extra_row, extra_off, logprobs=False, masks=None,
                draft_probs=None, *, cfg, layout, rows: int, k: int, max_len: int, table_blocks: int,
                force: bool = False):
    """One call that checks up to k proposals per row, as a ragged batch of queries: the rows'
    next inputs [0, rows) one each, then E extra queries, one per proposal (only the rows that
    propose pay for them). proposals int32 [rows, k] (row r's first n_prop[r] real; the caller
    keeps positions + n_prop <= max_len - 1 and the blocks reserved); extra_row, extra_off int32 [E]:
    extra query e feeds proposal extra_off[e] - 1 of row extra_row[e] at that row's position +
    extra_off[e] (rows >= `rows`: padding, never live). Returns (state, emitted int32 [rows, k + 1],
    counts int32 [rows]: row r emitted emitted[r, :counts[r]] (1 .. n_prop + 1; 0 for a free
    row), packed [rows, k + 1, PACKED_WIDTH]: the emitted tokens with their logprobs when the
    traced bool `logprobs` is set, else zeros, final_q: with `force`, float32 [rows, vocab], the
    distribution each row's last token was drawn from (sampling.distribution), else None). The
    row's next input is its last emitted token.

    `draft_probs` float32 [>= rows, k, vocab] (a sampling proposer, draft.py): q, the distribution
    row r's proposal i was drawn from (one-hot for a proposer that names one token), or None
    (every proposal one-hot: n-gram lookup). A sampled row keeps x_i with probability
    min(1, p_i(x_i) / q_i(x_i)) and at its first rejection draws from max(0, p_i - q_i),
    renormalised (module docstring); greedy rows are judged by the argmax either way.

    `masks` int32 [rows + E, ceil(vocab / 32)] (grammars: each query's allowed tokens, in the
    queries' order; all-ones rows for the unconstrained) or None (a variant traced without them):
    applied after processing, as the masked step applies them, so acceptance, the tokens drawn
    and the logprobs all see the constrained distribution.

    `force` (a draft model catching up, draft.py): every proposal is kept whatever the model says,
    so the call feeds known tokens through the row and emits the model's own token after them."""
    if k < 1:
        raise ValueError(f"a verify call checks k >= 1 proposals a row (got {k})")
    q = k + 1
    if draft_probs is not None:  # (the caller may pass every slot's: one compiled shape for all buckets)
        draft_probs = draft_probs[:rows]
    active = state.active[:rows]
    n_prop = jnp.where(active, jnp.clip(n_prop, 0, k), 0)
    pad = extra_row >= rows
    erow = jnp.where(pad, 0, extra_row)
    qrow = jnp.concatenate([jnp.arange(rows, dtype=jnp.int32), erow])  # each query's row
    qoff = jnp.concatenate([jnp.zeros(rows, jnp.int32), extra_off])  # and its offset past the row's position
    elive = ~pad & active[erow] & (extra_off >= 1) & (extra_off <= n_prop[erow])
    feed = jnp.concatenate([state.tokens[:rows], proposals[erow, jnp.clip(extra_off - 1, 0, k - 1)]])
    live = jnp.concatenate([active, elive])
    window = None if state.window_table is None else state.window_table[qrow, :table_blocks]
    logits, kp, vp = decode_forward_paged(params, feed, state.positions[qrow] + qoff, state.k, state.v,
                                          state.block_table[qrow, :table_blocks], cfg, max_len=max_len, active=live,
                                          mesh=None if layout is None else layout.mesh, window_table=window)
    kp, vp = _pin_pool(kp, layout), _pin_pool(vp, layout)
    # where[r, i]: the query whose logits draw row r's token i (0: the row's own; its i-th proposal's
    # query after; a row that proposed fewer points at its own, never read past n_prop)
    n_extra = extra_row.shape[0]
    slot_of = jnp.full((rows, q), -1, jnp.int32).at[extra_row, extra_off].set(  # (padding rows: dropped)
        rows + jnp.arange(n_extra, dtype=jnp.int32), mode="drop")
    where = jnp.where(slot_of < 0, jnp.arange(rows, dtype=jnp.int32)[:, None], slot_of).at[:, 0].set(
        jnp.arange(rows, dtype=jnp.int32))
    index = state.step[qrow] + qoff  # the token index each query's logits draw
    processed = _processed(logits, state, proposals, qrow, qoff, index, live, k)  # [Q, vocab] float32
    if masks is not None:
        processed = apply_mask(processed, masks)
    emitted, counts, final_q = _accept(processed, state, proposals, n_prop, qrow, qoff, index, where, rows, k, force,
                                       draft_probs)
    counts = jnp.where(active, counts, 0)
    last = jnp.take_along_axis(emitted, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
    history = state.history
    for j in range(q):  # each emitted token counted once as output (logits.record's 2 per token)
        history = history.at[jnp.arange(rows), emitted[:, j]].add(2 * (j < counts).astype(jnp.int32), mode="drop")
    new = state._replace(k=kp, v=vp, tokens=state.tokens.at[:rows].set(jnp.where(active, last, state.tokens[:rows])),
                         positions=state.positions.at[:rows].add(counts), step=state.step.at[:rows].add(counts),
                         history=history)

    def packed_logprobs():
        lp = logprobs_of(processed)[where.reshape(-1)]  # [rows * q, vocab]: each emitted token's query
        return pack(lp, emitted.reshape(-1)).reshape(rows, q, -1)

    packed = jax.lax.cond(logprobs, packed_logprobs, lambda: jnp.zeros((rows, q, PACKED_WIDTH), jnp.int32))
    return new, emitted, counts, packed, final_q


def _processed(logits, state: DecodeState, proposals, qrow, qoff, index, live, k: int):
    """Each query's logits after its row's processing, as the step would process them had the
    proposals before it been sampled: the penalty history counts them, min_tokens reads the
    query's own token index. Skipped (the logits as float32) when no live query needs it."""
    n, vocab = logits.shape
    p = SlotLogits(*(a[qrow] for a in state.processing))
    holding = (index < p.min_tokens) & (p.stop_ids[:, 0] < vocab)
    on = jnp.any(live & (p.penalized | holding))

    def processed(_):
        history = state.history[qrow]
        for i in range(k):  # the row's proposals before the query's own position, counted as output
            history = history.at[jnp.arange(n), proposals[qrow, i]].add(2 * (i < qoff).astype(jnp.int32), mode="drop")
        return apply(logits, history, p, index)

    return jax.lax.cond(on, processed, lambda _: logits.astype(jnp.float32), None)


def _accept(processed, state: DecodeState, proposals, n_prop, qrow, qoff, index, where, rows: int, k: int,
            force: bool = False, draft_probs=None):
    """(emitted [rows, k + 1], counts [rows], final_q) by the acceptance rule of the module
    docstring (with `force`, every proposal kept, and final_q each row's last token's
    distribution; else None)."""
    temperature, top_k, top_p = (a[:rows] for a in (state.temperature, state.top_k, state.top_p))
    greedy = greedy_tokens(processed)  # [Q]
    sampled = temperature > 0
    # the proposal each query's distribution judges: its row's proposal at the query's offset
    judged = proposals[qrow, jnp.minimum(qoff, k - 1)]

    def kept_sampled(_):  # bool [rows, k]: u < p(x) for each sampled row's proposals
        t = state.temperature[qrow]
        scaled = processed / jnp.maximum(t, 1e-6)[:, None]
        tk, tp = state.top_k[qrow], state.top_p[qrow]
        ids, filtered = filter_candidates(scaled, tk, tp)
        p_cut = jnp.sum(jnp.where(ids == judged[:, None], jax.nn.softmax(filtered, axis=-1), 0.0), axis=-1)
        p_whole = jnp.exp(jnp.take_along_axis(scaled, judged[:, None], axis=-1)[:, 0]
                          - jax.nn.logsumexp(scaled, axis=-1))
        p_x = jnp.where((tk > 0) | (tp < 1.0), p_cut, p_whole)
        keys = token_keys(state.seeds[qrow], index)
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, ACCEPT_SALT)))(keys)
        if draft_probs is None:  # one-hot proposals: q(x) = 1
            ok = (u < p_x) | (p_x >= 1.0)  # [Q]
        else:  # u < p(x) / q(x), without the division
            q_x = draft_probs[qrow, jnp.minimum(qoff, k - 1), judged]
            ok = ((u * q_x < p_x) | (p_x >= q_x)) & (p_x > 0)  # (a masked x: never, whatever q_x)
        return ok[where[:, :k]]

    match = proposals == greedy[where[:, :k]]
    if force:
        kept = jnp.ones((rows, k), bool)
    else:
        kept = jnp.where(sampled[:, None], jax.lax.cond(jnp.any(sampled), kept_sampled, lambda _: match, None), match)
    kept = kept & (jnp.arange(k)[None] < n_prop[:, None])
    taken = jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=1), axis=1)  # leading proposals kept
    at = jnp.take_along_axis(where, taken[:, None], axis=1)[:, 0]  # the query that draws the row's last token
    x_at = jnp.take_along_axis(proposals, jnp.minimum(taken, k - 1)[:, None], axis=1)[:, 0]
    q_at = None if draft_probs is None else draft_probs[jnp.arange(rows), jnp.minimum(taken, k - 1)]
    final = _final_token(processed[at], taken < n_prop, x_at, temperature, top_k, top_p, state.seeds[:rows],
                         index[at], q_at)
    cols = jnp.arange(k + 1)[None]
    padded = jnp.concatenate([proposals, jnp.zeros((rows, 1), jnp.int32)], axis=1)
    emitted = jnp.where(cols < taken[:, None], padded, jnp.where(cols == taken[:, None], final[:, None], 0))
    final_q = distribution(processed[at], temperature, top_k, top_p) if force else None
    return emitted.astype(jnp.int32), (taken + 1).astype(jnp.int32), final_q


def _final_token(processed, rejected, x, temperature, top_k, top_p, seeds, index, q=None):
    """Each row's last token from its query's processed logits [rows, vocab]: after a rejection,
    drawn from the filtered distribution with the rejected proposal x taken out (with `q`, the
    rejected proposal's distribution [rows, vocab]: from max(0, p - q) renormalised); else the
    step's own draw (`sample`, the same key: a row that proposed nothing gets the token a step
    gives). A greedy row gets the argmax either way."""
    keys = token_keys(seeds, index)
    bonus = sample(processed, temperature, top_k, top_p, keys)
    redraw = rejected & (temperature > 0)

    def residual_q(_):
        p = distribution(processed, temperature, top_k, top_p)
        left = jnp.maximum(p - q, 0.0)
        left = jnp.where(jnp.sum(left, axis=-1, keepdims=True) > 0, left, p)  # (p == q: never rejected)
        return jax.vmap(jax.random.categorical)(keys, jnp.log(left)).astype(jnp.int32)

    def residual(_):
        vocab = processed.shape[-1]
        scaled = processed / jnp.maximum(temperature, 1e-6)[:, None]
        ids, filtered = filter_candidates(scaled, top_k, top_p)
        pick = jax.vmap(jax.random.categorical)(keys, jnp.where(ids == x[:, None], -jnp.inf, filtered))
        cut = jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]
        whole = jax.vmap(jax.random.categorical)(keys, jnp.where(jnp.arange(vocab)[None] == x[:, None], -jnp.inf,
                                                                 scaled))
        return jnp.where((top_k > 0) | (top_p < 1.0), cut, whole).astype(jnp.int32)

    redrawn = residual if q is None else residual_q
    return jnp.where(redraw, jax.lax.cond(jnp.any(redraw), redrawn, lambda _: bonus, None), bonus)
