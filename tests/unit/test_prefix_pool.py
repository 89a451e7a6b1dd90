"""The prefill side's prefix cache on the device (tandem_engine/prefix_pool.py): a hit is read in
place from the pool's blocks (nothing copied: `hit_copy_bytes` stays 0), the prompt's first token
and KV are the whole prompt's, its new full blocks join the cache without a copy, a prompt that
misses is written in once, and no block is left pinned on any path (a full pool, a bad request).

The built-in model (its attention tells positions apart), blocks of 16, chunks of 32 tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.errors import InvalidRequest
from tandem_core.types import SamplingParams
from tandem_engine import load_engine
from tandem_engine.prefix_pool import DevicePrefixCache, device_cache_for

GREEDY = SamplingParams()
BLOCK = 16


@pytest.fixture(scope="module")
def engine():
    return load_engine("builtin", slots=2, max_len=256, prefill_buckets=(32, 64, 128, 256), prefix_chunk=32)


def _cache(engine, blocks: int) -> DevicePrefixCache:
    c = device_cache_for(engine, BLOCK, 1)
    return device_cache_for(engine, BLOCK, blocks * c.block_bytes)


def _free(cache: DevicePrefixCache) -> int:
    return cache._alloc.free_count() + cache._alloc.cached_only


def _greedy(engine, prefix, steps: int) -> list[int]:
    state = engine.insert(prefix, engine.init_state(), 0, GREEDY)
    out = [prefix.first_token]
    for _ in range(steps):
        state, toks = engine.generate(state, 1)
        out.append(int(np.asarray(toks)[0]))
    engine.free(state, 0)
    return out


def test_a_hit_reads_the_pool_in_place_and_gives_the_whole_prompts_tokens(engine):
    cache = _cache(engine, 40)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 512, 100).tolist()
    assert cache.lookup(a) is None
    whole_a = engine.prefill(a, GREEDY)
    # the prefill's KV where it lies, as a prefill pod inserts it (a host copy: the test below)
    assert cache.insert(a, lambda: (whole_a.k, whole_a.v)) == 6  # 96 positions
    assert cache.insert_copy_bytes == 6 * cache.block_bytes

    b = a[:96] + rng.integers(0, 512, 40).tolist()  # 136 tokens: 96 cached
    hit = cache.lookup(b)
    assert hit is not None and hit.length == 96
    got = engine.prefill(b, GREEDY, cached=hit)
    want = engine.prefill(b, GREEDY)
    assert cache.stats.hit_copy_bytes == 0 and cache.insert_copy_bytes == 6 * cache.block_bytes
    assert got.first_token == want.first_token
    assert got.k.shape == want.k.shape
    np.testing.assert_allclose(np.asarray(got.k)[:, :136], np.asarray(want.k)[:, :136], atol=2e-4)
    np.testing.assert_allclose(np.asarray(got.v)[:, :136], np.asarray(want.v)[:, :136], atol=2e-4)
    assert _greedy(engine, got, 12) == _greedy(engine, want, 12)
    # its new full blocks (96..128) joined the cache as they were: inserting copies nothing
    assert len(cache) == 8
    assert cache.insert(b, lambda: pytest.fail("the blocks are in the pool already")) == 0
    assert _free(cache) == 40  # no pin left


def test_a_full_pool_runs_the_prompt_whole_and_a_bad_request_lets_its_hit_go(engine):
    cache = _cache(engine, 7)
    rng = np.random.default_rng(1)
    a = rng.integers(0, 512, 100).tolist()
    whole_a = engine.prefill(a, GREEDY)
    cache.insert(a, lambda: (np.asarray(whole_a.k), np.asarray(whole_a.v)))
    assert len(cache) == 6
    # 96 cached + 104 more positions need 7 blocks; 1 is free and the 6 are the hit's own
    b = a[:96] + rng.integers(0, 512, 104).tolist()
    hit = cache.lookup(b)
    got = engine.prefill(b, GREEDY, cached=hit)
    assert got.first_token == engine.prefill(b, GREEDY).first_token
    assert _free(cache) == 7
    hit = cache.lookup(a)
    with pytest.raises(InvalidRequest):
        engine.prefill(a[:-1] + [10 ** 6], GREEDY, cached=hit)  # a token outside the vocabulary
    assert _free(cache) == 7 and hit.match.done


def test_a_hit_computes_only_the_rest_over_the_pools_prefix(engine):
    """The cached positions are read from the pool, never computed: a pool holding a made-up KV
    for the prefix hands that KV back for those positions, untouched, and the rest (attending to
    it, as the chunk attention reads the prefix through the row's table) comes out unlike the
    whole prompt's, while a hit over the true KV gives the whole prompt's; seeded sampling and
    the first token's logprobs too."""
    cache = _cache(engine, 40)
    rng = np.random.default_rng(2)
    a = rng.integers(0, 512, 70).tolist()
    whole_a = engine.prefill(a, GREEDY)
    shape = np.asarray(whole_a.k).shape
    fake = np.full(shape, 0.5, np.float32)
    assert cache.insert(a, lambda: (fake, -fake)) == 4  # 64 positions of made-up KV
    b = a[:64] + rng.integers(0, 512, 75).tolist()  # 139 tokens: 64 cached, 75 computed in 3 chunks
    seeded = SamplingParams(temperature=1.0, seed=11, logprobs=3)
    picks = [SamplingParams(logprobs=3), seeded]
    want = engine.prefill(b, GREEDY, choices=picks)
    got = engine.prefill(b, GREEDY, choices=picks, cached=cache.lookup(b))
    k, wk = np.asarray(got.k), np.asarray(want.k)
    np.testing.assert_array_equal(k[:, :64], 0.5)  # the pool's, as they were: not recomputed
    np.testing.assert_array_equal(np.asarray(got.v)[:, :64], -0.5)
    assert np.abs(k[1:, 64:139] - wk[1:, 64:139]).max() > 1e-2  # layer 2 on: the rest attended to the made-up prefix
    np.testing.assert_allclose(k[0, 64:139], wk[0, 64:139], atol=1e-5)  # layer 1's K: the tokens' own

    cache = _cache(engine, 40)
    assert cache.insert(a, lambda: (np.asarray(whole_a.k), np.asarray(whole_a.v))) == 4
    got = engine.prefill(b, GREEDY, choices=picks, cached=cache.lookup(b))
    assert got.first_tokens == want.first_tokens
    for g, w in zip(got.first_logprobs, want.first_logprobs):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
    np.testing.assert_allclose(np.asarray(got.k)[:, :139], wk[:, :139], atol=2e-4)
    np.testing.assert_allclose(np.asarray(got.v)[:, :139], np.asarray(want.v)[:, :139], atol=2e-4)
    assert _free(cache) == 40


def test_the_warm_up_compiles_the_insert_a_miss_runs(engine):
    """After the cache's warm-up (the prefill's buckets compiled first, as a prefill pod does), a
    prompt that misses inserts its own KV from the device without compiling the write again (the
    warm-up once wrote KV it made itself: an uncommitted array, another jit argument than a
    prefill's committed one, so each bucket's first real miss compiled)."""
    from tandem_engine import prefix_pool

    engine.warmup_prefill()
    cache = _cache(engine, 40)
    cache.warmup()
    compiled = prefix_pool._write_core._cache_size()
    rng = np.random.default_rng(3)
    for n in (40, 100, 200):  # the 64, 128 and 256 buckets
        ids = rng.integers(0, 512, n).tolist()
        whole = engine.prefill(ids, GREEDY)
        assert cache.insert(ids, lambda whole=whole: (whole.k, whole.v)) == n // 16
    assert prefix_pool._write_core._cache_size() == compiled
