"""Speculative decoding in the decode loop (decode_svc/speculate.py, EngineLoop._verify): every
request's entries (index, token, finish, logprobs) are those of the loop without speculation,
whatever is proposed (the true continuation, so several tokens land per call and finishes fall
inside them; noise; the n-gram lookup), across stop ids, max_tokens and the end of the context; a
cancel still gives each token once, then one finish; rows whose proposals keep missing pause.
Real engine (tiny preset), no Redis: the loop's queues are driven directly."""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from decode_svc.bridge import Bridge
from decode_svc.items import Insert
from decode_svc.loop import EngineLoop
from decode_svc.requests import RequestTable
from decode_svc.settings import SpeculativeConfig
from decode_svc.speculate import Speculator
from tandem_engine.draft import DraftProposer
from tandem_core.sampling_args import prefill_args
from tandem_core.types import GenerationRequest, SamplingParams
from tandem_engine import load_engine

SLOTS = 4
MAX_LEN = 64
NGRAM = SpeculativeConfig(method="ngram", k=4, min_n=1, no_match_pause=1,
                          gate_window=100_000)  # the gate stays in its first trial


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(16, 64), steps_per_dispatch=4,
                       kv_block_size=4)


def _req(rid: str, prompt, max_tokens: int, sampling=SamplingParams(), **kw) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens, sampling, ignore_eos=True, **kw)


_GRAMMARS: dict = {}


def _grammars(engine):
    from tandem_core.grammar import Grammars
    return _GRAMMARS.setdefault(id(engine), Grammars(engine.info))


def _drive(engine, reqs, speculative=None, cancel_after=None, timeout_s: float = 60, draft=None):
    table, bridge = RequestTable(SLOTS), Bridge(SLOTS, 256)
    loop = EngineLoop(engine, table, bridge, speculative=speculative, draft=draft)
    for r in reqs:
        assert table.reserve(1) == 1
        kw = prefill_args(r, _grammars(engine)) if r.grammar is not None else {}
        bridge.put_insert(Insert(engine.export_prefix(engine.prefill(r.prompt_ids, r.sampling, **kw)), r,
                                 table.claim(r.request_id)))
    loop.start()
    got: dict[str, list] = {r.request_id: [] for r in reqs}
    cancelled: set[str] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while sum(any(e[2] is not None for e in v) for v in got.values()) < len(reqs):
            assert time.monotonic() < deadline, f"stalled: {got}"
            try:
                batch = bridge.outputs.get(timeout=1)
            except queue.Empty:
                continue
            for e in batch:
                got[e.request_id].append((e.index, e.token, e.finish, e.logprobs))
            for rid, n in (cancel_after or {}).items():
                if rid not in cancelled and len(got[rid]) >= n:
                    loop.cancel({rid})
                    cancelled.add(rid)
    finally:
        loop.stop()
    assert loop.error is None
    return got, loop


PROMPTS = [[256] + [70, 71, 72, 73] * 3, [256, 80, 81], [256] + [90 + i for i in range(50)]]


def _reqs(stop_tok: int):
    return [
        _req("stops", PROMPTS[0], 30, stop_token_ids=[stop_tok]),
        _req("short", PROMPTS[1], 7),  # ends by max_tokens
        _req("ctx", PROMPTS[2], 100),  # 51 prompt positions: ends at the end of the context
        _req("logprobs", PROMPTS[1], 20, SamplingParams(logprobs=2, presence_penalty=0.5)),
    ]


def _truth(plain):
    """A proposer that knows each request's plain output (entries from index 1; the first token
    came with the prefill): the continuation of the request whose output so far this row's is."""
    def propose(self, row, room):
        if row is None or room < 1:
            return []
        for entries in plain.values():
            toks = [t for _i, t, _f, _lp in entries]
            for p in PROMPTS:
                out = row.seq[len(p) + 1:]
                if row.seq[:len(p)] == p and len(row.seq) > len(p) and out == toks[:len(out)]:
                    return toks[len(out):len(out) + min(self.k, room)]
        return []
    return propose


def test_loop_entries_with_speculation_equal_those_without(engine, monkeypatch):
    probe, _ = _drive(engine, [_req("probe", PROMPTS[0], 30)])
    stop_tok = [t for _i, t, _f, _lp in probe["probe"]][9]
    reqs = _reqs(stop_tok)
    plain, _ = _drive(engine, reqs)
    assert plain["stops"][-1][2] == "stop" and plain["short"][-1][:1] == (6,)
    assert plain["ctx"][-1][2] == "length" and all(e[3] for e in plain["logprobs"][:-1])
    ngram, loop = _drive(engine, reqs, NGRAM)
    assert ngram == plain
    assert loop.spec.stats.drafts > 0
    rng = np.random.default_rng(0)
    loop = _noise_then_truth(engine, reqs, plain, monkeypatch, lambda: rng.integers(3, 250, 4).tolist())
    s = loop.spec.stats
    assert s.accepted >= 0.8 * s.draft_tokens > 0  # (nearly) every proposal kept: several tokens a call


def _noise_then_truth(engine, reqs, plain, monkeypatch, noise):
    """Every row proposes `noise()`, then its true continuation: the loop's entries are the plain
    loop's both times, and the second run took fewer calls (several tokens a call). Returns its loop."""
    monkeypatch.setattr(Speculator, "propose", lambda self, row, room: noise() if row is not None and room > 0 else [])
    noisy, _ = _drive(engine, reqs, NGRAM)
    assert noisy == plain
    monkeypatch.setattr(Speculator, "propose", _truth(plain))
    truth, loop = _drive(engine, reqs, NGRAM)
    assert truth == plain
    assert loop.stats.calls < sum(len(v) for v in plain.values()) // 2
    return loop


def test_loop_entries_with_a_draft_model_equal_those_without(engine):
    """A draft model's proposals (tandem_engine/draft.py): the target as its own draft has (nearly)
    every proposal kept; another model's are mostly rejected; the entries are the plain loop's."""
    import dataclasses

    from tandem_core.models import resolve_model
    from tandem_engine.draft import DraftProposer
    from tandem_engine.engine import Engine
    from tandem_engine.weights import load_params

    reqs = _reqs(5)
    plain, _ = _drive(engine, reqs)
    config = SpeculativeConfig(method="draft", draft_model="tiny", k=4, gate_window=100_000)
    same = DraftProposer(load_engine("tiny", slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(16, 64),
                                     steps_per_dispatch=3, kv_block_size=4, kv_reuse=False), 4)
    got, loop = _drive(engine, reqs, config, draft=same)
    assert got == plain
    s = loop.spec.stats
    assert s.accepted >= 0.8 * s.draft_tokens > 0
    assert loop.stats.calls < sum(len(v) for v in plain.values()) // 2
    other = dataclasses.replace(resolve_model("tiny"), seed=7, name="tiny-seed7")
    draft = DraftProposer(Engine(other, load_params(other, "float32"), slots=SLOTS, max_len=MAX_LEN,
                                 prefill_buckets=(16, 64), kv_block_size=4, kv_reuse=False), 4)
    got, loop = _drive(engine, reqs, config, draft=draft)
    assert got == plain
    assert loop.spec.stats.drafts > 0


def test_a_sampling_draft_hands_its_q_to_the_verify_call_so_its_own_samples_are_kept(engine):
    """Sampled requests (temperature 0.9, near-uniform over the tiny model's vocabulary) beside a
    greedy one, the target as its own draft: a draft that samples at the request's parameters
    proposes from q = p, and the verify call judges by min(1, p / q), so (nearly) every proposal
    is kept; a greedy draft's argmax is kept with p(argmax), a few per cent. The greedy request's
    entries are the plain loop's either way, the sampled ones' whole and in order."""
    reqs = [_req(f"sampled{i}", PROMPTS[i], 24, SamplingParams(temperature=0.9, seed=11 + i)) for i in range(2)]
    reqs.append(_req("greedy", PROMPTS[2], 12))
    plain, _ = _drive(engine, reqs)
    rates = {}
    for sample in (True, False):
        config = SpeculativeConfig(method="draft", draft_model="tiny", k=4, gate_window=100_000, draft_sample=sample)
        draft = DraftProposer(load_engine("tiny", slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(16, 64),
                                          steps_per_dispatch=3, kv_block_size=4, kv_reuse=False), 4, sample=sample)
        got, loop = _drive(engine, reqs, config, draft=draft)
        assert got["greedy"] == plain["greedy"]
        for r in reqs[:2]:
            assert [e[0] for e in got[r.request_id]] == list(range(1, 24)) and got[r.request_id][-1][2] == "length"
        s = loop.spec.stats
        rates[sample] = s.accepted / s.draft_tokens
    assert rates[True] >= 0.9 and rates[False] < 0.5, rates


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _grammar_reqs():
    """Greedy rows under grammars beside an unconstrained one: a regex the tiny model's greedy
    text repeats in, a JSON schema closed by its budget, a choice (the proposal that completes it is
    checked and the call's query after it may only be EOS: its logprobs are the plain loop's, 0 and
    alone), one with logprobs."""
    return [
        _req("regex", PROMPTS[0], 30, grammar={"kind": "regex", "pattern": "[a-f]{4,60}"}),
        _req("json", PROMPTS[1], 24, SamplingParams(logprobs=2), grammar={"kind": "json_schema", "schema": PERSON}),
        _req("choice", PROMPTS[2], 12, SamplingParams(logprobs=3),
             grammar={"kind": "choice", "choices": ["abcabcabc", "abcabcxyz"]}),
        _req("free", PROMPTS[1], 20, SamplingParams(logprobs=1)),
    ]


def test_loop_entries_under_grammars_with_speculation_equal_those_without(engine, monkeypatch):
    """Speculation beside and inside grammar rows (SlotGrammars.proposal_masks: each query masked
    as a plain step at its position): the true continuation (several tokens a call, finishes
    inside the call, the JSON closed by its budget), noise (cut where the grammar rejects it) and
    the n-gram lookup all give the plain loop's entries, logprobs included."""
    reqs = _grammar_reqs()
    plain, ploop = _drive(engine, reqs)
    assert ploop.stats.constrained_steps > 0
    assert plain["choice"][-1][2] == "stop" and plain["json"][-1][2] in ("stop", "length")
    assert all(e[1] in b"abcdef" for e in plain["regex"]) and len(plain["regex"]) == 29
    ngram, loop = _drive(engine, reqs, NGRAM)
    assert ngram == plain
    assert loop.stats.constrained_verifies > 0
    rng = np.random.default_rng(1)
    loop = _noise_then_truth(engine, reqs, plain, monkeypatch,
                             lambda: [int(t) for t in rng.choice(list(b"abcdef{}\":,0123456789xyz"), 4)])
    s = loop.spec.stats
    assert s.accepted >= 0.7 * s.draft_tokens > 0 and loop.stats.constrained_verifies > 0


def test_a_cancel_between_speculative_calls_gives_each_token_once_then_one_finish(engine, monkeypatch):
    reqs = [_req("cancelled", PROMPTS[0], 40), _req("other", PROMPTS[1], 30)]
    plain, _ = _drive(engine, reqs)
    monkeypatch.setattr(Speculator, "propose", _truth(plain))
    got, _ = _drive(engine, reqs, NGRAM, cancel_after={"cancelled": 6})
    for rid, entries in got.items():
        idx = [e[0] for e in entries]
        assert idx == list(range(1, len(idx) + 1)), (rid, idx)
        assert [e for e in entries if e[2] is not None] == [entries[-1]]
        body = [e for e in entries if e[1] >= 0]
        assert body == plain[rid][:len(body)]
    assert got["cancelled"][-1][1:3] == (-1, "cancelled")
    assert got["other"] == plain["other"]


def test_rows_whose_proposals_miss_pause_and_the_loop_pipelines_again(engine, monkeypatch):
    """Proposals that always miss: the row pauses (2, then 4, 8 .. dispatches), ordinary calls run
    meanwhile, and it tries again after each pause."""
    monkeypatch.setattr(Speculator, "propose", lambda self, row, room: [] if row is None or row.pause or room < 1
                        else [0, 0, 0, 0][:min(self.k, room)])
    got, loop = _drive(engine, [_req("a", PROMPTS[1], 60)], NGRAM)
    s = loop.spec.stats
    assert s.accepted == 0 and s.paused_rows >= 3  # tried again after each pause
    assert loop.stats.calls - s.calls >= 2 + 4  # the ordinary calls of the first two pauses
    assert s.calls <= 2 * (s.paused_rows + 1)


def test_the_gate_keeps_the_faster_mode_and_measures_again():
    from decode_svc.speculate import Gate, SpecStats

    stats = SpecStats()
    gate = Gate(window=2, hold=4, max_hold=16, stats=stats)

    def run(n, tokens_per_s):
        seen = []
        for _ in range(n):
            seen.append(gate.speculate)
            gate.account(int(tokens_per_s / 100), 0.01)
        return seen

    assert run(2, 500) == [True, True]  # trial: with speculation ...
    assert run(2, 1000) == [False, False]  # ... then without: faster
    assert gate.phase == "plain" and stats.gate_plain == 1
    assert run(4, 1000) == [False] * 4  # held
    run(2, 500), run(2, 1000)  # measured again: plain still faster, held twice as long
    assert gate.phase == "plain" and gate.left == 8
    run(8, 1000)
    run(2, 2000), run(2, 1000)  # speculation faster now
    assert gate.phase == "spec" and stats.gate_spec == 1 and gate.speculate


def test_each_load_has_its_own_gate():
    """A decision taken at 32 rows is not carried to one row, and the loads' trials do not restart
    each other."""
    from decode_svc.speculate import load_bucket

    assert [load_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 31, 32, 33)] == [1, 1, 2, 2, 4, 4, 8, 16, 32, 32]
    spec = Speculator(SpeculativeConfig(method="ngram", k=4, gate_window=2, gate_hold=100))
    for rate in (2000, 2000, 1000, 1000):  # at 32 rows speculation is faster
        spec.gate(32).account(int(rate / 100), 0.01)
    assert spec.gate(32).phase == "spec" and spec.gate(40).phase == "spec"  # (32 and more: one load)
    assert spec.gate(20).phase == "try_spec" and spec.gate(1).phase == "try_spec"  # 16-31 and 1: untried
    for rate in (500, 500, 1000, 1000):  # at one row plain is faster
        spec.gate(1).account(int(rate / 100), 0.01)
    assert spec.gate(1).phase == "plain" and not spec.gate(1).speculate
    assert spec.gate(32).phase == "spec" and spec.gate(32).left == 100  # untouched meanwhile
    row = spec.start([1, 2, 3, 1, 2], 3)
    assert not spec.proposing([row]) and spec.proposing([row] * 32)
    assert spec.stats.summary()["gate"]["rates"] == {"32": {"spec": 2000.0, "plain": 1000.0},
                                                     "1": {"spec": 500.0, "plain": 1000.0}}


def test_a_rows_proposal_length_follows_its_rate():
    spec = Speculator(SpeculativeConfig(method="ngram", k=4))
    assert [spec.length(r) for r in (0.2, 0.3, 0.4, 0.6, 0.8, 0.95, 1.0)] == [0, 0, 1, 2, 4, 4, 4]
    row = spec.start([1, 2, 3], 4)
    for _ in range(4):
        spec.observe(row, 2, [9], 0)  # nothing kept, four times: 0.6 x 0.8^4 < min_gain
    assert row.pause == 1 and spec.stats.paused_rows == 1
    spec.tick([row])
    assert row.pause == 0 and spec.length(row.rate) == 1  # after the pause: one token again
    spec.observe(row, 3, [5, 6, 7], 2)
    spec.observe(row, 1, [8], 1)
    assert spec.stats.accepted_per_pos == [2, 1] and spec.stats.summary()["accepted_per_pos"] == {"0": 2, "1": 1}


def test_a_request_that_opts_out_is_never_speculated(engine, monkeypatch):
    reqs = [_req("out", PROMPTS[0], 20, speculative=False), _req("in", PROMPTS[1], 20)]
    plain, _ = _drive(engine, reqs)
    monkeypatch.setattr(Speculator, "propose", _truth(plain))
    got, loop = _drive(engine, reqs, NGRAM)
    assert got == plain
    assert 0 < loop.spec.stats.drafts <= 19  # the other request's alone: one a call at most
    calls = loop.spec.stats.calls
    got, loop = _drive(engine, reqs[:1], NGRAM)
    assert loop.spec.stats.drafts == 0 and loop.spec.stats.calls == 0 and calls > 0


def test_a_row_whose_tokens_recur_nowhere_sits_out_a_few_dispatches():
    spec = Speculator(SpeculativeConfig(method="ngram", k=4, no_match_pause=3))
    row = spec.start([1, 2, 3], 4)  # nothing recurs
    assert spec.propose(row, 10) == [] and row.pause == 3
    assert not spec.proposing([row])  # the loop pipelines meanwhile
    for _ in range(3):
        spec.tick([row])
    row.index.extend([1, 2])  # "1 2" recurs now: what followed it is proposed
    assert spec.proposing([row]) and spec.propose(row, 10) == [3, 4]


def test_a_pool_short_of_a_verify_calls_blocks_gets_ordinary_calls_and_hands_nothing_back(engine, monkeypatch):
    """Verify calls take k + 1 positions a row; where the pool cannot give them the loop runs an
    ordinary call (a step's room) rather than hand a request back for a proposal's sake."""
    reqs = [_req("a", PROMPTS[0], 20), _req("b", PROMPTS[1], 20)]
    plain, _ = _drive(engine, reqs)
    monkeypatch.setattr(Speculator, "propose", _truth(plain))
    monkeypatch.setattr(type(engine), "can_reserve", lambda self, steps: steps <= engine.steps_per_dispatch)
    got, loop = _drive(engine, reqs, NGRAM)
    assert got == plain
    assert loop.spec.stats.calls == 0 and loop.stats.spec_short > 0 and loop.stats.handed_back_for_blocks == 0


def test_can_reserve_counts_the_blocks_the_rows_lack_against_the_free_ones():
    from tandem_core.types import SamplingParams as SP

    e = load_engine("tiny", slots=2, max_len=64, prefill_buckets=(16,), kv_block_size=4, kv_blocks=5)
    state = e.insert(e.prefill(list(range(3, 10)), SP()), e.init_state(), 0, SP())  # 7 positions + 1: 2 blocks
    assert e.kv_blocks_free() == 3
    assert e.can_reserve(1) and e.can_reserve(13)  # positions 7..19: 5 blocks, 3 more
    assert not e.can_reserve(14)  # positions 7..20: 6 blocks
    state, short = e.reserve(state, 13)
    assert short == [] and e.kv_blocks_free() == 0 and not e.can_reserve(14)
