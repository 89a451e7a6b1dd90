"""An insert, and a pulled payload that goes straight from the host into the insert call
(engine.insert_payload), leave exactly the state `cores.insert_paged_core` called directly leaves:
the pool, the block table, every per-slot array, bit for bit, whatever the slot, the prefix's length and the
request's sampling and processing params. A decode pod after warm-up compiles nothing."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from tandem_core.errors import InvalidRequest
from tandem_core.types import KVPayload, SamplingParams
from tandem_engine import load_engine
from tandem_engine.cores import insert_paged_core
from tandem_engine.logits import history_arrays, slot_logits
from tandem_engine.sampling import sampling_arrays

SLOTS, MAX_LEN = 16, 300

PARAMS = [
    SamplingParams(seed=99),  # greedy (a seed: None draws a new one per insert)
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1234, repetition_penalty=1.3,
                   presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((7, 2.5), (11, -3.0)), min_tokens=3),
]


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(16, 200))


def filled_state(engine, seed: int):
    """A state whose cache and per-slot arrays hold noise (what earlier occupants leave)."""
    rng = np.random.default_rng(seed)
    state = engine.init_state()
    return jax.tree.map(lambda a: jax.numpy.asarray(
        rng.integers(0, 5, a.shape) if a.dtype.kind in "iub" and a.dtype != bool else
        rng.integers(0, 2, a.shape).astype(bool) if a.dtype == bool else rng.standard_normal(a.shape),
        a.dtype), state)


def reference(engine, state, prefix, slot, sampling, history, start_index, stop_ids):
    """`insert_paged_core` called directly with the request's arguments, into the blocks a fresh
    pool hands out first (1, 2, ...: `filled_state` started the engine's host state afresh), the
    slot's table row holding them and every other row empty."""
    length = prefix.k.shape[1]
    s = sampling_arrays(sampling)
    hist_ids, hist_len, out_from = history_arrays(history, None, prefix.true_length, length, engine.info.vocab_size)
    need = engine.kv_blocks_for(prefix.true_length)
    table = np.zeros((engine.slots, engine.max_blocks_per_seq), np.int32)
    table[slot, :need] = np.arange(1, need + 1)
    write = np.zeros(engine.kv_blocks_for(length), np.int32)
    write[:need] = np.arange(1, need + 1)
    state = state._replace(block_table=jax.device_put(table, jax.devices()[0]))
    return insert_paged_core(state, prefix.k, prefix.v, write, np.int32(slot), np.int32(prefix.true_length),
                       np.int32(prefix.first_token), np.int32(start_index + 1), s["temperature"], s["top_k"],
                       s["top_p"], s["seed"], hist_ids, np.int32(hist_len), np.int32(out_from),
                       slot_logits(sampling, engine.info.vocab_size, stop_ids), layout=None)


def assert_same(got, want):
    flat_got, tree_got = jax.tree.flatten(got)
    flat_want, tree_want = jax.tree.flatten(want)
    assert tree_got == tree_want
    for i, (a, b) in enumerate(zip(flat_got, flat_want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"leaf {i} differs")


@pytest.mark.parametrize("slot", [0, 15])
@pytest.mark.parametrize("prompt_len", [12, 150])  # two prefill buckets
@pytest.mark.parametrize("params", range(len(PARAMS)))
def test_insert_and_payload_insert_leave_the_core_insert_state(engine, slot, prompt_len, params):
    sampling = PARAMS[params]
    prompt = [(i * 13 + 5) % engine.info.vocab_size for i in range(prompt_len)]
    prefix = engine.prefill(prompt, SamplingParams())
    kw = dict(history=prompt, start_index=0, stop_ids=(3, 9))
    want = reference(engine, filled_state(engine, slot), prefix, slot, sampling, prompt, 0, (3, 9))
    got = engine.insert(prefix, filled_state(engine, slot), slot, sampling, **kw)
    assert_same(got, want)
    payload = engine.export_prefix(prefix)  # a pulled KV: host arrays into the same call
    got = engine.insert_payload(payload, filled_state(engine, slot), slot, sampling, **kw)
    assert_same(got, want)


def test_payload_in_another_dtype_and_a_resumed_request(engine):
    prompt = list(range(1, 40))
    prefix = engine.prefill(prompt, SamplingParams())
    payload = engine.export_prefix(prefix)
    half = KVPayload(payload.k.astype(np.float16), payload.v.astype(np.float16), payload.true_length,
                     payload.first_token)
    # resumed: the prompt holds 5 tokens of output already, and the next token is index 6
    want = engine.insert(engine.import_prefix(half), filled_state(engine, 3), 11, PARAMS[1], history=prompt,
                         output_from=34, start_index=5, first_token=17)
    got = engine.insert_payload(half, filled_state(engine, 3), 11, PARAMS[1], history=prompt, output_from=34,
                                start_index=5, first_token=17)
    assert_same(got, want)


def test_a_bad_payload_is_refused_with_what_is_wrong(engine):
    prefix = engine.export_prefix(engine.prefill([1, 2, 3], SamplingParams()))
    bad = KVPayload(prefix.k[:, :, :1], prefix.v[:, :, :1], prefix.true_length, prefix.first_token)
    with pytest.raises(InvalidRequest, match="KV payload k has shape"):
        engine.insert_payload(bad, engine.init_state(), 0, SamplingParams())
    bad = KVPayload(prefix.k, prefix.v, prefix.k.shape[1] + 1, prefix.first_token)
    with pytest.raises(InvalidRequest, match="lengths disagree"):
        engine.insert_payload(bad, engine.init_state(), 0, SamplingParams())


def test_serving_after_warmup_compiles_nothing(caplog):
    """A decode pod warms up, then serves from a fresh state: payloads inserted, steps, rows freed
    and filled again, and no core compiles. With the weights read from a checkpoint (the built-in
    model: committed to the device) every core's outputs are committed, so a state `init_state`
    left uncommitted was another jit cache key: a pod compiled its step and its free again while
    serving (bench/paged_capacity.py: 6 compiles, 8 s of CPU after its warm-up)."""
    engine = load_engine("builtin", slots=2, max_len=64, prefill_buckets=(16,), steps_per_dispatch=1, kv_block_size=16)
    engine.warmup(prefill=False, logprobs=False)
    c = engine.cfg
    kv = np.zeros((c.num_layers, 16, c.num_kv_heads, c.head_dim), np.float32)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        state = engine.init_state()
        for _ in range(2):
            for slot in (0, 1):
                state = engine.insert_payload(KVPayload(k=kv, v=kv, true_length=12, first_token=1), state, slot,
                                              SamplingParams())
            for _ in range(3):
                state, short = engine.reserve(state, 1)
                state, tokens = engine.generate(state)
                np.asarray(tokens)
            for slot in (0, 1):
                state = engine.free(state, slot)
    compiled = [r.getMessage()[:60] for r in caplog.records if r.getMessage().startswith("Compiling jit(")
                and "_core" in r.getMessage()[:40]]
    assert compiled == []


def test_a_direct_prompt_after_a_decode_pods_warmup_compiles_nothing(caplog):
    """A disaggregated decode pod prefills the short prompts a gateway routes straight to it
    (direct_prefill, the smallest bucket). Its warm-up (`direct=True`) compiles that prefill and
    the insert of its KV, which is committed to the device where a pulled payload's is not (another
    jit cache key): before, the first direct prompts of a fresh cluster compiled both while
    serving (bench/cold_start.py: TTFT p50 ~0.2-0.5 s on a warm cache)."""
    engine = load_engine("builtin", slots=2, max_len=64, prefill_buckets=(16, 32), steps_per_dispatch=1,
                         kv_block_size=16)
    engine.warmup(prefill=False, logprobs=False, direct=True)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        state = engine.init_state()
        for slot, prompt in ((0, [0, 5, 6, 7]), (1, [0, 9, 10, 11, 12, 13])):
            state = engine.insert(engine.prefill(prompt, SamplingParams()), state, slot, SamplingParams())
        state, tokens = engine.generate(state)
        np.asarray(tokens)
    compiled = [r.getMessage()[:60] for r in caplog.records if r.getMessage().startswith("Compiling jit(")
                and "_core" in r.getMessage()[:40]]
    assert compiled == []
