"""Token sampling, vectorised over slots so one compiled step serves a mixed batch, with no sort
of the vocabulary.

Every slot carries its own temperature (0 = greedy), top_k (0 = off), top_p (1.0 = off) and seed.
A row draws from softmax(logits / temperature), cut as it asks:
  - no cut (top_k 0, top_p 1): exactly that distribution over the whole vocabulary, by Gumbel-max
    (`jax.random.categorical` over the row's scaled logits; no sort, no top-k);
  - top-k and/or top-p: from the row's MAX_TOP_K best tokens (`lax.top_k`, a selection, not a
    sort), top-k first, then the top-p nucleus of what top-k kept (`filter_candidates`). Within
    the bound this is exactly the sort-based sampler's distribution. Past it:
      * top_k > MAX_TOP_K is clamped to MAX_TOP_K (`sampling_arrays`; on the device too): the row
        samples from its MAX_TOP_K best tokens, renormalised;
      * top-p without top-k whose nucleus needs more than MAX_TOP_K tokens keeps the MAX_TOP_K
        best: the draw is renormalised over them; the tokens missed are the nucleus's tail, each
        less likely than every one kept.
    Sampling at any temperature with top_k = 1 is greedy.
The randomness of token index n of a request is `fold_in(key(seed), n)`, so a seeded request draws
the same tokens whichever pod, slot or batch it runs in (the prefill pod draws index 0, the decode
pod indices 1, 2, ...; a resumed request continues at its start_index, so with its seed it draws
what the unbroken run would have).
Requests without a seed get one from a per-process counter. Sampling draws from the processed
logits (logits.py: penalties, logit_bias, min_tokens come first).
"""
from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

from tandem_core.errors import InvalidRequest
from tandem_core.types import SamplingParams

# Unseeded requests: a counter starting at a random per-process base, so two pods (or two runs)
# do not replay each other's streams while one process never repeats a seed.
_seed_counter = itertools.count(int.from_bytes(os.urandom(6), "little"))


# The most candidates a filtered row keeps (the module docstring says what happens past it).
# 256: the largest power of two for which the TPU compiler's `lax.top_k` over a 128k vocabulary
# stays a selection that reads the logits once (libtpu 0.0.42, v5e, 64 rows: ~33 MB accessed for
# k <= 320; k = 512 and 1,024 compile to a sort, 300-630 MB).
MAX_TOP_K = 256


def seed_words(seed: int | None) -> tuple[int, int]:
    """A request seed (any int, or None) as two uint32 words."""
    if seed is None:
        seed = next(_seed_counter)
    seed = int(seed) % (1 << 64)
    return seed & 0xFFFFFFFF, seed >> 32


def sampling_arrays(params: SamplingParams) -> dict[str, np.ndarray]:
    """Host scalars for one request: temperature, top_k, top_p, seed [2] (uint32 words).
    A top_k above MAX_TOP_K is clamped to it (the row samples from its MAX_TOP_K best tokens)."""
    if params.temperature < 0 or params.top_k < 0 or not 0.0 < params.top_p <= 1.0:
        raise InvalidRequest(
            f"bad sampling params {params}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1",
            param="sampling",
        )
    return {
        "temperature": np.float32(params.temperature),
        "top_k": np.int32(min(params.top_k, MAX_TOP_K)),
        "top_p": np.float32(params.top_p),
        "seed": np.asarray(seed_words(params.seed), np.uint32),
    }


def token_keys(seeds: jax.Array, index: jax.Array) -> jax.Array:
    """Typed PRNG keys [slots] from seeds [slots, 2] uint32 and token indices [slots]."""

    def one(seed, i):
        key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(key, i)

    return jax.vmap(one)(seeds, index.astype(jnp.uint32))


def candidates(scaled: jax.Array, shards: int = 1) -> tuple[jax.Array, jax.Array]:
    """(values, ids) [rows, C], C = min(MAX_TOP_K, vocab): each row's C largest logits best first
    and their token ids (int32; equal values: the lower id first, as `lax.top_k` ranks them).

    `shards` > 1 (the vocabulary split over that many chips, sharding.py): each shard's own
    top C, then one top C over the shards' candidates, so only rows x shards x C values cross
    chips, never the logits. The result is the same as with shards == 1: every one of the row's
    C best sits in its shard's C best, and the merge ranks equal values by shard, then by rank
    within the shard, i.e. by id."""
    rows, vocab = scaled.shape
    c = min(MAX_TOP_K, vocab)
    if shards <= 1 or vocab % shards:
        return jax.lax.top_k(scaled, c)
    local = vocab // shards
    per = min(c, local)
    v, i = jax.lax.top_k(scaled.reshape(rows, shards, local), per)  # per shard, on its own chip
    i = i + (jnp.arange(shards, dtype=jnp.int32) * local)[None, :, None]
    v, at = jax.lax.top_k(v.reshape(rows, shards * per), c)
    return v, jnp.take_along_axis(i.reshape(rows, shards * per), at, axis=-1)


def filter_candidates(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array,
                      shards: int = 1) -> tuple[jax.Array, jax.Array]:
    """(ids, filtered) [rows, C]: `candidates` of the scaled logits, with the candidates outside
    top-k and the top-p nucleus at -inf.

    top-k keeps ranks < min(top_k, C) (top_k == 0: all C). top-p then keeps the smallest prefix
    of those whose mass reaches top_p (the best token always survives), the mass of a token
    being its probability after top-k: renormalised over the top k when top_k > 0 (top-k first,
    then top-p, as vLLM and HF order them), over the whole vocabulary when top_k == 0 (so a
    nucleus of at most C tokens is exactly the sort-based one). A nucleus that needs more than
    C tokens is cut at C."""
    values, ids = candidates(scaled, shards)
    c = values.shape[-1]
    rank = jnp.arange(c)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, c), c)[:, None]
    in_k = rank < k
    over_k = jax.nn.logsumexp(jnp.where(in_k, values, -jnp.inf), axis=-1)
    norm = jnp.where(top_k > 0, over_k, jax.nn.logsumexp(scaled, axis=-1))
    probs = jnp.where(in_k, jnp.exp(values - norm[:, None]), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive cumulative mass
    keep = in_k & ((mass_before < top_p[:, None]) | (rank == 0))
    return ids, jnp.where(keep, values, -jnp.inf)


def greedy_tokens(logits) -> jax.Array:
    """int32 [slots]: each row's first index of its largest logit, what `jnp.argmax` gives
    (rows with a NaN aside), computed as a max and then a min over the indices holding it.

    Why not `jnp.argmax`: XLA CPU lowers it to one variadic (value, index) reduction that does
    not vectorise: 325 vs 44 µs of CPU at 32 rows x 2,048 logits on one XLA thread (measured
    apart; in a profile of the built-in model's step it was 0.3 of ~4 ms at 32 rows)."""
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    at = jnp.min(jnp.where(logits == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(at, vocab - 1)  # an all-NaN row has no maximum: the last id, not out of range


def sample(logits, temperature, top_k, top_p, keys, shards: int = 1):
    """Tokens int32 [slots]. logits [slots, vocab]; temperature, top_p float32 [slots]; top_k int32
    [slots]; keys typed PRNG keys [slots], or a function returning them (called only inside the
    branch that samples, so an all-greedy step derives no keys). temperature == 0 -> argmax
    (top_k/top_p ignored). `shards`: how many chips the vocabulary axis of `logits` is split over
    (`candidates`); the tokens do not depend on it.

    An all-greedy batch skips sampling entirely (`lax.cond`), and within a sampled batch the
    full-vocabulary draw and the candidates' top-k each run only when some row needs them. A
    row's draw depends only on its own logits, parameters and key, whatever else is in the batch.
    """
    greedy = greedy_tokens(logits)

    def sampled(_):
        row_keys = keys() if callable(keys) else keys
        scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
        on = temperature > 0
        cut = on & ((top_k > 0) | (top_p < 1.0))

        def whole(_):  # Gumbel-max over the whole vocabulary
            return jax.vmap(jax.random.categorical)(row_keys, scaled).astype(jnp.int32)

        def within(_):  # over the kept candidates
            ids, filtered = filter_candidates(scaled, top_k, top_p, shards)
            pick = jax.vmap(jax.random.categorical)(row_keys, filtered)
            return jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]

        plain = jax.lax.cond(jnp.any(on & ~cut), whole, lambda _: greedy, None)
        filtered = jax.lax.cond(jnp.any(cut), within, lambda _: greedy, None)
        return jnp.where(cut, filtered, jnp.where(on, plain, greedy))

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)


def distribution(logits, temperature, top_k, top_p, shards: int = 1) -> jax.Array:
    """float32 [rows, vocab]: the distribution `sample` draws each row's token from, dense. A
    greedy row (temperature 0): one-hot at its argmax; top-k / top-p: softmax over the kept
    candidates (`filter_candidates`), zero elsewhere; neither: softmax over the whole vocabulary.
    What a sampling proposer passes on as q (speculative decoding's acceptance min(1, p / q) and
    residual max(0, p - q) need the proposal's distribution exactly)."""
    rows, vocab = logits.shape
    onehot = jax.nn.one_hot(greedy_tokens(logits), vocab, dtype=jnp.float32)
    on = temperature > 0
    cut = on & ((top_k > 0) | (top_p < 1.0))

    def sampled(_):  # (an all-greedy batch skips the softmax and the candidates, as `sample` does)
        scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]

        def within(_):
            ids, filtered = filter_candidates(scaled, top_k, top_p, shards)
            kept = jax.nn.softmax(filtered, axis=-1)
            return jnp.zeros((rows, vocab), jnp.float32).at[jnp.arange(rows)[:, None], ids].add(kept)

        whole = jax.nn.softmax(scaled, axis=-1)
        filtered = jax.lax.cond(jnp.any(cut), within, lambda _: whole, None)
        return jnp.where(cut[:, None], filtered, jnp.where(on[:, None], whole, onehot))

    return jax.lax.cond(jnp.any(on), sampled, lambda _: onehot, None)
