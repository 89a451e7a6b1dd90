"""Sampling: greedy, top-k and top-p masks hold over many draws, seeds give reproducible streams,
and temperature sampling follows softmax(logits / T)."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem_core.errors import InvalidRequest
from tandem_core.types import SamplingParams
from tandem_engine.sampling import (MAX_TOP_K, distribution, filter_candidates, sample, sampling_arrays, seed_words,
                                   token_keys)

LOGITS = np.array([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, 3.0, 0.9, -2.0], np.float32)
N = 20000


@partial(jax.jit, static_argnames=("n",))
def draw(logits, temperature, top_k, top_p, seed, n):
    """n draws for one logits vector: n slots with the same params, token indices 0..n-1."""
    seeds = jnp.broadcast_to(seed, (n, 2))
    keys = token_keys(seeds, jnp.arange(n))
    full = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
    return sample(jnp.broadcast_to(logits, (n, logits.shape[0])), full(temperature, jnp.float32),
                  full(top_k, jnp.int32), full(top_p, jnp.float32), keys)


def draws(temperature=1.0, top_k=0, top_p=1.0, seed=0) -> np.ndarray:
    s = np.asarray(seed_words(seed), np.uint32)
    return np.asarray(draw(LOGITS, temperature, top_k, top_p, s, N))


def test_greedy_and_top_k_one_are_argmax():
    assert set(draws(temperature=0.0)) == {7}
    assert set(draws(temperature=2.0, top_k=1)) == {7}


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_stays_in_top_k(k):
    top = set(np.argsort(-LOGITS)[:k].tolist())
    got = set(draws(temperature=1.0, top_k=k).tolist())
    assert got == top  # never outside, and with 20000 draws every member shows up


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p_stays_in_nucleus(p):
    probs = np.exp(LOGITS - LOGITS.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[before < p].tolist())
    got = set(draws(temperature=1.0, top_p=p).tolist())
    assert got <= nucleus and len(got) == len(nucleus)


def test_top_k_and_top_p_combine():
    got = set(draws(temperature=1.0, top_k=4, top_p=0.5).tolist())
    assert got <= set(np.argsort(-LOGITS)[:4].tolist())


def test_seeds_reproduce_and_differ():
    a, b, c = draws(seed=1), draws(seed=1), draws(seed=2)
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.3
    big = draws(seed=2**63 + 5)  # 64-bit seeds use both words
    assert (big != draws(seed=5)).mean() > 0.3


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_temperature_matches_softmax(temperature):
    want = np.exp(LOGITS / temperature - (LOGITS / temperature).max())
    want /= want.sum()
    got = np.bincount(draws(temperature=temperature, seed=3), minlength=len(LOGITS)) / N
    assert 0.5 * np.abs(got - want).sum() < 0.02  # total variation


def test_unseeded_requests_get_distinct_seeds():
    assert seed_words(None) != seed_words(None)


def test_bad_params_rejected():
    for bad in (SamplingParams(temperature=-1.0), SamplingParams(top_k=-2),
                SamplingParams(top_p=0.0), SamplingParams(top_p=1.5)):
        with pytest.raises(InvalidRequest):
            sampling_arrays(bad)


# ---------------------------------------------------------------------------------------------
# the sampler against the sort-based one it replaced (kept here as the reference, in float64)

def sorted_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The exact distribution [vocab] the sort-based sampler drew from: rank every token, keep
    ranks < top_k, then the smallest prefix whose mass (after top-k) reaches top_p."""
    scaled = logits.astype(np.float64) / max(temperature, 1e-6)
    order = np.argsort(-scaled, kind="stable")
    s = scaled[order]
    rank = np.arange(s.size)
    keep = rank < (min(top_k, s.size) if top_k > 0 else s.size)
    probs = np.where(keep, np.exp(s - s.max()), 0.0)
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep &= (before < top_p) | (rank == 0)
    out = np.zeros(s.size)
    out[order] = np.where(keep, probs, 0.0) / probs[keep].sum()
    return out


def boundary_margin(logits, temperature, top_k, top_p) -> float:
    """How far the nucleus's cut is from top_p (a case too close to it could flip in float32)."""
    scaled = np.sort(logits.astype(np.float64) / temperature)[::-1]
    k = top_k if top_k > 0 else scaled.size
    p = np.exp(scaled[:k] - scaled[0])
    p /= p.sum()
    return float(np.min(np.abs(np.cumsum(p) - p - top_p)))


WIDE = np.random.default_rng(7).normal(0.0, 2.0, 1000).astype(np.float32)  # a 1000-token vocabulary


def draws_of(logits, temperature, top_k, top_p, n, seed=11, chunk=20000) -> np.ndarray:
    s = np.asarray(seed_words(seed), np.uint32)
    out = []
    for start in range(0, n, chunk):
        out.append(np.asarray(draw_from(jnp.asarray(logits), temperature, top_k, top_p, s, start, chunk)))
    return np.concatenate(out)[:n]


@partial(jax.jit, static_argnames=("n",))
def draw_from(logits, temperature, top_k, top_p, seed, start, n):
    keys = token_keys(jnp.broadcast_to(seed, (n, 2)), start + jnp.arange(n))
    full = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
    return sample(jnp.broadcast_to(logits, (n, logits.shape[0])), full(temperature, jnp.float32),
                  full(top_k, jnp.int32), full(top_p, jnp.float32), keys)


@pytest.mark.slow  # make test-unit leaves it out: 200,000 draws over 1,000 tokens, five times
@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0),  # plain: Gumbel-max over the whole vocabulary
    (0.7, 40, 1.0),  # top-k
    (1.0, 0, 0.8),  # top-p alone (a nucleus of 158 tokens, under MAX_TOP_K)
    (1.3, 100, 0.8),  # both
    (0.5, 0, 0.97),
])
def test_distribution_matches_the_sort_based_sampler(temperature, top_k, top_p):
    """200,000 seeded draws: never outside the reference's support, and a chi-square over the
    reference's probabilities (bins expected under 5 draws pooled) within 6 sd of its mean."""
    n = 200_000
    want = sorted_reference(WIDE, temperature, top_k, top_p)
    assert top_p == 1.0 or boundary_margin(WIDE, temperature, top_k, top_p) > 1e-4
    assert np.count_nonzero(want) <= MAX_TOP_K or (top_k == 0 and top_p == 1.0)
    got = np.bincount(draws_of(WIDE, temperature, top_k, top_p, n), minlength=WIDE.size)
    assert not got[want == 0].any()  # the kept set: nothing outside it is ever drawn
    expected = want * n
    big = expected >= 5
    obs = np.append(got[big], got[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = obs.size - 1
    assert chi2 < df + 6 * np.sqrt(2 * df), (chi2, df)


def test_kept_set_is_exactly_the_sort_based_one():
    """Many rows with mixed top-k / top-p in one batch: the candidates left finite are exactly the
    reference's support, row by row (its MAX_TOP_K best where a top-p nucleus is larger), and
    their values are the scaled logits; a split vocabulary
    (shards 2, 4, 8: per-shard top-k then a merge) gives the same ids and values."""
    rng = np.random.default_rng(3)
    rows = [(t, k, p) for t in (0.6, 1.0, 1.7) for k in (0, 1, 7, 64, 300) for p in (1.0, 0.95, 0.5, 0.2)
            if k or p < 1.0]  # a row with no cut draws from the whole vocabulary, not from these
    logits = rng.normal(0.0, 2.5, (len(rows), 1024)).astype(np.float32)
    t = jnp.asarray([r[0] for r in rows], jnp.float32)
    scaled = jnp.asarray(logits) / t[:, None]
    top_k = jnp.asarray([r[1] for r in rows], jnp.int32)
    top_p = jnp.asarray([r[2] for r in rows], jnp.float32)
    ids, kept = map(np.asarray, filter_candidates(scaled, top_k, top_p))
    for i, (temp, k, p) in enumerate(rows):
        want = sorted_reference(logits[i], temp, min(k, MAX_TOP_K), p)
        if p < 1.0 and boundary_margin(logits[i], temp, min(k, MAX_TOP_K), p) < 1e-4:
            continue  # a cut within float32 rounding of top_p
        finite = np.isfinite(kept[i])
        nucleus = np.flatnonzero(want)
        if nucleus.size > MAX_TOP_K:  # past the bound: the MAX_TOP_K best of the nucleus
            nucleus = np.argsort(-logits[i], kind="stable")[:MAX_TOP_K]
        assert set(ids[i][finite].tolist()) == set(nucleus.tolist()), (temp, k, p)
        np.testing.assert_array_equal(kept[i][finite], np.asarray(scaled)[i][ids[i][finite]])
    for shards in (2, 4, 8):
        ids_s, kept_s = map(np.asarray, filter_candidates(scaled, top_k, top_p, shards))
        np.testing.assert_array_equal(ids_s, ids)
        np.testing.assert_array_equal(kept_s, kept)


def test_top_p_past_the_bound_keeps_the_max_top_k_best():
    """A flat row whose 0.9 nucleus needs ~900 tokens: the MAX_TOP_K best are kept, no others."""
    flat = np.random.default_rng(5).uniform(0.0, 0.01, 1000).astype(np.float32)
    got = set(draws_of(flat, 1.0, 0, 0.9, 60_000).tolist())
    best = set(np.argsort(-flat)[:MAX_TOP_K].tolist())
    assert got <= best and len(got) > 0.95 * MAX_TOP_K


def test_top_k_above_the_bound_is_clamped():
    assert sampling_arrays(SamplingParams(top_k=5000))["top_k"] == MAX_TOP_K
    assert sampling_arrays(SamplingParams(top_k=40))["top_k"] == 40
    # on the device too: the same draws as top_k = MAX_TOP_K, and only from the MAX_TOP_K best
    big, at_max = draws_of(WIDE, 1.5, 5000, 1.0, 20_000), draws_of(WIDE, 1.5, MAX_TOP_K, 1.0, 20_000)
    np.testing.assert_array_equal(big, at_max)
    assert set(big.tolist()) <= set(np.argsort(-WIDE)[:MAX_TOP_K].tolist())


def test_a_rows_draw_does_not_depend_on_its_batch():
    """Each row alone and in a batch whose other rows take the other paths (greedy, plain,
    top-k, top-p): the same token, seed for seed."""
    rng = np.random.default_rng(9)
    logits = rng.normal(0.0, 1.0, (4, 1000)).astype(np.float32)
    params = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 20, 1.0), (1.2, 0, 0.7)]
    seeds = np.asarray([seed_words(100 + i) for i in range(4)], np.uint32)
    index = jnp.asarray([3, 5, 8, 13])

    def run(i):
        t, k, p = (jnp.asarray([params[j][c] for j in i], dt) for c, dt in
                   ((0, jnp.float32), (1, jnp.int32), (2, jnp.float32)))
        return np.asarray(jax.jit(sample)(jnp.asarray(logits[i]), t, k, p,
                                          token_keys(jnp.asarray(seeds[i]), index[jnp.asarray(i)])))

    together = run([0, 1, 2, 3])
    for trial in range(3):  # a few token indices, so a coincidence cannot pass it
        index = index + 1
        together = run([0, 1, 2, 3])
        alone = np.concatenate([run([i]) for i in range(4)])
        np.testing.assert_array_equal(together, alone)
    assert together[0] == logits[0].argmax()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.6), (0.0, 4, 1.0)])
def test_distribution_is_what_sample_draws_from(temperature, top_k, top_p):
    """`distribution` (a sampling proposer's q for speculative decoding) is the distribution
    `sample` draws from: dense, zero outside top-k and the nucleus, one-hot for greedy; the
    frequencies of N draws match it (a chi-square test), rows with other parameters beside it
    in one batch do not change it."""
    from scipy.stats import chisquare

    rows = jnp.stack([jnp.asarray(LOGITS), jnp.asarray(LOGITS[::-1])])
    q = np.asarray(distribution(rows, jnp.array([temperature, 0.9]), jnp.array([top_k, 0], jnp.int32),
                                jnp.array([top_p, 1.0], jnp.float32)))[0]
    assert q.shape == (LOGITS.size,) and abs(q.sum() - 1) < 1e-5
    if temperature == 0:
        assert q.tolist() == np.eye(LOGITS.size)[int(np.argmax(LOGITS))].tolist()
        return
    counts = np.bincount(np.asarray(draw(jnp.asarray(LOGITS), temperature, top_k, top_p,
                                         jnp.array([3, 1], jnp.uint32), N)), minlength=LOGITS.size)
    assert np.all(counts[q == 0] == 0)
    keep = q > 0
    expected = q[keep].astype(np.float64) / q[keep].astype(np.float64).sum() * counts.sum()
    assert chisquare(counts[keep], expected).pvalue > 1e-3, (counts, (q * N).round())
