"""Grammar masks in the engine: a masked slot only ever draws allowed tokens (temperature 1, many
draws), an unmasked neighbour draws exactly what it draws with no masks at all, prefill masks token
0 per choice, logprobs are those of the constrained distribution, and a bad mask names its shape.
Real engine on the "tiny" preset (vocab 258), same shapes as test_engine_logits.py's."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.grammar import all_allowed
from tandem_core.types import LOGPROB_FLOOR, SamplingParams
from tandem_engine import Engine, load_engine, unpack_logprobs, unpack_tokens

HOT = SamplingParams(temperature=1.0, seed=7)
STEPS = 24


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine("tiny", slots=4, max_len=128, prefill_buckets=(16, 32, 64))


def mask_of(allowed: list[int], vocab: int) -> np.ndarray:
    row = np.zeros(((vocab + 31) // 32,), np.uint32)
    for t in allowed:
        row[t // 32] |= np.uint32(1 << (t % 32))
    return row.view(np.int32)


def _run(engine: Engine, masks) -> np.ndarray:
    """STEPS steps of two seeded temperature-1 slots; tokens [STEPS, 2]."""
    state = engine.init_state()
    for slot, seed in ((0, 11), (1, 12)):
        p = SamplingParams(temperature=1.0, seed=seed)
        prefix = engine.prefill([256, 70 + slot, 71, 72], p)
        state = engine.insert(prefix, state, slot, p)
    out = []
    for _ in range(STEPS):
        state, toks = engine.generate(state, 2, masks=masks)
        out.append(np.asarray(toks)[:2])
    return np.stack(out)


def test_masked_slot_draws_only_allowed_and_neighbour_is_unchanged(engine):
    vocab = engine.info.vocab_size
    allowed = [65, 66, 100, 200]
    masks = all_allowed(2, vocab)
    masks[0] = mask_of(allowed, vocab)
    plain = _run(engine, None)
    masked = _run(engine, masks)
    assert set(masked[:, 0].tolist()) <= set(allowed)
    assert len(set(masked[:, 0].tolist())) > 1  # a real draw, not a forced token
    assert masked[:, 1].tolist() == plain[:, 1].tolist()
    assert plain[:, 0].tolist() != masked[:, 0].tolist()


def test_all_ones_masks_change_nothing(engine):
    assert _run(engine, all_allowed(2, engine.info.vocab_size)).tolist() == _run(engine, None).tolist()


def test_prefill_masks_token_zero_per_choice(engine):
    vocab = engine.info.vocab_size
    choices = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2)]
    masks = all_allowed(2, vocab)
    masks[0] = mask_of([42], vocab)
    free = engine.prefill([256, 1, 2, 3], HOT, choices=choices)
    got = engine.prefill([256, 1, 2, 3], HOT, choices=choices, masks=masks)
    assert got.first_tokens[0] == 42
    assert got.first_tokens[1] == free.first_tokens[1]


def test_logprobs_are_of_the_constrained_distribution(engine):
    vocab = engine.info.vocab_size
    allowed = [10, 20, 30]
    p = SamplingParams(temperature=1.0, seed=3, logprobs=5)
    prefix = engine.prefill([256, 5, 6], p, masks=mask_of(allowed, vocab)[None])
    lp = prefix.first_logprobs[0]
    assert prefix.first_token in allowed
    real = [(t, x) for t, x in lp.top if x > LOGPROB_FLOOR]
    assert {t for t, _ in real} == set(allowed)
    assert abs(sum(np.exp(x) for _, x in real) - 1.0) < 1e-4
    state = engine.insert(prefix, engine.init_state(), 0, p)
    state, packed = engine.generate(state, 1, logprobs=True, masks=mask_of(allowed, vocab)[None])
    host = np.asarray(packed)
    assert int(unpack_tokens(host)[0]) in allowed
    step = unpack_logprobs(host[0], 5)
    assert abs(sum(np.exp(x) for _, x in step.top if x > LOGPROB_FLOOR) - 1.0) < 1e-4


def test_bad_mask_shape_names_the_shape(engine):
    state = engine.init_state()
    with pytest.raises(ValueError, match=r"int32 \[<= 2, 9\]"):
        engine.generate(state, 2, masks=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="2 choices"):
        engine.prefill([256, 1], HOT, choices=[HOT, HOT], masks=np.zeros((1, 9), np.int32))
