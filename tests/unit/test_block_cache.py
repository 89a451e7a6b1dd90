"""Decode-side reuse (tandem_engine/block_cache.py): a paged engine keeps a finished row's full
blocks, a later sequence with the same leading tokens shares them (its KV payload then holds only
the rest), and the greedy tokens are those of a whole insert. The accounting: pins, eviction for
room, cached blocks counted as free, nothing leaked.

Blocks of 4 positions; prompts of 13-30 tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.types import KVPayload, SamplingParams
from tandem_engine import load_engine
from tandem_engine.block_cache import BlockCache, CachingAllocator

GREEDY = SamplingParams()
BLOCK = 4


@pytest.fixture(scope="module")
def engine():
    return load_engine("builtin", slots=4, max_len=128, prefill_buckets=(16, 64), prefix_chunk=16,
                       kv_block_size=BLOCK, kv_blocks=40)


def part(payload: KVPayload, start: int) -> KVPayload:
    """What a prefill pod sends a decode pod holding the first `start` positions."""
    n = payload.true_length
    return KVPayload(k=payload.k[:, start:n].copy(), v=payload.v[:, start:n].copy(), true_length=n,
                     first_token=payload.first_token, start=start)


def run(engine, state, slot: int, steps: int, payload: KVPayload, cached=None):
    """Insert `payload` into `slot`, decode `steps` greedy tokens; (state, tokens incl. the first)."""
    state = engine.insert_payload(payload, state, slot, GREEDY, cached=cached)
    out = [payload.first_token]
    for _ in range(steps):
        state, short = engine.reserve(state, 1)
        assert short == []
        state, tokens = engine.generate(state)
        out.append(int(np.asarray(tokens)[slot]))
    return state, out


@pytest.mark.slow  # make test-unit leaves it out: two turns of the built-in model and their references
def test_a_second_turn_shares_the_first_turns_blocks_and_decodes_the_same_tokens(engine):
    rng = np.random.default_rng(0)
    turn1 = rng.integers(0, 256, 13).tolist()
    state = engine.init_state()
    free0 = engine.kv_blocks_free()
    state, out1 = run(engine, state, 0, 8, engine.export_prefix(engine.prefill(turn1, GREEDY)))
    fed = turn1 + out1[:-1]  # the KV the row holds: the prompt, then every token fed to a step
    state = engine.free(state, 0, tokens=fed)
    kept = len(fed) // BLOCK  # 20 positions: 5 full blocks
    assert engine.kv_reuse_summary()["blocks"] == kept
    assert engine.kv_blocks_free() == free0  # cached blocks nobody holds still count as free

    turn2 = fed + [out1[-1]] + rng.integers(0, 256, 9).tolist()  # 30 tokens
    whole = engine.export_prefix(engine.prefill(turn2, GREEDY))
    match = engine.match_prefix(turn2)
    assert match is not None and match.length == kept * BLOCK
    state, got = run(engine, state, 1, 10, part(whole, match.length), cached=match)
    assert match.done
    state = engine.free(state, 1)
    assert engine.kv_blocks_free() == free0
    # the reference: the whole payload into a fresh engine state (no cache involved)
    ref_state = engine.init_state()
    _, want = run(engine, ref_state, 1, 10, whole)
    assert got == want


def test_pins_hold_blocks_until_released_and_eviction_makes_room(engine):
    rng = np.random.default_rng(1)
    state = engine.init_state()
    total = engine.kv_blocks_total
    ids = rng.integers(0, 256, 33).tolist()
    state, out = run(engine, state, 0, 2, engine.export_prefix(engine.prefill(ids, GREEDY)))
    state = engine.free(state, 0, tokens=ids + out[:-1])  # 35 positions: 8 full blocks kept
    assert engine.kv_reuse_summary()["blocks"] == 8 and engine.kv_blocks_free() == total
    match = engine.match_prefix(ids)
    assert match.length == 32  # at least the last token is left to pull
    assert engine.kv_blocks_free() == total - 8  # pinned: not evictable
    engine.release_prefix(match)
    engine.release_prefix(match)  # twice: no-op
    assert engine.kv_blocks_free() == total
    # rows that need every block: the cached ones are evicted for them, a chain's last blocks first
    prefix = engine.prefill(rng.integers(0, 256, 64).tolist(), GREEDY)
    state = engine.insert(prefix, state, 1, GREEDY)
    state, short = engine.reserve(state, 128)  # to max_len: 32 blocks, what the free list has
    assert short == [] and engine.kv_reuse_summary()["evicted"] == 0
    assert engine.kv_blocks_free() == 8  # the cached blocks alone
    state = engine.insert(engine.prefill(rng.integers(0, 256, 16).tolist(), GREEDY), state, 2, GREEDY)
    assert engine.kv_reuse_summary()["evicted"] == 4 and engine.kv_blocks_free() == 4
    trimmed = engine.match_prefix(ids)
    assert trimmed.length == 16  # the chain's first 4 blocks are left, not a stranded tail
    engine.release_prefix(trimmed)
    state = engine.free(state, 1)
    state = engine.free(state, 2)
    assert engine.kv_blocks_free() == total


def test_a_payload_sent_whole_despite_a_match_goes_in_whole_and_frees_the_match(engine):
    rng = np.random.default_rng(2)
    state = engine.init_state()
    ids = rng.integers(0, 256, 21).tolist()
    payload = engine.export_prefix(engine.prefill(ids, GREEDY))
    state, out = run(engine, state, 0, 3, payload)
    state = engine.free(state, 0, tokens=ids + out[:-1])
    match = engine.match_prefix(ids)
    assert match is not None
    state, again = run(engine, state, 2, 3, payload, cached=match)  # an old prefill pod: start 0
    assert again == out and match.done
    state = engine.free(state, 2)
    assert engine.kv_blocks_free() == engine.kv_blocks_total
    with pytest.raises(ValueError, match="needs the match"):
        engine.insert_payload(part(payload, 8), state, 0, GREEDY)


def test_the_allocator_counts_blocks_only_the_cache_holds():
    alloc = CachingAllocator(8)
    cache = BlockCache(alloc, 2, salt=b"t")
    row = alloc.alloc(3)
    cache.keep([1, 2, 3, 4, 5], row)  # 2 full blocks kept
    assert alloc.cached_only == 0  # the row still holds them
    alloc.release(row)
    assert alloc.cached_only == 2 and alloc.free_count() == 6
    m = cache.match([1, 2, 3, 4, 5, 6])
    assert m.blocks == row[:2] and alloc.cached_only == 0
    cache.release(m)
    assert alloc.cached_only == 2
    assert cache.make_room(8) == 2 and alloc.free_count() == 8 and alloc.cached_only == 0
