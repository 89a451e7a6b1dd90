"""Speculative decoding's verify call (`DecodeSide.verify`, speculative.py): a greedy row's output
is the non-speculative output token for token whatever is proposed (the true continuation, noise,
n-gram lookups, nothing); a sampled row's emitted tokens follow the target's distribution exactly
(a chi-square test against the distribution the step itself samples from); rejected proposals'
blocks go back to the pool; the n-gram proposer finds the latest earlier match."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core.types import SamplingParams
from tandem_engine import load_engine, reference_greedy
from tandem_engine.speculative import NgramIndex, ngram_propose

GREEDY = SamplingParams()
MAX_LEN = 96
K = 4


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=4, max_len=MAX_LEN, prefill_buckets=(16, 64), kv_block_size=4)


def test_ngram_proposer_takes_what_followed_the_latest_earlier_match():
    assert ngram_propose([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7], k=3) == [9, 2, 5]
    assert ngram_propose([1, 2, 3, 4], k=2) == []  # no suffix recurs
    assert ngram_propose([4, 1, 2, 9, 9, 4], k=2, max_n=3) == [1, 2]  # a 1-gram when no longer one matches
    assert ngram_propose([7, 7, 7], k=4) == [7]  # what follows is cut at the end
    assert ngram_propose([1, 2, 1, 2, 1, 2], k=3, max_n=2) == [1, 2, 1]  # not the latest match: 2 tokens follow it
    assert ngram_propose([1, 2], k=0) == []


def test_the_incremental_ngram_index_proposes_what_the_scan_does():
    rng = np.random.default_rng(1)
    for trial in range(200):
        vocab, max_n = int(rng.integers(2, 12)), int(rng.integers(1, 5))
        min_n = int(rng.integers(1, max_n + 1))
        tokens = rng.integers(0, vocab, int(rng.integers(4, 60))).tolist()
        if trial % 3 == 0:  # periodic: the latest match is a period back
            tokens = (tokens[:5] * 20)[:60]
        index = NgramIndex(tokens[:3], max_n, min_n)
        for t in tokens[3:]:
            for k in range(1, 6):
                assert index.propose(k) == ngram_propose(index.seq, k, max_n, min_n), (index.seq, k, max_n, min_n)
            index.extend([t])


def _seat(engine, prompts, sampling=GREEDY):
    state = engine.init_state()
    out = {}
    for slot, ids in enumerate(prompts):
        prefix = engine.prefill(ids, sampling)
        state = engine.insert(prefix, state, slot, sampling)
        out[slot] = [prefix.first_token]
    return state, out


def _speculate(engine, prompts, n, propose):
    """Decode every prompt to n tokens with verify calls; propose(slot, prompt + output) -> ids."""
    state, out = _seat(engine, prompts)
    calls = 0
    while min(len(o) for o in out.values()) < n:
        proposals = {s: propose(s, prompts[s] + o) for s, o in out.items()}
        state, spec = engine.verify(state, proposals, K, len(prompts))
        calls += 1
        for s in out:
            out[s].extend(spec.tokens[s, :spec.counts[s]].tolist())
        assert engine.kv_blocks_of(0) <= engine.kv_blocks_for(len(prompts[0]) + len(out[0]))  # none past the next position
    return {s: o[:n] for s, o in out.items()}, calls


def test_greedy_rows_emit_the_non_speculative_tokens_whatever_is_proposed(engine):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (7, 19, 33)]
    prompts[1] = prompts[1][:6] * 3  # a repeating prompt: the n-gram lookup finds matches
    n = 40
    want = {s: reference_greedy(engine.params, engine.cfg, p, n, pad_to=MAX_LEN) for s, p in enumerate(prompts)}
    truth, calls = _speculate(engine, prompts, n, lambda s, seq: want[s][len(seq) - len(prompts[s]):][:K])
    assert truth == want
    assert calls <= n // (K + 1) + 2  # every proposal kept: k + 1 tokens a call
    noise, calls = _speculate(engine, prompts, n, lambda s, seq: rng.integers(3, 250, K).tolist())
    assert noise == want
    ngram, _ = _speculate(engine, prompts, n, lambda s, seq: ngram_propose(seq, K))
    assert ngram == want
    mixed, _ = _speculate(engine, prompts, n, lambda s, seq: [] if s == 1 else
                          want[s][len(seq) - len(prompts[s]):][:2] + [0, 0])
    assert mixed == want


def test_penalties_and_min_tokens_see_the_proposals_before_them(engine):
    """A penalised greedy row: each query's logits are processed as if the proposals before it
    were output (the history counts them), so verify emits what plain steps emit."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 250, 9).tolist() * 2, rng.integers(3, 250, 12).tolist()]
    picks = [SamplingParams(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.3),
             SamplingParams(min_tokens=12, logit_bias=((5, 3.0),))]
    n = 30

    def seat():
        state = engine.init_state()
        out = {}
        for slot, (ids, pick) in enumerate(zip(prompts, picks)):
            prefix = engine.prefill(ids, pick, stop_ids=[7, 9])
            state = engine.insert(prefix, state, slot, pick, stop_ids=[7, 9])
            out[slot] = [prefix.first_token]
        return state, out

    state, plain = seat()
    for _ in range(n - 1):
        state, tokens = engine.generate(state, 2)
        for s in plain:
            plain[s].append(int(np.asarray(tokens)[s]))
    for s in plain:
        state = engine.free(state, s)
    for propose in (lambda s, seq: plain[s][len(seq) - len(prompts[s]):][:K],
                    lambda s, seq: ngram_propose(seq, K)):
        state, out = seat()
        while min(len(o) for o in out.values()) < n:
            state, spec = engine.verify(state, {s: propose(s, prompts[s] + o) for s, o in out.items()}, K, 2)
            for s in out:
                out[s].extend(spec.tokens[s, :spec.counts[s]].tolist())
        for s in out:
            state = engine.free(state, s)
        assert {s: o[:n] for s, o in out.items()} == plain


def test_rejected_proposals_give_their_blocks_back(engine):
    state, out = _seat(engine, [list(range(3, 13))])  # 10 prompt tokens: the first token's input at position 10
    free, held = engine.kv_blocks_free(), engine.kv_blocks_of(0)
    assert held == 3  # blocks of 4: positions 0-11
    state, spec = engine.verify(state, {0: [0, 0, 0, 0]}, K, 1)  # positions 10..14: a 4th block reserved
    assert spec.counts[0] == 1  # noise: nothing kept (the first proposal already wrong)
    assert engine.kv_blocks_of(0) == 3  # position 11 next: the block past it went back
    assert engine.kv_blocks_free() == free
    engine.free(state, 0)


PROMPT = [11, 42, 7, 99, 3, 250, 18]


def _first_draws(engine, sampling, proposal, draws):
    """Counts of the token a verify call emits first after PROMPT and its greedy first token, a
    row per seed, `proposal` checked in every row."""
    counts = np.zeros(engine.info.vocab_size, np.int64)
    prefix = engine.prefill(PROMPT, GREEDY)
    for i in range(draws // engine.slots):
        state = engine.init_state()
        for s in range(engine.slots):
            pick = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, seed=1000 * i + s)
            state = engine.insert(prefix, state, s, pick)
        state, spec = engine.verify(state, {s: [proposal] for s in range(engine.slots)}, 1)
        assert (spec.counts == np.where(spec.tokens[:, 0] == proposal, 2, 1)).all()
        np.add.at(counts, spec.tokens[:, 0], 1)
        for s in range(engine.slots):
            state = engine.free(state, s)
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_rows_emit_the_targets_distribution(top_k):
    from scipy.stats import chisquare

    engine = load_engine("tiny", slots=32, max_len=32, prefill_buckets=(16,), kv_block_size=4)
    first = engine.prefill(PROMPT, GREEDY).first_token
    logits = np.asarray(engine.prompt_logits(PROMPT + [first]), np.float64).reshape(-1, engine.info.vocab_size)[-1]
    logits /= 0.6
    order = np.argsort(-logits, kind="stable")
    if top_k:
        logits[order[top_k:]] = -np.inf
    p = np.exp(logits - logits.max())
    p /= p.sum()
    proposal = int(order[0])
    assert 0.05 < p[proposal] < 0.95  # both paths run: kept and redrawn
    counts = _first_draws(engine, SamplingParams(temperature=0.6, top_k=top_k), proposal, 4096)
    top = order[:8]
    observed = np.append(counts[top], counts.sum() - counts[top].sum())
    expected = np.append(p[top], max(0.0, 1 - p[top].sum())) * counts.sum()
    keep = expected > 5
    stat = chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum())
    assert stat.pvalue > 1e-3, (observed, expected.round(1))


def _pairs(engine, sampling, proposals, draws, masks=None):
    """Counts of the first two tokens each row emits after PROMPT and its greedy first token: with
    `proposals` [x0, x1] checked in a verify call (a second call where it kept neither), or with
    plain steps (None). `masks` (mask0, mask1): int32 [words] each, the allowed tokens at the
    first and the second position (a grammar that allows by position), for every row."""
    from collections import Counter

    counts: Counter = Counter()
    prefix = engine.prefill(PROMPT, GREEDY)
    for i in range(draws // engine.slots):
        state = engine.init_state()
        for s in range(engine.slots):
            pick = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, seed=7919 * i + s)
            state = engine.insert(prefix, state, s, pick)
        at = [None, None] if masks is None else [np.tile(m, (engine.slots, 1)) for m in masks]
        if proposals is None:
            state, a = engine.generate(state, masks=at[0])
            state, b = engine.generate(state, masks=at[1])
            got = list(zip(np.asarray(a).tolist(), np.asarray(b).tolist()))
        else:
            vm = None if masks is None else np.stack([at[0], at[1], np.full_like(at[1], -1)], axis=1)
            state, spec = engine.verify(state, {s: proposals for s in range(engine.slots)}, 2, masks=vm)
            state, again = engine.generate(state, masks=at[1])
            again = np.asarray(again).tolist()
            got = [(int(spec.tokens[s, 0]), int(spec.tokens[s, 1]) if spec.counts[s] >= 2 else again[s])
                   for s in range(engine.slots)]
        counts.update(got[:engine.slots])
        for s in range(engine.slots):
            state = engine.free(state, s)
    return counts


@pytest.mark.slow
def test_sampled_two_token_outputs_are_distributed_as_without_speculation():
    """Two-token outputs of a seeded sample, 4,096 with speculation (the greedy pair proposed:
    kept, kept-then-redrawn, redrawn at once all happen) and 4,096 without: a chi-square test of
    homogeneity over the pairs seen often enough, the rest pooled."""
    from scipy.stats import chi2_contingency

    engine = load_engine("tiny", slots=32, max_len=32, prefill_buckets=(16,), kv_block_size=4)
    sampling = SamplingParams(temperature=0.6, top_k=5)
    first = engine.prefill(PROMPT, GREEDY).first_token
    x0 = int(np.argmax(np.asarray(engine.prompt_logits(PROMPT + [first])).reshape(-1)))
    x1 = int(np.argmax(np.asarray(engine.prompt_logits(PROMPT + [first, x0])).reshape(-1)))
    plain = _pairs(engine, sampling, None, 4096)
    spec = _pairs(engine, sampling, [x0, x1], 4096)
    common = [p for p in set(plain) | set(spec) if plain[p] + spec[p] >= 20]
    rows = [[plain[p] for p in common], [spec[p] for p in common]]
    rest = [sum(plain.values()) - sum(rows[0]), sum(spec.values()) - sum(rows[1])]
    if min(rest) > 5:
        rows = [r + [x] for r, x in zip(rows, rest)]
    assert len(common) >= 8 and plain[(x0, x1)] > 100  # a spread sample; the proposed pair common
    assert chi2_contingency(np.asarray(rows)).pvalue > 1e-3, (common, rows)


def _bits(ids, vocab: int) -> np.ndarray:
    row = np.zeros((vocab + 31) // 32, np.uint32)
    for t in ids:
        row[t >> 5] |= np.uint32(1 << (t & 31))
    return row.view(np.int32)


@pytest.mark.slow
def test_sampled_two_token_outputs_under_grammar_masks_are_distributed_as_without_speculation():
    """The same under grammar masks (each query masked as the plain step at its position): the
    allowed sets leave out the model's favourite tokens, and the greedy pair within them is
    proposed. The pairs all lie in the allowed sets, and spread as the plain steps' do."""
    from scipy.stats import chi2_contingency

    engine = load_engine("tiny", slots=32, max_len=32, prefill_buckets=(16,), kv_block_size=4)
    vocab = engine.info.vocab_size
    sampling = SamplingParams(temperature=1.0)
    first = engine.prefill(PROMPT, GREEDY).first_token
    l0 = np.asarray(engine.prompt_logits(PROMPT + [first])).reshape(-1)
    a = [int(t) for t in np.argsort(-l0)[2:7]]  # five allowed first tokens, not the two likeliest
    x0 = a[0]
    l1 = np.asarray(engine.prompt_logits(PROMPT + [first, x0])).reshape(-1)
    b = [int(t) for t in np.argsort(-l1)[1:6]]
    x1 = b[0]
    masks = (_bits(a, vocab), _bits(b, vocab))
    plain = _pairs(engine, sampling, None, 2048, masks)
    spec = _pairs(engine, sampling, [x0, x1], 2048, masks)
    assert all(p in a and q in b for p, q in list(plain) + list(spec))
    common = [p for p in set(plain) | set(spec) if plain[p] + spec[p] >= 20]
    rows = [[plain[p] for p in common], [spec[p] for p in common]]
    rest = [sum(plain.values()) - sum(rows[0]), sum(spec.values()) - sum(rows[1])]
    if min(rest) > 5:
        rows = [r + [x] for r, x in zip(rows, rest)]
    assert len(common) >= 8 and spec[(x0, x1)] > 20
    assert chi2_contingency(np.asarray(rows)).pvalue > 1e-3, (common, rows)


def _drafted_pairs(engine, sampling, draft, draws):
    """Counts of the first two tokens each row emits after PROMPT and its greedy first token, with
    the proposals a sampling proposer drew checked in a verify call (a second call where it kept
    neither): draft(batch, slot) -> ([x0, x1], q [2, vocab]), x_i drawn from q[i]. Returns the
    counts and how many rows kept x0."""
    from collections import Counter

    counts: Counter = Counter()
    kept = 0
    prefix = engine.prefill(PROMPT, GREEDY)
    for i in range(draws // engine.slots):
        state = engine.init_state()
        proposals, q = {}, np.zeros((engine.slots, 2, engine.info.vocab_size), np.float32)
        for s in range(engine.slots):
            pick = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, seed=7919 * i + s)
            state = engine.insert(prefix, state, s, pick)
            proposals[s], q[s] = draft(i, s)
        state, spec = engine.verify(state, proposals, 2, draft_probs=q)
        state, again = engine.generate(state)
        again = np.asarray(again).tolist()
        counts.update((int(spec.tokens[s, 0]), int(spec.tokens[s, 1]) if spec.counts[s] >= 2 else again[s])
                      for s in range(engine.slots))
        kept += int(np.sum(spec.counts[:engine.slots] >= 2))
        for s in range(engine.slots):
            state = engine.free(state, s)
    return counts, kept


def _homogeneous(plain, spec, least=8):
    """Chi-square test of homogeneity of two samples' counts (pairs seen >= 20 times, the rest
    pooled): its p-value, after checking the sample is spread."""
    from scipy.stats import chi2_contingency

    common = [p for p in set(plain) | set(spec) if plain[p] + spec[p] >= 20]
    rows = [[plain[p] for p in common], [spec[p] for p in common]]
    rest = [sum(plain.values()) - sum(rows[0]), sum(spec.values()) - sum(rows[1])]
    if min(rest) > 5:
        rows = [r + [x] for r, x in zip(rows, rest)]
    assert len(common) >= least, common
    return chi2_contingency(np.asarray(rows)).pvalue, (common, rows)


@pytest.mark.slow
def test_proposals_drawn_from_a_distribution_q_leave_the_output_distributed_as_without_speculation():
    """A sampling proposer (a draft model that samples): x0 ~ q0, x1 ~ q1, q handed to the verify
    call, which keeps x_i with probability min(1, p_i / q_i) and redraws from max(0, p_i - q_i).
    q is the target's own distribution at a higher temperature over ten tokens, so it puts mass
    where top-k leaves p none (always rejected), and less or more than p on the rest: kept,
    kept-then-redrawn and redrawn at once all happen. Two-token outputs of 4,096 seeded rows
    with speculation and 4,096 without: a chi-square test of homogeneity. And q is used: x0 is
    kept at the rate sum min(p0, q0), not sum p0 q0, the rate of the rule for a proposal that
    names one token (which is exact too, whatever drew the proposal, but keeps fewer)."""
    engine = load_engine("tiny", slots=32, max_len=32, prefill_buckets=(16,), kv_block_size=4)
    vocab = engine.info.vocab_size
    sampling = SamplingParams(temperature=0.6, top_k=5)
    first = engine.prefill(PROMPT, GREEDY).first_token

    def flat(ids):  # q: softmax at temperature 1.5 over the ten likeliest tokens after `ids`
        logits = np.asarray(engine.prompt_logits(PROMPT + [first] + ids), np.float64).reshape(-1, vocab)[-1]
        top = np.argsort(-logits, kind="stable")[:10]
        q = np.zeros(vocab)
        q[top] = np.exp((logits[top] - logits[top].max()) / 1.5)
        return q / q.sum()

    q0 = flat([])
    q1 = {x: flat([x]) for x in np.flatnonzero(q0)}  # q1 given x0
    rng = np.random.default_rng(5)

    def draft(_batch, _slot):
        x0 = int(rng.choice(vocab, p=q0))
        x1 = int(rng.choice(vocab, p=q1[x0]))
        return [x0, x1], np.stack([q0, q1[x0]]).astype(np.float32)

    plain = _pairs(engine, sampling, None, 4096)
    spec, kept = _drafted_pairs(engine, sampling, draft, 4096)
    pvalue, seen = _homogeneous(plain, spec)
    assert pvalue > 1e-3, seen
    logits = np.asarray(engine.prompt_logits(PROMPT + [first]), np.float64).reshape(-1, vocab)[-1] / 0.6
    logits[np.argsort(-logits, kind="stable")[5:]] = -np.inf
    p0 = np.exp(logits - logits.max())
    p0 /= p0.sum()
    rate, point_rate = np.minimum(p0, q0).sum(), (p0 * q0).sum()
    sigma = np.sqrt(rate * (1 - rate) / 4096)
    assert rate - point_rate > 10 * sigma  # the two rules are told apart
    assert abs(kept / 4096 - rate) < 5 * sigma, (kept / 4096, rate, point_rate)


def _grammar_pairs(engine, grammars, spec, sampling, draws, draft=None, drawn=True):
    """Counts of the first two tokens each row emits after PROMPT and its greedy first token under
    the grammar `spec`, every position masked by the row's own Matcher as the decode loop masks it:
    with plain steps (`draft` None), or with the proposals a sampling proposer drew (draft(batch,
    slot) -> ([x0, x1], q [2, vocab])) cut by Matcher.proposal_masks (`drawn` as the loop passes it
    for a sampling draft) and checked in a verify call under its masks, then plain steps for the
    rest. A complete grammar's masks allow EOS alone, so its forced EOS is drawn as the loop emits it.
    The two samples' rows have seeds of their own (shared seeds would correlate them)."""
    from collections import Counter

    counts: Counter = Counter()
    words = (engine.info.vocab_size + 31) // 32
    prefix = engine.prefill(PROMPT, GREEDY)
    for i in range(draws // engine.slots):
        state = engine.init_state()
        matchers = [grammars.matcher(spec) for _ in range(engine.slots)]
        for s in range(engine.slots):
            pick = SamplingParams(temperature=sampling.temperature, seed=7919 * i + s + (0 if draft is None else 1 << 20))
            state = engine.insert(prefix, state, s, pick)
        got: list[list[int]] = [[] for _ in range(engine.slots)]
        if draft is not None:
            vm = np.full((engine.slots, 3, words), -1, np.int32)
            proposals, q = {}, np.zeros((engine.slots, 2, engine.info.vocab_size), np.float32)
            for s, m in enumerate(matchers):
                ids, q[s] = draft(i, s)
                vm[s, 0] = m.mask()
                n = m.proposal_masks(ids, None, vm[s], drawn=drawn)
                if n:
                    proposals[s] = ids[:n]
            state, out = engine.verify(state, proposals, 2, masks=vm, draft_probs=q)
            for s, m in enumerate(matchers):
                for t in np.asarray(out.tokens[s, :min(2, int(out.counts[s]))]).tolist():
                    got[s].append(int(t))
                    m.consume(int(t))
        while any(len(g) < 2 for g in got):
            state, step = engine.generate(state, masks=np.stack([m.mask() for m in matchers]))
            for s, t in enumerate(np.asarray(step).tolist()):
                if len(got[s]) < 2:
                    got[s].append(int(t))
                    matchers[s].consume(int(t))
        counts.update(tuple(g) for g in got)
        for s in range(engine.slots):
            state = engine.free(state, s)
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("drawn", [True, False])
def test_drawn_proposals_under_a_grammar_leave_the_output_distributed_as_without_speculation(drawn):
    """A sampling draft under a grammar (regex [a-h]{1,3}: at the first position 40 of the
    vocabulary's tokens, some of which complete it): x0 ~ q0, x1 ~ q1(x0), q half on likely
    allowed tokens (in proportion to p squared, so kept, kept-then-redrawn and redrawn all happen)
    and half on tokens the grammar rejects. Matcher.proposal_masks with `drawn` keeps a proposal up
    to its first rejected token, which the call rejects surely (p = 0 under its mask), drawing
    from max(0, p - q): two-token outputs of 4,096 seeded rows are distributed as 4,096 without
    speculation (chi-square test of homogeneity). Cut before that token instead (`drawn` False, a
    greedy proposal's rule), the draw decides where the proposal ends, and the output leans to
    the tokens q favours: the same test tells the two samples apart."""
    from tandem_core.grammar import Grammars

    engine = load_engine("tiny", slots=32, max_len=32, prefill_buckets=(16,), kv_block_size=4)
    vocab = engine.info.vocab_size
    grammars = Grammars(engine.info)
    spec = {"kind": "regex", "pattern": "[a-h]{1,3}"}
    sampling = SamplingParams(temperature=1.0)
    first = engine.prefill(PROMPT, GREEDY).first_token
    rejected = [int(t) for t in np.flatnonzero(~np.unpackbits(grammars.matcher(spec).mask().view(np.uint8),
                                                               bitorder="little")[:vocab].astype(bool))[100:103]]

    def q_after(ids):  # half on the three likeliest allowed tokens (as p squared), half on rejected ones
        m = grammars.matcher(spec, ids)
        allowed = np.flatnonzero(np.unpackbits(m.mask().view(np.uint8), bitorder="little")[:vocab])
        logits = np.asarray(engine.prompt_logits(PROMPT + [first] + ids), np.float64).reshape(-1, vocab)[-1]
        top = allowed[np.argsort(-logits[allowed], kind="stable")[:3]]
        q = np.zeros(vocab)
        q[top] = 0.5 * np.exp(2 * (logits[top] - logits[top].max())) / np.exp(2 * (logits[top] - logits[top].max())).sum()
        q[rejected] += 0.5 / len(rejected)
        return q

    q0 = q_after([])
    fallback = np.zeros(vocab)
    fallback[rejected] = 1.0 / len(rejected)  # (after a rejected x0, x1 is never checked)
    q1 = {int(x): (q_after([int(x)]) if int(x) not in rejected else fallback) for x in np.flatnonzero(q0)}
    rng = np.random.default_rng(11)

    def draft(_batch, _slot):
        x0 = int(rng.choice(vocab, p=q0))
        x1 = int(rng.choice(vocab, p=q1[x0]))
        return [x0, x1], np.stack([q0, q1[x0]]).astype(np.float32)

    plain = _grammar_pairs(engine, grammars, spec, sampling, 4096)
    spec_pairs = _grammar_pairs(engine, grammars, spec, sampling, 4096, draft, drawn)
    eos = grammars.matcher(spec).eos
    assert any(b == eos for _a, b in spec_pairs)  # some x0 completed the grammar: EOS followed it
    pvalue, seen = _homogeneous(plain, spec_pairs)
    if drawn:
        assert pvalue > 1e-3, seen
    else:
        assert pvalue < 1e-6, seen
