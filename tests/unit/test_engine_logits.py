"""Logits processing and logprobs: each step (repetition, presence, frequency, logit_bias,
min_tokens) matches a numpy reference; greedy decoding with penalties matches a host loop over the
full-recompute reference; logprobs are the log-softmax of the processed logits, packed with the
tokens; a plain slot is untouched by a processed one beside it; n choices share one forward pass;
a resumed request (history + output_from) continues the unbroken run; bad params name their field.
Real engine on the "tiny" preset; one prefill bucket, so few compiles."""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem_core.errors import InvalidRequest
from tandem_core.types import LOGPROB_FLOOR, MAX_TOP_LOGPROBS, SamplingParams
from tandem_engine import Engine, load_engine, reference_forward, unpack_logprobs, unpack_tokens
from tandem_engine.logits import apply, history_row, logprobs_of, pack, slot_logits, stack

GREEDY = SamplingParams()
PEN = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.7)
EOS = 257
PAD_TO = 32  # the host reference recomputes sequences padded to this (one compile)


@pytest.fixture(scope="module")
def engine() -> Engine:
    # the same shapes as test_engine.py's engine, so a run of both shares compiled code
    return load_engine("tiny", slots=4, max_len=128, prefill_buckets=(16, 32, 64))


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


@partial(jax.jit, static_argnames=("cfg",))
def _ref_logits(params, tokens, cfg):
    return reference_forward(params, tokens, cfg)


def ref_logits(engine: Engine, seq: list[int]) -> np.ndarray:
    """Reference logits [len(seq), vocab] (full recompute, no cache)."""
    padded = np.zeros((PAD_TO,), np.int32)
    padded[: len(seq)] = seq
    return np.asarray(_ref_logits(engine.params, padded, cfg=engine.cfg))[: len(seq)]


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def np_process(logits, prompt_ids, out, sp: SamplingParams, stop_ids=(), index=0) -> np.ndarray:
    """The contract's processing order, in numpy."""
    x = np.asarray(logits, np.float32).copy()
    vocab = x.shape[-1]
    seen = np.zeros(vocab, bool)
    seen[list(prompt_ids) + list(out)] = True
    counts = np.bincount(np.asarray(out, np.int64), minlength=vocab).astype(np.float32)
    rep = np.float32(sp.repetition_penalty)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = x - np.float32(sp.presence_penalty) * (counts > 0) - np.float32(sp.frequency_penalty) * counts
    for tok, b in sp.logit_bias:
        x[tok] += np.float32(b)
    if index < sp.min_tokens:
        x[list(stop_ids)] = -np.inf
    return x


def decode(engine: Engine, ids, sp: SamplingParams, steps: int, *, stop_ids=(), slot: int = 0):
    """prefill + insert (with the prompt as history) + `steps` steps with logprobs on: the
    tokens (index 0 first) and the packed rows of the steps."""
    prefix = engine.prefill(ids, sp, stop_ids=stop_ids)
    state = engine.insert(prefix, engine.init_state(), slot, sp, history=ids, stop_ids=stop_ids)
    tokens, rows = [prefix.first_token], []
    for _ in range(steps):
        state, packed = engine.generate(state, logprobs=True)
        host = np.asarray(packed)
        tokens.append(int(unpack_tokens(host)[slot]))
        rows.append(host[slot])
    return tokens, rows


def host_reference(engine: Engine, ids, sp: SamplingParams, n: int, stop_ids=()) -> list[int]:
    """Greedy tokens by full recompute, processed in numpy."""
    seq, out = list(ids), []
    for i in range(n):
        x = np_process(ref_logits(engine, seq)[-1], ids, out, sp, stop_ids, index=i)
        out.append(int(np.argmax(x)))
        seq.append(out[-1])
    return out


# ---------------------------------------------------------------------------------------------
# the processing function against numpy


def test_each_processing_step_matches_numpy():
    rng = np.random.default_rng(0)
    vocab = 50
    logits = rng.normal(0, 3, size=(5, vocab)).astype(np.float32)
    prompt_ids, out = [1, 2, 3, 3, 9], [3, 7, 7, 11]
    params = [
        SamplingParams(),  # off: bit for bit unchanged
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.7, presence_penalty=0.5, frequency_penalty=-0.3),
        SamplingParams(logit_bias=((4, 5.0), (7, -2.5), (4, 1.0))),  # a repeated id: the last wins
        SamplingParams(min_tokens=3, logit_bias=((20, 100.0),)),
    ]
    stop = (20, 21)
    ids = np.asarray(prompt_ids + out, np.int32)
    hist = history_row(jnp.asarray(ids), len(ids), len(prompt_ids), vocab)
    proc = stack([slot_logits(p, vocab, stop) for p in params])
    index = np.full((5,), 2, np.int32)  # token index 2 < min_tokens: stop ids held back
    got = np.asarray(jax.jit(apply)(logits, jnp.broadcast_to(hist, (5, vocab)), proc, index))
    np.testing.assert_array_equal(got[0], logits[0])
    for i, p in enumerate(params):
        merged = dataclasses.replace(p, logit_bias=tuple(dict(p.logit_bias).items()))
        want = np_process(logits[i], prompt_ids, out, merged, stop, index=2)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    assert np.isneginf(got[4, list(stop)]).all()
    late = np.asarray(jax.jit(apply)(logits, jnp.broadcast_to(hist, (5, vocab)), proc, index + 1))
    assert np.isfinite(late[4]).all()  # index 3 == min_tokens: nothing held back
    lp = np.asarray(logprobs_of(jnp.asarray(got)))
    assert (lp[4, list(stop)] == LOGPROB_FLOOR).all() and np.isfinite(lp).all()


def test_history_row_counts_output_and_sees_prompt():
    ids = jnp.asarray([5, 5, 6, 7, 6, 6, 0, 0], jnp.int32)  # 6 real, then padding
    row = np.asarray(history_row(ids, 6, 3, 10))
    seen, count = row > 0, row >> 1
    assert seen.tolist() == [i in (5, 6, 7) for i in range(10)]
    assert count.tolist() == [0, 0, 0, 0, 0, 0, 2, 1, 0, 0]  # output = ids[3:6] = 7, 6, 6


def test_pack_round_trip():
    rng = np.random.default_rng(1)
    lp = np.asarray(logprobs_of(jnp.asarray(rng.normal(size=(3, 40)).astype(np.float32))))
    tokens = np.asarray([4, 0, 39], np.int32)
    host = np.asarray(pack(jnp.asarray(lp), jnp.asarray(tokens)))
    assert host.dtype == np.int32 and host.shape == (3, 2 + 2 * MAX_TOP_LOGPROBS)
    np.testing.assert_array_equal(unpack_tokens(host), tokens)
    for i in range(3):
        full = unpack_logprobs(host[i], MAX_TOP_LOGPROBS)
        assert full.logprob == pytest.approx(lp[i, tokens[i]], abs=1e-6)
        order = np.argsort(-lp[i])[:MAX_TOP_LOGPROBS]
        assert [t for t, _ in full.top] == order.tolist()
        np.testing.assert_allclose([v for _, v in full.top], lp[i, order], atol=1e-6)
        assert unpack_logprobs(host[i], 3).top == full.top[:3] and unpack_logprobs(host[i], 0).top == ()


# ---------------------------------------------------------------------------------------------
# through the engine


def test_greedy_with_penalties_matches_host_reference(engine):
    ids = prompt(12, seed=1)
    got, _ = decode(engine, ids, PEN, 8)
    assert got == host_reference(engine, ids, PEN, 9)
    assert got != decode(engine, ids, GREEDY, 8)[0]  # the penalties change the output


def test_logit_bias_forces_and_bans(engine):
    ids = prompt(10, seed=2)
    plain, _ = decode(engine, ids, GREEDY, 6)
    forced, _ = decode(engine, ids, SamplingParams(logit_bias=((42, 100.0),)), 6)
    assert forced == [42] * 7
    banned, _ = decode(engine, ids, SamplingParams(logit_bias=((plain[0], -100.0),)), 6)
    assert plain[0] not in banned


def test_min_tokens_holds_stop_ids_back(engine):
    ids = prompt(9, seed=3)
    sp = SamplingParams(min_tokens=3, logit_bias=((EOS, 100.0),))
    got, _ = decode(engine, ids, sp, 4, stop_ids=(EOS,))
    assert EOS not in got[:3] and got[3:] == [EOS, EOS]
    assert decode(engine, ids, sp, 1)[0][0] == EOS  # no stop ids given: nothing held back
    # a resumed request: token index 2 is still held back, index 3 is not
    resumed = engine.prefill(ids + got[:2], sp, start_index=2, output_from=len(ids), stop_ids=(EOS,))
    assert resumed.first_token != EOS
    state = engine.insert(resumed, engine.init_state(), 1, sp, history=ids + got[:2], output_from=len(ids),
                          start_index=2, stop_ids=(EOS,))
    state, tokens = engine.generate(state)
    assert int(np.asarray(tokens)[1]) == EOS


def test_logprobs_are_the_log_softmax_of_the_processed_logits(engine):
    ids = prompt(11, seed=4)
    sp = dataclasses.replace(PEN, logprobs=5)
    prefix = engine.prefill(ids, sp)
    first = prefix.first_logprobs[0]
    want = np_log_softmax(np_process(engine.prompt_logits(ids), ids, [], sp))
    assert np.exp(want).sum() == pytest.approx(1.0)
    assert first.top[0] == (prefix.first_token, pytest.approx(first.logprob))
    assert [t for t, _ in first.top] == np.argsort(-want)[:5].tolist()
    np.testing.assert_allclose([v for _, v in first.top], np.sort(want)[::-1][:5], atol=1e-5)
    tokens, rows = decode(engine, ids, sp, 4)
    for i, row in enumerate(rows):  # the greedy token is the best: its logprob is top[0]
        lp = unpack_logprobs(row, 5)
        assert lp.top[0][0] == tokens[i + 1] and lp.logprob == lp.top[0][1] == max(v for _, v in lp.top)
        ref = np_log_softmax(np_process(ref_logits(engine, ids + tokens[: i + 1])[-1], ids, tokens[: i + 1], sp))
        assert lp.logprob == pytest.approx(ref[tokens[i + 1]], abs=1e-4)
    assert engine.prefill(ids, PEN).first_logprobs == [None]


def test_sampled_slot_reports_the_logprob_of_its_draw(engine):
    ids = prompt(8, seed=5)
    sp = SamplingParams(temperature=1.0, seed=11, logprobs=2)
    tokens, rows = decode(engine, ids, sp, 6)
    assert tokens == decode(engine, ids, dataclasses.replace(sp, logprobs=None), 6)[0]
    drew_other = False
    for i, row in enumerate(rows):
        lp = unpack_logprobs(row, 2)
        ref = np_log_softmax(ref_logits(engine, ids + tokens[: i + 1])[-1])
        assert lp.logprob == pytest.approx(ref[tokens[i + 1]], abs=1e-4)
        drew_other |= lp.top[0][0] != tokens[i + 1]
    assert drew_other  # the draws are not all the argmax: the check above is not the greedy one


def test_a_step_with_logprobs_is_the_step_without(engine):
    """generate(logprobs=True) runs the very step generate() compiled (the flag is traced, so a
    pod compiles each step once): no compile for it, the same sampled tokens, and its logprobs."""
    from tandem_engine.cores import generate_core

    ids = prompt(9, seed=12)
    sp = SamplingParams(temperature=0.8, seed=5)

    def run(logprobs: bool) -> tuple[list[int], list[np.ndarray]]:
        state = engine.insert(engine.prefill(ids, sp), engine.init_state(), 0, sp, history=ids)
        tokens, rows = [], []
        for _ in range(5):
            state, out = engine.generate(state, logprobs=logprobs)
            host = np.asarray(out)
            tokens.append(int((unpack_tokens(host) if logprobs else host)[0]))
            rows.append(host[0])
        return tokens, rows

    plain, _ = run(False)
    compiled = generate_core._cache_size()
    tokens, rows = run(True)
    assert generate_core._cache_size() == compiled, "generate(logprobs=True) compiled a step of its own"
    assert tokens == plain
    for row in rows:
        lp = unpack_logprobs(row, 3)
        assert lp.logprob < 0 and len(lp.top) == 3 and lp.top[0][1] >= lp.logprob


def test_plain_slots_are_untouched_by_a_processed_neighbour(engine):
    a, b, c = prompt(13, seed=6), prompt(7, seed=7), prompt(10, seed=8)
    sampled = SamplingParams(temperature=0.9, top_k=30, seed=3)
    busy = dataclasses.replace(PEN, logprobs=3, min_tokens=4, logit_bias=((9, 2.0),))
    alone = {0: decode(engine, a, GREEDY, 8)[0], 2: decode(engine, c, sampled, 8, slot=2)[0]}
    state = engine.init_state()
    out: dict[int, list[int]] = {}
    for slot, ids, sp in ((0, a, GREEDY), (1, b, busy), (2, c, sampled)):
        prefix = engine.prefill(ids, sp, stop_ids=(EOS,))
        state = engine.insert(prefix, state, slot, sp, history=ids, stop_ids=(EOS,))
        out[slot] = [prefix.first_token]
    for i in range(8):
        state, packed = engine.generate(state, logprobs=i % 2 == 0)  # both variants
        host = np.asarray(packed)
        toks = unpack_tokens(host) if host.ndim == 2 else host
        for slot in out:
            out[slot].append(int(toks[slot]))
    assert out[0] == alone[0] and out[2] == alone[2]


def test_choices_share_one_forward_and_reproduce_per_seed(engine):
    ids = prompt(14, seed=9)
    sp = SamplingParams(temperature=1.0, seed=100, logprobs=1)
    choices = [dataclasses.replace(sp, seed=100 + i) for i in range(4)]
    prefix = engine.prefill(ids, sp, choices=choices)
    assert prefix.first_token == prefix.first_tokens[0] and len(prefix.first_tokens) == 4
    assert len(set(prefix.first_tokens)) > 1
    want = np_log_softmax(engine.prompt_logits(ids))
    for ch, tok, lp in zip(choices, prefix.first_tokens, prefix.first_logprobs):
        assert engine.prefill(ids, ch).first_token == tok
        assert lp.logprob == pytest.approx(want[tok], abs=1e-5)
    # choice 2 decodes from the shared prefix with its own first token and seed
    state = engine.insert(prefix, engine.init_state(), 0, choices[2], first_token=prefix.first_tokens[2], history=ids)
    got = [prefix.first_tokens[2]]
    for _ in range(5):
        state, tokens = engine.generate(state)
        got.append(int(np.asarray(tokens)[0]))
    assert got == decode(engine, ids, choices[2], 5)[0]


def test_prompt_logprobs_match_the_reference(engine):
    ids = prompt(15, seed=10)
    got = engine.prompt_logprobs(ids, 3)
    lp = np_log_softmax(ref_logits(engine, ids))
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        assert got[i].logprob == pytest.approx(lp[i - 1, ids[i]], abs=1e-4)
        assert [t for t, _ in got[i].top] == np.argsort(-lp[i - 1])[:3].tolist()
    assert all(len(x.top) == 0 for x in engine.prompt_logprobs(ids, 0)[1:])


@pytest.mark.parametrize("sp", [dataclasses.replace(GREEDY, frequency_penalty=0.6),
                                SamplingParams(temperature=0.9, presence_penalty=0.5, seed=21)])
def test_resumed_request_continues_the_unbroken_run(engine, sp):
    ids, cut = prompt(12, seed=11), 4
    unbroken, _ = decode(engine, ids, sp, 9)
    resumed_prompt = ids + unbroken[:cut]  # the original prompt + the tokens already streamed
    prefix = engine.prefill(resumed_prompt, sp, start_index=cut, output_from=len(ids))
    assert prefix.first_token == unbroken[cut]
    state = engine.insert(prefix, engine.init_state(), 3, sp, history=resumed_prompt, output_from=len(ids),
                          start_index=cut)
    got = [prefix.first_token]
    for _ in range(9 - cut):
        state, tokens = engine.generate(state)
        got.append(int(np.asarray(tokens)[3]))
    assert got == unbroken[cut:]


@pytest.mark.parametrize("kw, field", [
    (dict(sampling=SamplingParams(logit_bias=tuple((i, 1.0) for i in range(65)))), "logit_bias"),
    (dict(sampling=SamplingParams(logit_bias=((258, 1.0),))), "logit_bias"),
    (dict(sampling=SamplingParams(logit_bias=((3, float("inf")),))), "logit_bias"),
    (dict(sampling=SamplingParams(logprobs=MAX_TOP_LOGPROBS + 1)), "logprobs"),
    (dict(sampling=SamplingParams(presence_penalty=float("nan"))), "presence_penalty"),
    (dict(sampling=SamplingParams(frequency_penalty=float("inf"))), "frequency_penalty"),
    (dict(sampling=SamplingParams(repetition_penalty=0.0)), "repetition_penalty"),
    (dict(stop_ids=tuple(range(17))), "stop_token_ids"),
    (dict(output_from=99), "output_from"),
    (dict(choices=[]), "n"),
])
def test_bad_params_name_their_field(engine, kw, field):
    kw = {"sampling": GREEDY, **kw}
    with pytest.raises(InvalidRequest, match=field) as err:
        engine.prefill(prompt(5), kw.pop("sampling"), **kw)
    assert err.value.param == field
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        engine.prompt_logprobs(prompt(5), MAX_TOP_LOGPROBS + 1)
