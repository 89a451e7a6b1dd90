"""Decode KV in fp8 (`kv_dtype="fp8"`, paged layout): the pool holds float8_e4m3fn (a quarter of
float32's bytes), K and V are cast to it when written and back when read, and on the built-in
model the greedy tokens of a few prompts are float32's (bench/quantize_quality.py --kv measures
the error at large). The slot layout refuses it."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tandem_core.types import SamplingParams
from tandem_engine import load_engine

G = SamplingParams()


def _decode(engine, prompts, steps):
    state, out = engine.init_state(), {}
    for slot, ids in enumerate(prompts):
        prefix = engine.prefill(ids, G)
        state = engine.insert_payload(engine.export_prefix(prefix), state, slot, G)
        out[slot] = [prefix.first_token]
    for _ in range(steps):
        state, short = engine.reserve(state, 1)
        assert short == []
        state, toks = engine.generate(state)
        for slot in out:
            out[slot].append(int(np.asarray(toks)[slot]))
    return out, state


@pytest.mark.slow  # make test-unit leaves it out: the built-in model in two KV dtypes
def test_fp8_kv_is_stored_in_fp8_and_decodes_the_builtin_models_greedy_tokens():
    kw = dict(slots=4, max_len=256, prefill_buckets=(64, 256), kv_block_size=16)
    ref = load_engine("builtin", **kw)
    fp8 = load_engine("builtin", kv_dtype="fp8", **kw)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 2000, 40).tolist() for _ in range(4)]
    want, _ = _decode(ref, prompts, 24)
    got, state = _decode(fp8, prompts, 24)
    assert fp8.kv_dtype == "fp8" and state.k[0].dtype == jnp.float8_e4m3fn
    assert state.k[0].nbytes * 4 == ref.init_state().k[0].nbytes
    assert got == want


def test_an_unknown_kv_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        load_engine("tiny", slots=2, max_len=64, kv_dtype="int4")
