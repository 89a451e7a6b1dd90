"""Token sampling, vectorised over slots so one compiled step serves a mixed batch, with no sort
of the vocabulary.

Every slot carries its own temperature (0 = greedy), top_k (0 = off), top_p (1.0 = off) and seed.
A row draws from softmax(logits / temperature), cut as it asks:
  - no cut (top_k 0, top_p 1): exactly that distribution over the whole vocabulary, by Gumbel-max
    (`categorical`, jax.random.categorical's draw, over the row's scaled logits; no sort, no top-k);
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


# Threefry-2x32 (20 rounds), the hash behind `jax.random`'s default keys, written out as plain
# elementwise ops that XLA fuses into one loop, where jax's own CPU lowering is a rolled `while` of
# five iterations with its carries between kernels: the same bits (jax's partitionable counters,
# its default since 0.5), fewer kernels to compile. A sampler hashes four times (two fold-ins for
# the keys, the noise of each draw), and every program the engine compiles holds one (each prefill
# bucket, each step variant, the ragged call): `sample` compiled in 0.69 s of CPU against 0.91 with
# jax.random (built-in vocabulary, medians of 12 alternated compiles). test_engine_sampling holds
# the draws to jax.random's bit for bit.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x: jax.Array, d: int) -> jax.Array:
    return jax.lax.shift_left(x, jnp.uint32(d)) | jax.lax.shift_right_logical(x, jnp.uint32(32 - d))


def threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 of the counter pairs (x1, x2) under key (k1, k2), all uint32, broadcast
    together: what jax's `threefry2x32_p` computes."""
    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ _rotl(x2, r)
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x1, x2


def token_keys(seeds: jax.Array, index: jax.Array) -> jax.Array:
    """uint32 [slots, 2]: each slot's key data, `jax.random.key_data` of
    `fold_in(fold_in(key(seed[0]), seed[1]), index)`, from seeds [slots, 2] uint32 and token
    indices [slots]. (key(s) is the pair (0, s); fold_in(k, d) hashes the counter pair (0, d).)"""
    seeds = seeds.astype(jnp.uint32)
    zero = jnp.zeros_like(seeds[:, 0])
    a, b = threefry2x32(zero, seeds[:, 0], zero, seeds[:, 1])
    a, b = threefry2x32(a, b, zero, index.astype(jnp.uint32))
    return jnp.stack([a, b], axis=-1)


def _key_words(keys: jax.Array) -> jax.Array:
    """uint32 [rows, 2] key data from `token_keys`' words or typed threefry keys."""
    if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(keys)
    return keys


def first_max(z: jax.Array) -> jax.Array:
    """int32 [rows]: `jnp.argmax(z, axis=-1)` (the first index of each row's largest value; of its
    first NaN if it has one), computed as a max and then a min over the indices holding it.
    XLA CPU lowers `jnp.argmax` to one variadic (value, index) reduction that does not vectorise,
    and the Gumbel noise fused into it was computed there element by element: a draw over 8 rows x
    151,936 logits took 32 ms, this way 5 (one thread)."""
    n = z.shape[-1]
    nan = jnp.isnan(z)
    top = jnp.max(z, axis=-1, keepdims=True)  # (XLA CPU's max need not propagate a NaN)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, z == top)
    return jnp.min(jnp.where(hit, jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1), n), axis=-1)


def categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """int32 [rows]: `jax.vmap(jax.random.categorical)(keys, logits)` for threefry keys (token_keys'
    words [rows, 2]) and logits [rows, n] float32, the same draw: the argmax of the logits plus
    Gumbel noise -log(-log(u)), u uniform in [tiny, 1) from the 32 bits of counter j (jax's
    `random_bits`: the two words of its hash xor'ed; `uniform`: 23 of them as the mantissa)."""
    rows, n = logits.shape
    words = _key_words(keys)
    count = jax.lax.broadcasted_iota(jnp.uint32, (rows, n), 1)
    b1, b2 = threefry2x32(words[:, 0:1], words[:, 1:2], jnp.zeros_like(count), count)
    mantissa = jax.lax.shift_right_logical(b1 ^ b2, jnp.uint32(9)) | jnp.uint32(0x3F800000)
    floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0)
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    u = jax.lax.max(tiny, floats * (jnp.float32(1.0) - tiny) + tiny)
    return first_max(-jnp.log(-jnp.log(u)) + logits)


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
    [slots]; keys `token_keys`' words [slots, 2] (or typed threefry keys [slots]), or a function
    returning them (called only inside the branch that samples, so an all-greedy step derives no
    keys). temperature == 0 -> argmax (top_k/top_p ignored). `shards`: how many chips the vocabulary axis of `logits` is split over
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
            return categorical(row_keys, scaled)

        def within(_):  # over the kept candidates
            ids, filtered = filter_candidates(scaled, top_k, top_p, shards)
            pick = categorical(row_keys, filtered)
            return jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]

        plain = jax.lax.cond(jnp.any(on & ~cut), whole, lambda _: greedy, None)
        filtered = jax.lax.cond(jnp.any(cut), within, lambda _: greedy, None)
        return jnp.where(cut, filtered, jnp.where(on, plain, greedy))

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)
