"""A batched prefill (`Engine.prefill_batch`: several prompts of one bucket in one forward pass) gives
each prompt what `Engine.prefill` gives it alone: the same first token (greedy and seeded), the
same logprobs and the same exported KV (to float rounding: a batch's matmuls block rows
differently), over the built-in test model and the families whose attention differs (sliding
windows, sinks, experts). Prompts of different buckets, or a bad prompt, raise for the batch.
"""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.errors import InvalidRequest
from tandem_core.types import SamplingParams
from tandem_engine import PrefillCall, load_engine

KV_TOL = 1e-5  # relative to the KV's largest magnitude


def _calls(vocab: int, lengths, seed: int = 0) -> list[PrefillCall]:
    """Prompts of the given lengths with every kind of first-token processing a batch row carries."""
    rng = np.random.default_rng(seed)
    kinds = [
        dict(sampling=SamplingParams()),
        dict(sampling=SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, logprobs=3)),
        dict(sampling=SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logit_bias=((3, 5.0),))),
        dict(sampling=SamplingParams(min_tokens=4), stop_ids=(1, 2)),
        dict(sampling=SamplingParams(temperature=1.2, seed=11), start_index=3),  # a resumed request
    ]
    out = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, vocab, n).tolist()
        kw = dict(kinds[i % len(kinds)])
        if "start_index" in kw:
            kw["output_from"] = n - kw["start_index"]
        out.append(PrefillCall(ids, **kw))
    return out


def _single(engine, c: PrefillCall):
    return engine.prefill(c.prompt_ids, c.sampling, start_index=c.start_index, output_from=c.output_from,
                          stop_ids=c.stop_ids)


def assert_same(engine, calls: list[PrefillCall]) -> None:
    batch = engine.prefill_batch(calls)
    assert len(batch) == len(calls)
    for i, (c, b) in enumerate(zip(calls, batch)):
        one = _single(engine, c)
        assert b.first_tokens == one.first_tokens, f"prompt {i}: first token differs from its prefill alone"
        assert b.true_length == one.true_length == len(c.prompt_ids)
        if c.sampling.logprobs is not None:
            (lb,), (lo,) = b.first_logprobs, one.first_logprobs
            assert [t for t, _ in lb.top] == [t for t, _ in lo.top]
            np.testing.assert_allclose([lb.logprob] + [x for _, x in lb.top], [lo.logprob] + [x for _, x in lo.top],
                                       rtol=1e-5, atol=1e-5)
        else:
            assert b.first_logprobs == [None]
        pb, po = engine.export_prefix(b), engine.export_prefix(one)
        assert pb.k.shape == po.k.shape and pb.first_token == po.first_token
        for x, y in ((pb.k, po.k), (pb.v, po.v)):
            scale = float(np.abs(y).max())
            assert float(np.abs(x - y).max()) <= KV_TOL * scale, f"prompt {i}: KV differs from its prefill alone"


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=2, max_len=128, prefill_buckets=(16, 64))


def test_a_batch_gives_each_prompt_its_own_prefill(engine):
    # 7 prompts of the 64 bucket: passes of 4, 2 and 1 rows; lengths differ inside the bucket
    assert_same(engine, _calls(engine.info.vocab_size, [17, 64, 40, 33, 50, 29, 61]))


def test_a_batch_of_one_and_of_a_short_bucket(engine):
    assert_same(engine, _calls(engine.info.vocab_size, [9], seed=1))
    assert_same(engine, _calls(engine.info.vocab_size, [3, 16], seed=2))


def test_prompts_of_different_buckets_are_refused(engine):
    calls = _calls(engine.info.vocab_size, [10, 40])
    with pytest.raises(ValueError, match="one bucket"):
        engine.prefill_batch(calls)


def test_one_bad_prompt_raises_for_the_batch(engine):
    calls = _calls(engine.info.vocab_size, [20, 20])
    calls[1] = PrefillCall([0, engine.info.vocab_size + 5], SamplingParams())
    with pytest.raises(InvalidRequest, match="prompt token ids"):
        engine.prefill_batch(calls)


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "mixtral"])
def test_families_batch_like_one_at_a_time(family, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.families import FAMILIES, build_family

    build_family(family, tmp_path, seed=FAMILIES.index(family))
    e = load_engine(str(tmp_path), slots=2, max_len=128, prefill_buckets=(16, 64))
    assert_same(e, _calls(256, [40, 13 + 20, 64], seed=3))  # longer than the windows (8)


def test_deferred_compiles_group_only_warm_row_counts():
    """A pod defers batched compiles (`defer_batch_compiles`): `prefill_batch` then groups only the
    row counts `warm_batch` compiled, so a request never waits for a compilation; the prefixes
    stay what each prompt gives alone."""
    from tandem_engine.cores import prefill_batch_core

    # buckets no other test uses: the compiled-shape counts below are this test's own
    engine = load_engine("tiny", slots=2, max_len=64, prefill_buckets=(24, 40))
    assert engine.batch_shapes(96) == [(24, 2), (24, 4), (40, 2)]
    engine.defer_batch_compiles()
    calls = _calls(engine.info.vocab_size, [5, 9, 12])
    engine.warmup_prefill()
    compiled = prefill_batch_core._cache_size()
    assert_same(engine, calls)  # nothing warm: three prompts alone
    assert prefill_batch_core._cache_size() == compiled, "a request compiled a batched prefill"
    engine.warm_batch(24, 2)
    assert prefill_batch_core._cache_size() == compiled + 1
    assert_same(engine, calls)  # 2 + 1: the compiled pair, then one alone
    assert prefill_batch_core._cache_size() == compiled + 1
    assert engine._group_rows(24, 3) == 2 and engine._group_rows(24, 1) == 1 and engine._group_rows(40, 4) == 1
