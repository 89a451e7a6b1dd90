"""Prefix cache: greedy output with the cache is the output without it (a prompt ending mid-block,
one filling its blocks exactly, after eviction, with penalties that read the whole prompt), the
bytes stay under the budget, and eviction trims chains from the end."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.prefix import block_hashes, cache_salt
from tandem_core.types import SamplingParams
from tandem_engine import load_engine
from tandem_engine.prefix_cache import PrefixCache, cache_for
from tandem_engine.prefix_cache import prefill as cached_prefill

GREEDY = SamplingParams()
BLOCK = 16


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=2, max_len=128, prefill_buckets=(16, 32, 64), prefix_chunk=16)


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 256, size=n).tolist()


def greedy_run(engine, prefix, steps: int = 6) -> list[int]:
    state = engine.insert(prefix, engine.init_state(), 0, GREEDY)
    out = [prefix.first_token]
    for _ in range(steps):
        state, tokens = engine.generate(state, 2)
        out.append(int(np.asarray(tokens)[0]))
    return out


def block_bytes(engine) -> int:
    c = engine.cfg
    return 2 * c.num_layers * BLOCK * c.num_kv_heads * c.head_dim * 4


@pytest.mark.parametrize("tail", [7, 16, 33])  # ends mid-block, fills its blocks exactly, spans chunks
def test_greedy_output_is_the_same_with_the_cache(engine, tail):
    shared = ids(24, seed=1)  # one full block and a half: the second prompt hits the first block only
    cache = cache_for(engine, BLOCK, 1 << 24)
    first, _ = cached_prefill(engine, cache, shared + ids(5, seed=2), GREEDY)
    assert cache.stats.hits == 0 and len(cache) == 1
    prompt = shared + ids(tail, seed=3)
    want = greedy_run(engine, engine.prefill(prompt, GREEDY))
    prefix, payload = cached_prefill(engine, cache, prompt, GREEDY, export=True)
    assert cache.stats.hits == BLOCK
    assert greedy_run(engine, prefix) == want
    ref = engine.export_prefix(engine.prefill(prompt, GREEDY))
    assert payload.k.shape == ref.k.shape and payload.true_length == len(prompt)
    np.testing.assert_allclose(payload.k[:, :len(prompt)], ref.k[:, :len(prompt)], atol=1e-4)
    np.testing.assert_allclose(payload.v[:, :len(prompt)], ref.v[:, :len(prompt)], atol=1e-4)


def test_a_fully_cached_prompt_still_computes_its_last_block(engine):
    cache = cache_for(engine, BLOCK, 1 << 24)
    prompt = ids(2 * BLOCK, seed=4)
    want = cached_prefill(engine, cache, prompt, GREEDY)[0].first_token
    assert len(cache) == 2
    again, _ = cached_prefill(engine, cache, prompt, GREEDY)
    assert cache.stats.hits == BLOCK  # the last block is computed: its last row gives the first token
    assert again.first_token == want
    assert cache.stats.computed == 2 * BLOCK + BLOCK


def test_penalties_see_the_cached_part_of_the_prompt(engine):
    shared = ids(BLOCK, seed=5)
    prompt = shared + ids(9, seed=6)
    sp = SamplingParams(repetition_penalty=1.8, presence_penalty=0.5)
    cache = cache_for(engine, BLOCK, 1 << 24)
    cached_prefill(engine, cache, shared + ids(3, seed=7), sp)
    got, _ = cached_prefill(engine, cache, prompt, sp)
    assert cache.stats.hits == BLOCK
    want = engine.prefill(prompt, sp)
    assert got.first_token == want.first_token


def test_bytes_stay_under_budget_and_output_survives_eviction(engine):
    budget = 5 * block_bytes(engine)
    cache = cache_for(engine, BLOCK, budget)
    prompts = [ids(40, seed=100 + i) for i in range(12)]  # a burst of distinct prompts, 2 blocks each
    for p in prompts:
        cached_prefill(engine, cache, p, GREEDY)
        assert cache.bytes <= budget
    assert cache.stats.evicted > 0 and len(cache) == 5
    first = prompts[0]  # evicted long ago: a miss, the same tokens
    before = cache.stats.hits
    got, _ = cached_prefill(engine, cache, first, GREEDY)
    assert cache.stats.hits == before
    assert greedy_run(engine, got) == greedy_run(engine, engine.prefill(first, GREEDY))


def test_eviction_trims_chains_from_the_end():
    kv = np.zeros((1, 64, 1, 2), np.float32)  # 2 x 16 x 2 x 4 = 256 bytes a block
    cache = PrefixCache(BLOCK, budget_bytes=3 * 256)
    a, b = ids(48, seed=8), ids(48, seed=9)
    cache.insert(a, lambda: (kv, kv))  # 3 blocks: full
    cache.insert(b[:16] + [0], lambda: (kv, kv))  # one more: a's last block goes, not its first
    hit = cache.lookup(a)
    assert hit is not None and hit.blocks == 2 and hit.length == 32


def test_disabled_cache_counts_computed_tokens_only(engine):
    cache = PrefixCache(BLOCK, 1 << 20, enabled=False)
    prompt = ids(40, seed=10)
    cached_prefill(engine, cache, prompt, GREEDY)
    cached_prefill(engine, cache, prompt, GREEDY)
    s = cache.summary()
    assert (s["enabled"], s["queries"], s["hits"], s["computed"], s["blocks"]) == (False, 0, 0, 80, 0)


def test_hash_chain_keys_the_whole_prefix_and_the_salt():
    a = ids(40, seed=11)
    b = a[:16] + ids(24, seed=12)
    ka, kb = block_hashes(a, BLOCK), block_hashes(b, BLOCK)
    assert len(ka) == 2 and ka[0] == kb[0] and ka[1] != kb[1]
    assert block_hashes(a, BLOCK, cache_salt("m", "float32"))[0] != block_hashes(a, BLOCK, cache_salt("m", "bfloat16"))[0]
    assert block_hashes(a, BLOCK, limit=1) == ka[:1]
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(a, 0)


def test_bad_cached_kv_is_refused(engine):
    c = engine.cfg

    class Wrong:
        length = 16
        k = v = np.zeros((c.num_layers, 8, c.num_kv_heads, c.head_dim), np.float32)

    with pytest.raises(ValueError, match="cached KV has shapes"):
        engine.prefill(ids(20, seed=13), GREEDY, cached=Wrong())
    Wrong.length = 20
    with pytest.raises(ValueError, match="shorter than the prompt"):
        engine.prefill(ids(20, seed=13), GREEDY, cached=Wrong())


def test_a_hit_counts_the_bytes_it_copies(engine):
    """`hit_copy_bytes`: what every hit copied out of the cache (bench/kv_capacity.py's measure of
    a prefix hit's cost); a miss copies nothing."""
    cache = cache_for(engine, BLOCK, 1 << 24)
    shared = ids(2 * BLOCK, seed=11)
    cached_prefill(engine, cache, shared + ids(3, seed=12), GREEDY)
    assert cache.stats.hit_copy_bytes == 0
    cache.lookup(ids(40, seed=13))  # a miss
    assert cache.stats.hit_copy_bytes == 0
    for n in (1, 2):
        hit = cache.lookup(shared + ids(5, seed=13 + n))
        assert hit is not None and hit.blocks == 2
        assert cache.stats.hit_copy_bytes == n * 2 * block_bytes(engine) == n * (hit.k.nbytes + hit.v.nbytes)
    assert cache.summary()["hit_copy_bytes"] == 2 * 2 * block_bytes(engine)
