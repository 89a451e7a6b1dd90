"""Per-slot logits processing and logprobs: what turns a model's logits into the processed logits
that sampling draws from, and the logprobs a request can ask for.

The order is the contract's (tandem_core.types.SamplingParams), the same on every pod:
  logits -> repetition_penalty (prompt or output tokens: positive / p, negative * p, HF/vLLM)
  -> presence/frequency (output tokens: - presence * (count > 0) - frequency * count, OpenAI)
  -> logit_bias (added) -> min_tokens (stop ids at -inf while the token index < min_tokens)
  = the processed logits -> a grammar's allowed-token mask (`apply_mask`, only in the compiled
  variants that take masks) = what sampling draws from. logprobs = log_softmax of that, -inf
  clamped to LOGPROB_FLOOR.

Each slot's penalty state is one int32 row over the vocabulary, `history` = 2 x (times the token was
output) + 1 if it sits in the prompt and was never output: seen (for repetition) is `> 0`, the
output count is `>> 1`. One array means one scatter per decode step (the sampled token adds 2) and
no host round trip. Slot parameters (`SlotLogits`) are device arrays with a leading slot axis so
one compiled step serves a mixed batch; a batch in which no active slot processes anything skips
the work with `lax.cond` (the hot path: all-greedy, no penalties, costs what it did before).

Logprobs leave the device packed with the tokens, one int32 array [rows, 2 + 2 * MAX_TOP_LOGPROBS]
(`pack`): col 0 the token, col 1 its logprob (float32 bits), then the top ids best first, then
their logprobs (float32 bits). `unpack_tokens` / `unpack_logprobs` read it on the host.
No I/O, no slots bookkeeping, no model here.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tandem_core.errors import InvalidRequest
from tandem_core.types import (LOGPROB_FLOOR, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS,
                               SamplingParams, TokenLogprobs)

PACKED_WIDTH = 2 + 2 * MAX_TOP_LOGPROBS  # columns of a packed (token, logprobs) row


class SlotLogits(NamedTuple):
    """Processing parameters, one row per slot (or per choice of a prefill); a pytree.
    Padding ids are >= vocab: the scatters drop them (mode="drop")."""

    repetition: jax.Array  # float32 [n]; 1 = off
    presence: jax.Array  # float32 [n]
    frequency: jax.Array  # float32 [n]
    bias_ids: jax.Array  # int32 [n, MAX_LOGIT_BIAS]
    bias: jax.Array  # float32 [n, MAX_LOGIT_BIAS]
    stop_ids: jax.Array  # int32 [n, MAX_STOP_TOKEN_IDS]
    min_tokens: jax.Array  # int32 [n]: stop ids are masked while the token index < min_tokens
    penalized: jax.Array  # bool [n]: penalties or a bias on (min_tokens is checked per step)


# ---------------------------------------------------------------------------------------------
# host side: validation and per-request arrays


def _finite(name: str, value: float) -> float:
    if not math.isfinite(float(value)):
        raise InvalidRequest(f"{name} must be a finite number, got {value}", param=name)
    return float(value)


def _bias_rows(logit_bias, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                             param="logit_bias")
    merged: dict[int, float] = {}
    for tok, b in logit_bias:  # a repeated id: the last entry wins, as a JSON object's would
        if not 0 <= int(tok) < vocab:
            raise InvalidRequest(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab})",
                                 param="logit_bias")
        merged[int(tok)] = _finite("logit_bias", b)
    ids = np.full((MAX_LOGIT_BIAS,), vocab, np.int32)
    vals = np.zeros((MAX_LOGIT_BIAS,), np.float32)
    ids[: len(merged)] = list(merged)
    vals[: len(merged)] = list(merged.values())
    return ids, vals


def _stop_row(stop_ids: Sequence[int], vocab: int) -> np.ndarray:
    # ids outside the vocabulary can never be drawn, so there is nothing to hold back for them
    uniq = sorted({int(t) for t in stop_ids if 0 <= int(t) < vocab})
    if len(uniq) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids: {len(uniq)} distinct ids (EOS included); at most "
                             f"{MAX_STOP_TOKEN_IDS} are allowed", param="stop_token_ids")
    row = np.full((MAX_STOP_TOKEN_IDS,), vocab, np.int32)
    row[: len(uniq)] = uniq
    return row


def slot_logits(params: SamplingParams, vocab: int, stop_ids: Sequence[int] = ()) -> SlotLogits:
    """Validated host arrays for one request (scalars and rows). InvalidRequest names the field."""
    rep = _finite("repetition_penalty", params.repetition_penalty)
    if rep <= 0:
        raise InvalidRequest(f"repetition_penalty must be > 0, got {rep}", param="repetition_penalty")
    presence = _finite("presence_penalty", params.presence_penalty)
    frequency = _finite("frequency_penalty", params.frequency_penalty)
    if params.logprobs is not None and not 0 <= int(params.logprobs) <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {params.logprobs}",
                             param="logprobs")
    if int(params.min_tokens) < 0:
        raise InvalidRequest(f"min_tokens must be >= 0, got {params.min_tokens}", param="min_tokens")
    ids, vals = _bias_rows(params.logit_bias, vocab)
    return SlotLogits(
        repetition=np.float32(rep), presence=np.float32(presence), frequency=np.float32(frequency),
        bias_ids=ids, bias=vals, stop_ids=_stop_row(stop_ids, vocab),
        min_tokens=np.int32(params.min_tokens),
        penalized=np.bool_(rep != 1.0 or presence != 0.0 or frequency != 0.0 or bool(params.logit_bias)),
    )


def check_output_from(output_from: int | None, n: int) -> int:
    """Where the output starts in a sequence of n ids (default n: no output yet)."""
    out_from = n if output_from is None else int(output_from)
    if not 0 <= out_from <= n:
        raise InvalidRequest(f"output_from {output_from} is outside the prompt [0, {n}]", param="output_from")
    return out_from


def history_arrays(history: Sequence[int] | None, output_from: int | None, true_length: int, length: int,
                   vocab: int) -> tuple[np.ndarray, int, int]:
    """An insert's penalty history on the host: (ids zero-padded to the prefix length, so insert
    compiles once per bucket; how many are real; where the output starts). None: no history."""
    ids = np.zeros((length,), np.int32)
    if history is None:
        return ids, 0, 0
    h = np.asarray(history, np.int64).reshape(-1)
    if h.shape[0] != true_length:
        raise ValueError(f"history has {h.shape[0]} ids; the prefix holds {true_length}")
    if h.size and (h.min() < 0 or h.max() >= vocab):
        raise InvalidRequest(f"history token ids must be in [0, {vocab})", param="prompt")
    ids[:true_length] = h
    return ids, true_length, check_output_from(output_from, true_length)


def mask_rows(masks, rows: int, vocab: int) -> np.ndarray:
    """Validated grammar masks as int32 [rows, ceil(vocab / 32)]: fewer rows are padded with
    all-ones rows (unconstrained), so one compiled variant serves a batch bucket."""
    words = (vocab + 31) // 32
    m = np.asarray(masks)
    if m.ndim != 2 or m.shape[1] != words or m.shape[0] > rows or m.dtype != np.int32:
        raise ValueError(f"masks must be int32 [<= {rows}, {words}] (a bitmask over {vocab} tokens), got "
                         f"{m.dtype} {list(m.shape)}")
    if m.shape[0] == rows:
        return m
    return np.concatenate([m, np.full((rows - m.shape[0], words), -1, np.int32)])


def stack(rows: Sequence[SlotLogits]) -> SlotLogits:
    """One SlotLogits with a leading axis from per-request ones (the choices of a prefill)."""
    return SlotLogits(*(np.stack(xs) for xs in zip(*rows)))


def init_slot_logits(slots: int, vocab: int, device=None) -> SlotLogits:
    """Every slot off: no penalty, no bias, no stop ids."""
    def full(shape, value, dtype):
        return jnp.full(shape, value, dtype, device=device)

    return SlotLogits(
        repetition=full((slots,), 1.0, jnp.float32), presence=full((slots,), 0.0, jnp.float32),
        frequency=full((slots,), 0.0, jnp.float32),
        bias_ids=full((slots, MAX_LOGIT_BIAS), vocab, jnp.int32),
        bias=full((slots, MAX_LOGIT_BIAS), 0.0, jnp.float32),
        stop_ids=full((slots, MAX_STOP_TOKEN_IDS), vocab, jnp.int32),
        min_tokens=full((slots,), 0, jnp.int32), penalized=full((slots,), False, jnp.bool_),
    )


# ---------------------------------------------------------------------------------------------
# device side


def history_row(ids: jax.Array, length: jax.Array, output_from: jax.Array, vocab: int) -> jax.Array:
    """int32 [vocab] penalty state of one sequence: ids [T] (positions >= length are padding),
    ids[output_from:length] are output tokens (counted), all of ids[:length] are seen."""
    pos = jnp.arange(ids.shape[0])
    real = pos < length
    counted = real & (pos >= output_from)
    row = jnp.zeros((vocab,), jnp.int32).at[jnp.where(counted, ids, vocab)].add(2, mode="drop")
    return row.at[jnp.where(real, ids, vocab)].max(1, mode="drop")


def record(history: jax.Array, tokens: jax.Array, advance: jax.Array) -> jax.Array:
    """history [slots, vocab] with each of the first rows slots' sampled token counted once more
    (advance [rows] int32: 1 for an active slot). A scatter of `rows` elements, in place."""
    rows = tokens.shape[0]
    return history.at[jnp.arange(rows), tokens].add(2 * advance, mode="drop")


def apply(logits: jax.Array, history: jax.Array, p: SlotLogits, index: jax.Array) -> jax.Array:
    """Processed logits [n, vocab] float32 from logits [n, vocab], history [n, vocab] and each
    row's token index [n] (the index of the token being sampled). A row whose parameters are off
    comes out bit for bit as it went in (x / 1, x - 0, no scatter hits it)."""
    x = logits.astype(jnp.float32)
    n, vocab = x.shape
    seen = history > 0
    count = (history >> 1).astype(jnp.float32)
    rep = p.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - p.presence[:, None] * (count > 0) - p.frequency[:, None] * count
    r = jnp.arange(n)[:, None]
    x = x.at[r, p.bias_ids].add(p.bias, mode="drop")
    hold = (index < p.min_tokens)[:, None]
    return x.at[r, jnp.where(hold, p.stop_ids, vocab)].set(-jnp.inf, mode="drop")


def process(logits, history, p: SlotLogits, index, active) -> jax.Array:
    """`apply` over a decode batch, skipped (logits returned as they are) when no active slot
    has a penalty, a bias or a stop id still held back. history and p carry all slots; the first
    rows = len(logits) are read (sliced inside the branch, so the skip costs no copy)."""
    rows = logits.shape[0]
    p_rows = SlotLogits(*(a[:rows] for a in p))
    holding = (index < p_rows.min_tokens) & (p_rows.stop_ids[:, 0] < logits.shape[1])
    on = jnp.any(active & (p_rows.penalized | holding))
    return jax.lax.cond(on, lambda _: apply(logits, history[:rows], p_rows, index),
                        lambda _: logits.astype(jnp.float32), None)


def apply_mask(processed: jax.Array, masks: jax.Array) -> jax.Array:
    """Grammar-constrained logits: each row's disallowed tokens at -inf. masks int32 [n, ceil(vocab
    / 32)] (llguidance's packed bitmask: bit t % 32 of word t // 32 set = token t allowed; an
    all-ones row leaves its logits bit for bit as they were). Applied after processing, so
    sampling and logprobs both see the constrained distribution."""
    n, vocab = processed.shape
    bits = (masks[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [n, words, 32]
    allowed = bits.reshape(n, -1)[:, :vocab].astype(jnp.bool_)
    return jnp.where(allowed, processed, -jnp.inf)


def logprobs_of(processed: jax.Array) -> jax.Array:
    """log_softmax over the vocabulary, -inf (a masked token) clamped to LOGPROB_FLOOR."""
    return jnp.maximum(jax.nn.log_softmax(processed, axis=-1), LOGPROB_FLOOR)


def pack(logprobs: jax.Array, tokens: jax.Array) -> jax.Array:
    """int32 [n, PACKED_WIDTH]: token, its logprob, the top MAX_TOP_LOGPROBS ids and logprobs
    (best first; float32 as bits). A vocabulary smaller than that pads with id -1."""
    n, vocab = logprobs.shape
    k = min(MAX_TOP_LOGPROBS, vocab)
    top_lp, top_ids = jax.lax.top_k(logprobs, k)
    if k < MAX_TOP_LOGPROBS:
        top_lp = jnp.pad(top_lp, ((0, 0), (0, MAX_TOP_LOGPROBS - k)), constant_values=LOGPROB_FLOOR)
        top_ids = jnp.pad(top_ids, ((0, 0), (0, MAX_TOP_LOGPROBS - k)), constant_values=-1)
    tokens = tokens.astype(jnp.int32)
    tok_lp = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)
    bits = jax.lax.bitcast_convert_type
    return jnp.concatenate([tokens[:, None], bits(tok_lp, jnp.int32), top_ids.astype(jnp.int32),
                            bits(top_lp, jnp.int32)], axis=1)


# ---------------------------------------------------------------------------------------------
# host side: reading a packed array


def unpack_tokens(host_packed: np.ndarray) -> np.ndarray:
    """int32 tokens [n] of a packed [n, PACKED_WIDTH] host array."""
    return np.asarray(host_packed)[:, 0]


def unpack_logprobs(host_packed_row: np.ndarray, k: int) -> TokenLogprobs:
    """One packed row's token logprob and its top k (k <= MAX_TOP_LOGPROBS), best first."""
    row = np.ascontiguousarray(host_packed_row, dtype=np.int32)
    floats = row.view(np.float32)
    t = MAX_TOP_LOGPROBS
    k = max(0, min(int(k), t))
    ids, lps = row[2: 2 + k], floats[2 + t: 2 + t + k]
    return TokenLogprobs(float(floats[1]), tuple((int(i), float(lp)) for i, lp in zip(ids, lps) if i >= 0))
