"""A draft model's proposals (tandem_engine/draft.py): the draft's k greedy tokens after each row's
context, whatever the target kept of the last ones (its rows set back and fed again); with the
target as its own draft every proposal is kept; with another model the target's greedy output is
unchanged; rows that sat out catch up, by forced calls or a prefill; a context longer than the
draft can prefill is fed in part; a draft with another vocabulary is refused."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tandem_core.errors import ModelNotFound
from tandem_core.models import resolve_model
from tandem_core.types import SamplingParams
from tandem_engine import load_engine, reference_greedy
from tandem_engine.draft import DraftProposer, check_draft

GREEDY = SamplingParams()
MAX_LEN = 96
K = 4


def _engine(model="tiny", **kw):
    return load_engine(model, slots=4, max_len=MAX_LEN, prefill_buckets=(16, 64), kv_block_size=4, **kw)


@pytest.fixture(scope="module")
def target():
    return _engine()


def _run(target, proposer, prompts, n, idle=lambda call: False, drop=lambda call, slot: False, check=False):
    """Decode every prompt to n tokens with verify calls of the draft's proposals; `idle(call)`:
    the draft is not asked this call (the rows take a step: a loop's ordinary call);
    `drop(call, slot)`: the row's proposal is not checked (a paused row); `check`: every proposal
    is compared with the draft's own greedy continuation of the row's context. Returns (outputs,
    calls, kept, proposed)."""
    state = target.init_state()
    out = {}
    for slot, ids in enumerate(prompts):
        prefix = target.prefill(ids, GREEDY)
        state = target.insert(prefix, state, slot, GREEDY)
        out[slot] = [prefix.first_token]
    calls = kept = proposed = 0
    while min(len(o) for o in out.values()) < n:
        asked = {s: (("req", s), prompts[s] + o) for s, o in out.items()}
        props = {} if idle(calls) else proposer.propose(asked)
        for s, ids in props.items():  # the draft's greedy continuation of the row's context
            assert len(ids) == K
            if check:
                d = proposer.engine
                assert ids == reference_greedy(d.params, d.cfg, asked[s][1], K, pad_to=MAX_LEN), (calls, s)
        state, spec = target.verify(state, {s: p for s, p in props.items() if not drop(calls, s)}, K, len(prompts))
        calls += 1
        for s in out:
            out[s].extend(spec.tokens[s, :spec.counts[s]].tolist())
            kept += int(spec.counts[s]) - 1
            proposed += int(spec.proposed[s])
    for s in out:
        state = target.free(state, s)
    return {s: o[:n] for s, o in out.items()}, calls, kept, proposed


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 250, n).tolist() for n in (7, 19, 33)]


def test_the_target_as_its_own_draft_has_every_proposal_kept(target):
    prompts, n = _prompts(), 40
    want = {s: reference_greedy(target.params, target.cfg, p, n, pad_to=MAX_LEN) for s, p in enumerate(prompts)}
    proposer = DraftProposer(_engine(), K)
    got, calls, kept, proposed = _run(target, proposer, prompts, n)
    assert got == want
    assert kept >= 0.95 * proposed > 0  # (float ties aside) the draft is the target
    assert calls <= n // (K + 1) + 2
    assert proposer.seats == len(prompts)  # seated once; every later call fed the row one or two tokens


def test_another_draft_leaves_the_greedy_output_as_it_was_and_rows_catch_up(target):
    prompts, n = _prompts(), 48
    want = {s: reference_greedy(target.params, target.cfg, p, n, pad_to=MAX_LEN) for s, p in enumerate(prompts)}
    other = dataclasses.replace(resolve_model("tiny"), seed=7, name="tiny-seed7")
    proposer = DraftProposer(_engine_of(other), K)
    got, _calls, kept, proposed = _run(target, proposer, prompts, n, check=True)
    assert got == want
    assert proposed > kept  # a random other model: some proposals rejected (rows set back)
    # calls the draft sits out (ordinary steps) and proposals not checked: the rows are fed the
    # gap over their kept KV, catch_up + 1 = 4 tokens a forced call (a 4-token gap and the next
    # input: two calls), and none is seated again
    idle = lambda call: call % 9 in (1, 2, 4, 5, 6, 7)  # noqa: E731  gaps of 2 and 4 tokens
    proposer = DraftProposer(_engine_of(other), K, catch_up=3)
    got, _calls, kept, proposed = _run(target, proposer, prompts, n, idle, lambda call, slot: slot == 1 and call % 2,
                                       check=True)
    assert got == want
    assert proposer.seats == len(prompts) and proposer.calls < proposer.rounds < 2 * proposer.calls
    # one forced call at most: a row that needs two is seated again by a prefill
    proposer = DraftProposer(_engine_of(other), K, catch_up=3, max_rounds=1)
    got, _calls, kept, proposed = _run(target, proposer, prompts, n, idle, lambda call, slot: slot == 1 and call % 2,
                                       check=True)
    assert got == want
    assert len(prompts) < proposer.seats < proposer.calls * len(prompts) and proposer.rounds == proposer.calls
    proposer = DraftProposer(_engine(), K, catch_up=3)
    got, _calls, kept, proposed = _run(target, proposer, prompts, n, idle, lambda call, slot: slot == 1 and call % 2)
    assert got == want
    assert kept >= 0.95 * proposed > 0  # caught up exactly: the target as its draft still has all kept


def test_a_context_longer_than_the_drafts_largest_prefill_is_seated_in_part_and_fed_the_rest():
    """Contexts of 70 and 83 tokens, the draft's prefill buckets (16, 64): each row is seated by
    a prefill of its first 64 tokens and fed the rest by forced calls, max_rounds of them a
    dispatch; a row not caught up proposes nothing that time and catches up on the next. Its
    proposals are then the draft's own greedy ones (so its KV is whole), and with the target as its
    own draft they are kept."""
    rng = np.random.default_rng(1)
    prompts, n = [rng.integers(3, 250, m).tolist() for m in (70, 83)], 8
    target = load_engine("tiny", slots=4, max_len=MAX_LEN, prefill_buckets=(16, 88), kv_block_size=4)
    want = {s: reference_greedy(target.params, target.cfg, p, n, pad_to=MAX_LEN) for s, p in enumerate(prompts)}
    proposer = DraftProposer(_engine(), K, max_rounds=2)  # 6 tokens a call: 7 and 20 to feed
    got, calls, kept, proposed = _run(target, proposer, prompts, n, check=True)
    assert got == want
    assert proposer.seats == 2 and proposer.lagging == 1  # the 83-token row waited one dispatch
    assert kept >= 0.95 * proposed > 0 and calls < n
    assert all(len(r.fed) > 64 for r in proposer.rows.values())


def test_a_changed_request_or_a_row_not_asked_for_is_freed(target):
    proposer = DraftProposer(_engine(), K)
    ctx = list(range(3, 20))
    first = proposer.propose({0: ("a", ctx), 1: ("b", ctx)})
    assert set(first) == {0, 1} and first[0] == first[1]
    blocks = proposer.engine.kv_blocks_free()
    again = proposer.propose({0: ("c", ctx)})  # slot 0 holds another request now; slot 1 finished
    assert again[0] == first[0] and set(proposer.rows) == {0}
    assert proposer.engine.kv_blocks_free() > blocks
    assert proposer.propose({0: ("c", list(range(3, 3 + MAX_LEN - K + 1)))}) == {}  # no room for k more
    assert proposer.rows == {}


def _engine_of(info, **shape):
    """An Engine of `info`'s random weights (the test's shape unless `shape` says otherwise)."""
    from tandem_engine.engine import Engine
    from tandem_engine.weights import load_params
    shape = {"slots": 4, "max_len": MAX_LEN, "prefill_buckets": (16, 64), "kv_block_size": 4, **shape}
    return Engine(info, load_params(info, "float32"), **shape)


def test_a_draft_must_share_the_target_vocabulary():
    tiny = resolve_model("tiny")
    check_draft(tiny, dataclasses.replace(tiny, num_layers=1))
    with pytest.raises(ModelNotFound, match="vocabulary of 2048 tokens against the target's 258"):
        check_draft(tiny, resolve_model("builtin"))


@pytest.mark.slow
def test_a_sampling_draft_draws_from_the_q_it_hands_on_and_the_output_keeps_the_targets_distribution():
    """DraftProposer(sample=True) with a one-layer draft of the target (q near p, not p): each
    row's first proposal is drawn from last_q (a goodness-of-fit test), the verify call keeps it
    at the rate sum min(p, q) (the q-aware rule; the one-token rule would keep sum p q), and
    4,096 seeded two-token outputs spread as 4,096 without speculation (chi-square test of
    homogeneity). A greedy row's proposals stay its greedy ones, with one-hot q."""
    from collections import Counter

    from scipy.stats import chi2_contingency, chisquare

    shape = dict(slots=32, max_len=32, prefill_buckets=(16,), kv_block_size=4)
    target = load_engine("tiny", **shape)
    one = dataclasses.replace(resolve_model("tiny"), num_layers=1, name="tiny-1-layer")
    draft = _engine_of(one, **shape)
    proposer = DraftProposer(draft, 2, sample=True)
    prompt = [11, 42, 7, 99, 3, 250, 18]
    vocab = target.info.vocab_size
    first = target.prefill(prompt, GREEDY).first_token
    ctx = prompt + [first]

    def dist(engine):
        logits = np.asarray(engine.prompt_logits(ctx), np.float64).reshape(-1, vocab)[-1] / 0.6
        logits[np.argsort(-logits, kind="stable")[5:]] = -np.inf
        p = np.exp(logits - logits.max())
        return p / p.sum()

    p0, q0 = dist(target), dist(draft)
    prefix = target.prefill(prompt, GREEDY)
    plain, spec, x0s = Counter(), Counter(), Counter()
    kept = 0
    batches = 4096 // target.slots
    for i in range(batches):
        for out, speculate in ((plain, False), (spec, True)):
            state = target.init_state()
            asked = {}
            for s in range(target.slots):
                pick = SamplingParams(temperature=0.6, top_k=5, seed=7919 * i + s)
                state = target.insert(prefix, state, s, pick)
                asked[s] = (("batch", i, s), ctx, dataclasses.replace(pick, seed=31 * i + s))
            if speculate:
                props = proposer.propose(asked)
                assert np.allclose(np.asarray(proposer.last_q)[:target.slots, 0], q0, atol=1e-5)
                x0s.update(p[0] for p in props.values())
                state, got = target.verify(state, props, 2, draft_probs=proposer.last_q)
                state, again = target.generate(state)
                again = np.asarray(again).tolist()
                out.update((int(got.tokens[s, 0]), int(got.tokens[s, 1]) if got.counts[s] >= 2 else again[s])
                           for s in range(target.slots))
                kept += int(np.sum(got.counts[:target.slots] >= 2))
            else:
                state, a = target.generate(state)
                state, b = target.generate(state)
                out.update(zip(np.asarray(a).tolist(), np.asarray(b).tolist()))
    n = batches * target.slots
    support = np.flatnonzero(q0)
    assert chisquare([x0s[int(t)] for t in support], q0[support] * n).pvalue > 1e-3, (x0s, q0[support])
    rate, point_rate = np.minimum(p0, q0).sum(), (p0 * q0).sum()
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert rate - point_rate > 10 * sigma and abs(kept / n - rate) < 5 * sigma, (kept / n, rate, point_rate)
    common = [p for p in set(plain) | set(spec) if plain[p] + spec[p] >= 20]
    rows = [[plain[p] for p in common], [spec[p] for p in common]]
    assert len(common) >= 8
    assert chi2_contingency(np.asarray(rows)).pvalue > 1e-3, (common, rows)
    greedy = proposer.propose({0: ("greedy", ctx)})[0]  # no sampling given: greedy, q one-hot
    q = np.asarray(proposer.last_q)[0]
    assert greedy == reference_greedy(draft.params, draft.cfg, ctx, 2, pad_to=32)
    assert np.array_equal(q, np.eye(vocab, dtype=np.float32)[greedy])
