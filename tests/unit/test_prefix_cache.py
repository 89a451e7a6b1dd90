"""A prefill pod's prefix cache as the pod uses it (prefill_svc/prefill.py: look the prompt up,
prefill over the hit, count, keep its blocks): greedy output with the cache is the output without
it (a prompt ending mid-block, one filling its blocks exactly, one spanning chunks, after
eviction, with penalties that read the whole prompt), a fully cached prompt still computes its
last block, the pool's bytes stay under the budget, a cache that is off counts only what it
computed, and the hash chain keys the whole prefix and the salt. The cache is the device pool
(tandem_engine/prefix_pool.py; tests/unit/test_prefix_pool.py has its in-place reads and pins);
the host cache these cases were first written for was deleted by issue 43."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.prefix import block_hashes, cache_salt
from tandem_core.types import SamplingParams
from tandem_engine import load_engine
from tandem_engine.prefix_pool import DevicePrefixCache, device_cache_for

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


def blocks_cache(engine, blocks: int, enabled: bool = True) -> DevicePrefixCache:
    one = device_cache_for(engine, BLOCK, 1)
    return device_cache_for(engine, BLOCK, blocks * one.block_bytes, enabled=enabled)


def through(engine, cache: DevicePrefixCache, prompt: list[int], sp: SamplingParams):
    """A prefill pod's turn with one prompt: (its Prefix, its KV as the transfer sends it)."""
    hit = cache.lookup(prompt)
    prefix = engine.prefill(prompt, sp, cached=hit)
    cache.stats.computed += len(prompt) - (hit.length if hit else 0)
    payload = engine.export_prefix(prefix)
    cache.insert(prompt, lambda: (payload.k, payload.v))
    return prefix, payload


@pytest.mark.parametrize("tail", [7, 16, 33])  # ends mid-block, fills its blocks exactly, spans chunks
def test_greedy_output_is_the_same_with_the_cache(engine, tail):
    shared = ids(24, seed=1)  # one full block and a half: the second prompt hits the first block only
    cache = blocks_cache(engine, 32)
    through(engine, cache, shared + ids(5, seed=2), GREEDY)
    assert cache.stats.hits == 0 and len(cache) == 1
    prompt = shared + ids(tail, seed=3)
    want = greedy_run(engine, engine.prefill(prompt, GREEDY))
    prefix, payload = through(engine, cache, prompt, GREEDY)
    assert cache.stats.hits == BLOCK
    assert greedy_run(engine, prefix) == want
    ref = engine.export_prefix(engine.prefill(prompt, GREEDY))
    assert payload.k.shape == ref.k.shape and payload.true_length == len(prompt)
    np.testing.assert_allclose(payload.k[:, :len(prompt)], ref.k[:, :len(prompt)], atol=1e-4)
    np.testing.assert_allclose(payload.v[:, :len(prompt)], ref.v[:, :len(prompt)], atol=1e-4)


def test_a_fully_cached_prompt_still_computes_its_last_block(engine):
    cache = blocks_cache(engine, 32)
    prompt = ids(2 * BLOCK, seed=4)
    want = through(engine, cache, prompt, GREEDY)[0].first_token
    assert len(cache) == 2
    again, _ = through(engine, cache, prompt, GREEDY)
    assert cache.stats.hits == BLOCK  # the last block is computed: its last row gives the first token
    assert again.first_token == want
    assert cache.stats.computed == 2 * BLOCK + BLOCK


def test_penalties_see_the_cached_part_of_the_prompt(engine):
    # a prompt whose unpenalised first token is in its cached block: the repetition penalty must
    # see that block (read from the pool, not computed) to turn the first token away from it
    shared, tail = ids(BLOCK, seed=5), ids(9, seed=6)
    for i in range(BLOCK):
        plain = engine.prefill(shared + tail, GREEDY).first_token
        if plain in shared:
            break
        shared[i] = plain
    assert plain in shared
    prompt = shared + tail
    sp = SamplingParams(repetition_penalty=3.0, presence_penalty=0.5)
    cache = blocks_cache(engine, 32)
    through(engine, cache, shared + ids(3, seed=7), sp)
    got, _ = through(engine, cache, prompt, sp)
    assert cache.stats.hits == BLOCK
    want = engine.prefill(prompt, sp)
    assert want.first_token != plain  # the penalty turns it (else this test could not fail)
    assert got.first_token == want.first_token


def test_bytes_stay_under_budget_and_output_survives_eviction(engine):
    cache = blocks_cache(engine, 5)
    prompts = [ids(40, seed=100 + i) for i in range(12)]  # a burst of distinct prompts, 2 blocks each
    for p in prompts:
        through(engine, cache, p, GREEDY)
        assert cache.summary()["bytes"] <= cache.budget_bytes
    assert cache.summary()["evicted"] > 0 and len(cache) <= 5
    first = prompts[0]  # evicted long ago: a miss, the same tokens
    before = cache.stats.hits
    got, _ = through(engine, cache, first, GREEDY)
    assert cache.stats.hits == before
    assert greedy_run(engine, got) == greedy_run(engine, engine.prefill(first, GREEDY))


def test_disabled_cache_counts_computed_tokens_only(engine):
    cache = blocks_cache(engine, 32, enabled=False)
    prompt = ids(40, seed=10)
    through(engine, cache, prompt, GREEDY)
    through(engine, cache, prompt, GREEDY)
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
