"""Structured output that always ends within its budget (issue 33): a matcher told how many tokens
the output may still take forces the shortest closing once the output could no longer close, so
JSON objects, open schemas (no additionalProperties: false) and forced tool calls parse at any
budget that fits the smallest valid value. The sampler here is the harshest there is: uniform over
the allowed tokens, never choosing EOS itself, so nothing but the budget logic ever ends an output."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from gateway.tools import FunctionDef, ToolDef, call_grammar
from tandem_core import grammar as G
from tandem_core.models import resolve_model
from tandem_core.tokenizer import load_tokenizer

OPEN = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age"]}
NESTED = {"type": "object", "required": ["a"], "properties": {"a": {"type": "object", "required": ["b"], "properties": {
    "b": {"type": "array", "items": {"type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}}}}}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}
MANY = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(12)},
        "required": [f"field_{i}" for i in range(12)]}  # the smallest value is ~100 tokens: known from the first mask
TOOL = ToolDef(type="function", function=FunctionDef(name="get_weather", parameters=WEATHER))
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@pytest.fixture(scope="module")
def builtin():
    info = resolve_model("builtin")
    return load_tokenizer(info), info.vocab_size


def _allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def _sample(m: G.Matcher, vocab: int, max_tokens: int, seed: int, budget: bool = True) -> list[int]:
    """What the decode pod does per step (constrained.py), with a uniform sampler that avoids EOS."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for i in range(max_tokens):
        left = max_tokens - i if budget else None
        if m.done() or m.ends_now(left):
            break
        allowed = _allowed(m.mask(left), vocab)
        free = allowed[allowed != m.eos]
        t = int(rng.choice(free if len(free) else allowed))
        if t == m.eos:
            break
        m.consume(t)
        out.append(t)
    return out


def _calls(text: str) -> list[dict]:
    calls = [json.loads(body) for body in CALL.findall(text)]
    assert calls and CALL.sub("", text) == "", text
    return calls


CASES = {
    "json_object": ({"kind": "json_object"}, json.loads),
    "open_schema": ({"kind": "json_schema", "schema": OPEN}, json.loads),
    "nested_schema": ({"kind": "json_schema", "schema": NESTED}, json.loads),
    "many_required": ({"kind": "json_schema", "schema": MANY}, json.loads),
    "forced_tool_call": (call_grammar([TOOL], many=False), _calls),
    "parallel_tool_calls": (call_grammar([TOOL], many=True), _calls),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_output_parses_at_small_budgets(builtin, case):
    tok, vocab = builtin
    spec, parse = CASES[case]
    compiled = G.compile_spec(spec, tok, vocab_size=vocab)
    smallest = len(compiled.matcher().closing_path())
    closed = 0
    for seed in range(20):
        max_tokens = smallest + seed * 3  # from the smallest valid value up
        m = compiled.matcher()
        out = _sample(m, vocab, max_tokens, seed)
        assert len(out) <= max_tokens
        parse(tok.decode(out))  # raises if the output does not parse
        closed += m.closed_early
    assert closed > 0  # the sampler never closes by itself: the budget did


def test_without_a_budget_the_same_sampler_runs_open(builtin):
    """The control: the same draws with no budget leave outputs that do not parse."""
    tok, vocab = builtin
    compiled = G.compile_spec({"kind": "json_schema", "schema": OPEN}, tok, vocab_size=vocab)
    failed = 0
    for seed in range(5):
        try:
            json.loads(tok.decode(_sample(compiled.matcher(), vocab, 24, seed, budget=False)))
        except ValueError:
            failed += 1
    assert failed > 0


def test_the_smallest_value_at_the_smallest_budget(builtin):
    tok, vocab = builtin
    compiled = G.compile_spec({"kind": "json_schema", "schema": OPEN}, tok, vocab_size=vocab)
    path = compiled.matcher().closing_path()
    assert json.loads(tok.decode(path)) == {"name": "", "age": 0}
    m = compiled.matcher()
    assert json.loads(tok.decode(_sample(m, vocab, len(path), seed=0))) == {"name": "", "age": 0}
    assert m.closed_early


def test_a_roomy_budget_forces_nothing(builtin):
    tok, vocab = builtin
    m = G.compile_spec({"kind": "json_object"}, tok, vocab_size=vocab).matcher()
    assert G.all_allowed(1, vocab)[0].size == m.mask(1000).size
    assert len(_allowed(m.mask(1000), vocab)) == len(_allowed(m.mask(), vocab)) > 1
    assert not m.closed_early


def test_a_resumed_matcher_closes_from_where_the_stream_left_off(builtin):
    tok, vocab = builtin
    compiled = G.compile_spec({"kind": "json_schema", "schema": OPEN}, tok, vocab_size=vocab)
    so_far = tok.encode('{"name":"ab', add_special_tokens=False)
    m = compiled.matcher(so_far)
    rest = _sample(m, vocab, 12, seed=1)
    assert json.loads(tok.decode(so_far + rest))["name"].startswith("ab")


def test_no_second_call_is_opened_that_cannot_close(builtin):
    """After a whole call the output is complete, and `<` would open a second call ~37 tokens
    long: with fewer left, that token is not allowed (a jump far past CLOSE_MARGIN)."""
    tok, vocab = builtin
    compiled = G.compile_spec(call_grammar([TOOL], many=True), tok, vocab_size=vocab)
    one = len(compiled.matcher().closing_path())
    for seed in range(20):
        out = _sample(compiled.matcher(), vocab, 2 * one - 1, seed)
        _calls(tok.decode(out))


def test_a_budget_with_room_leaves_the_choice_to_the_model(builtin):
    tok, vocab = builtin
    m = G.compile_spec({"kind": "choice", "choices": ["yes", "no"]}, tok, vocab_size=vocab).matcher()
    assert _allowed(m.mask(4), vocab).tolist() == _allowed(m.mask(), vocab).tolist()
    assert not m.closed_early


def _state(m: G.Matcher) -> tuple:
    """The closing heuristic's state, comparable: the JSON lexer's, the path, its cost, the count since."""
    lex, path, cost, since, closed = m._heuristic()
    return (lex.depth, lex.in_str, lex.esc, lex.owed), path, cost, since, closed


def _plain_steps(m: G.Matcher, vocab: int, max_tokens: int, seed: int) -> list[tuple]:
    """`_sample`'s run, step by step: (the token drawn or None where the output ended, the mask,
    the matcher's `_state` before the mask)."""
    rng = np.random.default_rng(seed)
    steps: list[tuple] = []
    for i in range(max_tokens):
        left = max_tokens - i
        if m.done() or m.ends_now(left):
            steps.append((None, None, None))
            break
        before = _state(m)
        mask = m.mask(left)
        allowed = _allowed(mask, vocab)
        free = allowed[allowed != m.eos]
        t = int(rng.choice(free if len(free) else allowed))
        steps.append((t, mask, before))
        if t == m.eos:
            break
        m.consume(t)
    return steps


@pytest.mark.parametrize("case", ["open_schema", "nested_schema", "forced_tool_call"])
def test_proposal_masks_are_the_plain_steps_masks_and_leave_the_matcher_as_plain_steps_do(builtin, case):
    """Speculative decoding under a grammar (Matcher.proposal_masks): a proposal of the true next
    tokens, sometimes with one token changed, gets at each position the mask the plain step had
    there; it is cut where the grammar rejects a token or the budget starts to force the closing;
    and after the kept tokens and the plain step's next one are fed, the matcher masks, closes and
    ends exactly as the plain run did (same masks, same `closed_early`)."""
    tok, vocab = builtin
    spec, _parse = CASES[case]
    compiled = G.compile_spec(spec, tok, vocab_size=vocab)
    smallest = len(compiled.matcher().closing_path())
    rng = np.random.default_rng(0)
    checked = cut = 0
    for seed in range(8):
        max_tokens = smallest + 2 * seed
        plain_m = compiled.matcher()
        steps = _plain_steps(plain_m, vocab, max_tokens, seed)
        m, i = compiled.matcher(), 0
        while i < len(steps):
            left = max_tokens - i
            if m.done() or m.ends_now(left):
                assert steps[i][0] is None, (seed, i)
                break
            tok_i, want, before = steps[i]
            assert _state(m) == before, (seed, i)  # its caches too: as the plain run had them here
            mask0 = m.mask(left)
            assert tok_i is not None and np.array_equal(mask0, want), (seed, i)
            truth: list[int] = []  # the plain run's tokens from this position, up to 4, EOS and its end left out
            for t, _mask, _before in steps[i:i + 4]:
                if t is None or t == m.eos:
                    break
                truth.append(t)
            proposal = list(truth)
            if proposal and rng.random() < 0.4:  # a wrong token somewhere: cut there or rejected
                proposal[int(rng.integers(len(proposal)))] = int(rng.integers(vocab))
            out = np.zeros((5, m.width), np.int32)
            n = m.proposal_masks(proposal, left, out)  # proposal[j]: a guess of token i + j
            for j in range(1, n + 1):  # out[j]: position i + j's mask, as the plain step had it
                assert steps[i + j][0] is not None and np.array_equal(out[j], steps[i + j][1]), (seed, i, j)
                checked += 1
            cut += n < len(proposal)
            kept = 0  # the verify call keeps the proposals that are the plain tokens, then draws the plain one
            while kept < n and proposal[kept] == steps[i + kept][0]:
                kept += 1
            emitted = truth[:kept] + [steps[i + kept][0]]
            for t in emitted:
                assert t is not None
                if t != m.eos:
                    m.consume(t)
            if emitted[-1] == m.eos:
                break
            i += len(emitted)
        assert m.closed_early == plain_m.closed_early, seed
    assert checked > 20 and cut > 0
