"""One ragged call carries a prompt's chunk beside the decode rows (`begin_prompt`,
`generate_ragged`: vLLM's chunked prefill in the step's own attention, cores.ragged_core): the
prompt's first token and every later one are the reference's, the rows decoding beside it are
undisturbed, a sampled first token is the one `prefill` draws with the same seed, and the blocks
go back when the row is freed, finished or not."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.errors import OutOfKVBlocks
from tandem_core.types import SamplingParams
from tandem_engine import load_engine, reference_greedy
from tandem_engine.logits import unpack_tokens

GREEDY = SamplingParams()
MAX_LEN = 128


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=4, max_len=MAX_LEN, prefill_buckets=(16, 64), prefix_chunk=16,
                       kv_block_size=4)


def alone(engine, ids: list[int], n: int) -> list[int]:
    return reference_greedy(engine.params, engine.cfg, ids, n, pad_to=MAX_LEN)


def first_of(out) -> int:
    return int(unpack_tokens(np.asarray(out.first)[None])[0])


def test_a_prompt_prefilled_in_chunks_beside_decode_rows_decodes_as_alone(engine):
    rng = np.random.default_rng(0)
    a, b, p = (rng.integers(0, 250, n).tolist() for n in (9, 21, 43))  # p: chunks of 16, 16 and 11
    state = engine.init_state()
    got = {}
    for slot, ids in ((0, a), (1, b)):
        prefix = engine.prefill(ids, GREEDY)
        state = engine.insert(prefix, state, slot, GREEDY)
        got[slot] = [prefix.first_token]
    state = engine.begin_prompt(state, 2, p, GREEDY)
    assert engine.kv_blocks_of(2) == engine.kv_blocks_for(len(p))
    calls = 0
    while 2 not in got:
        state, out = engine.generate_ragged(state, 2)
        calls += 1
        for slot in (0, 1):
            got[slot].append(int(np.asarray(out.tokens)[slot]))
        if out.slot is not None:
            assert out.slot == 2
            got[2] = [first_of(out)]
    assert calls == 3  # 43 tokens in chunks of 16
    for _ in range(8):
        state, out = engine.generate_ragged(state, 3)  # nothing pending: a plain step
        assert out.slot is None
        for slot in got:
            got[slot].append(int(np.asarray(out.tokens)[slot]))
    assert got[2] == alone(engine, p, 9)
    assert got[0] == alone(engine, a, 12) and got[1] == alone(engine, b, 12)
    for slot in got:
        state = engine.free(state, slot)
    assert engine.kv_blocks_free() == engine.kv_blocks_total


def test_a_sampled_first_token_is_the_one_prefill_draws(engine):
    ids = list(range(5, 30))
    sampling = SamplingParams(temperature=1.0, top_k=50, seed=11, repetition_penalty=1.3)
    want = engine.prefill(ids, sampling, start_index=4).first_token
    state = engine.begin_prompt(engine.init_state(), 0, ids, sampling, start_index=4)
    firsts = []
    while not firsts:
        state, out = engine.generate_ragged(state, 1)
        if out.slot is not None:
            firsts.append(first_of(out))
    assert firsts == [want]
    assert int(np.asarray(state.step)[0]) == 5  # the row's next token is index 5
    engine.free(state, 0)


def test_a_row_freed_mid_prompt_gives_its_blocks_back_and_a_full_pool_refuses(engine):
    state = engine.init_state()
    total = engine.kv_blocks_total
    state = engine.begin_prompt(state, 1, list(range(3, 60)), GREEDY)
    state, out = engine.generate_ragged(state, 2)  # one chunk of the prompt
    assert out.slot is None and engine.kv_blocks_free() == total - engine.kv_blocks_for(57)
    state = engine.free(state, 1)
    assert engine.kv_blocks_free() == total
    small = load_engine("tiny", slots=2, max_len=64, prefill_buckets=(16,), prefix_chunk=16, kv_block_size=4,
                        kv_blocks=16)
    st = small.begin_prompt(small.init_state(), 0, list(range(3, 63)), GREEDY)  # 60 tokens: 15 blocks
    with pytest.raises(OutOfKVBlocks):
        small.begin_prompt(st, 1, list(range(3, 20)), GREEDY)
