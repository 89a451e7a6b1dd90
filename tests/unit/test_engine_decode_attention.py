"""A short sequence and one that crosses a read piece of the KV pool (attention.READ_CHUNK) while
decoding, side by side in a large pool, decode to the reference's greedy tokens."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.types import SamplingParams
from tandem_engine import load_engine, reference_greedy
from tandem_engine.attention import READ_CHUNK

GREEDY = SamplingParams()


@pytest.mark.slow  # make test-unit leaves it out: an engine of 1,024 rows and the reference over 260 positions
def test_short_and_boundary_crossing_sequences_in_a_large_cache():
    """max_len 1024: a 7-token prompt reads one piece of the pool, a 250-token prompt crosses
    from the second read piece into the third while decoding; both rows decode side by side to the reference."""
    engine = load_engine("tiny", slots=2, max_len=1024, prefill_buckets=(16, 256))
    rng = np.random.default_rng(0)
    prompts = {0: rng.integers(0, 256, 7).tolist(), 1: rng.integers(0, 256, 250).tolist()}
    steps = 10
    state = engine.init_state()
    got = {}
    for slot, ids in prompts.items():
        prefix = engine.prefill(ids, GREEDY)
        got[slot] = [prefix.first_token]
        state = engine.insert(prefix, state, slot, GREEDY)
    for _ in range(steps):
        state, tokens = engine.generate(state)
        for slot in prompts:
            got[slot].append(int(np.asarray(tokens)[slot]))
    assert int(np.asarray(state.positions)[1]) > 2 * READ_CHUNK
    for slot, ids in prompts.items():
        assert got[slot] == reference_greedy(engine.params, engine.cfg, ids, steps + 1, pad_to=272)
