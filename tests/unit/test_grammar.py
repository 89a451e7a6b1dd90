"""tandem_core.grammar: a spec no pod could run is refused with a message that names the construct;
the compiled-grammar cache stays under its bound; matchers built from the built-in tokenizer (and
the byte tokenizer) mask, consume, finish and rebuild; JSON is compact, so a complete object leaves
only EOS. No JAX here (the gateway imports this module)."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_core import grammar as G
from tandem_core.errors import InvalidRequest
from tandem_core.models import resolve_model
from tandem_core.tokenizer import ByteTokenizer, load_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def builtin():
    info = resolve_model("builtin")
    return load_tokenizer(info), info.vocab_size


def allowed(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist()


@pytest.mark.parametrize("spec, words", [
    ({"kind": "json_schema", "schema": {"type": "object", "not": {"type": "string"}}}, "not"),
    ({"kind": "json_schema", "schema": {"$ref": "#/definitions/missing"}}, "missing"),
    ({"kind": "json_schema", "schema": "a string"}, "schema"),
    ({"kind": "regex", "pattern": "(ab"}, "unclosed group"),
    ({"kind": "regex"}, "pattern"),
    ({"kind": "lark", "grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"kind": "choice", "choices": []}, "choices"),
    ({"kind": "choice", "choices": ["a", 3]}, "choices"),
    ({"kind": "xml"}, "'xml'"),
    ("json", "'str'"),
])
def test_unsupported_spec_names_the_construct(builtin, spec, words):
    tok, vocab = builtin
    with pytest.raises(InvalidRequest, match=words) as e:
        G.check_spec(spec, tok, vocab_size=vocab)
    assert e.value.param == "grammar"


def test_too_large_schema_names_the_size(builtin):
    tok, _ = builtin
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "description": "x" * 80}
                                            for i in range(1000)}}
    with pytest.raises(InvalidRequest, match=r"schema is \d+ bytes; at most 65536"):
        G.check_spec({"kind": "json_schema", "schema": big}, tok)


def test_cache_stays_under_its_bound_and_hits(builtin):
    tok, vocab = builtin
    specs = [{"kind": "regex", "pattern": f"a{{{i}}}"} for i in range(1, 8)]
    for s in specs:
        G.compile_spec(s, tok, vocab_size=vocab, cache_size=3)
    assert G.cache_len() <= 3
    again = G.compile_spec(specs[-1], tok, vocab_size=vocab, cache_size=3)
    assert again is G.compile_spec(dict(reversed(list(specs[-1].items()))), tok, vocab_size=vocab, cache_size=3)


def test_json_schema_matcher_builtin_is_compact_and_ends_in_eos(builtin):
    tok, vocab = builtin
    m = G.compile_spec({"kind": "json_schema", "schema": SCHEMA}, tok, vocab_size=vocab).matcher()
    assert m.width == (vocab + 31) // 32
    assert [tok.token_bytes(t) for t in allowed(m.mask())] == [b"{"]  # no leading whitespace
    text = '{"name":"bob","age":12}'
    for t in tok.encode(text, add_special_tokens=False):
        assert not m.done()
        m.consume(t)
    assert m.done() and m.accepting()
    assert allowed(m.mask()) == [m.eos]  # complete: only EOS may follow
    m.consume(m.eos)


def test_json_whitespace_is_never_allowed(builtin):
    tok, vocab = builtin
    m = G.compile_spec({"kind": "json_object"}, tok, vocab_size=vocab).matcher(tok.encode('{"a":1', add_special_tokens=False))
    ok = {tok.token_bytes(t) for t in allowed(m.mask())}
    assert ok and not any(c in b for b in ok for c in b" \n\t\r")


def test_rejected_token_and_bad_resume_raise_grammar_error(builtin):
    tok, vocab = builtin
    c = G.compile_spec({"kind": "json_schema", "schema": SCHEMA}, tok, vocab_size=vocab)
    m = c.matcher()
    with pytest.raises(G.GrammarError, match="not allowed by the grammar json_schema"):
        m.consume(tok.encode("x", add_special_tokens=False)[0])
    with pytest.raises(G.GrammarError, match="already generated do not match"):
        c.matcher(tok.encode("hello", add_special_tokens=False))


def test_rebuild_resumes_where_the_stream_left_off(builtin):
    tok, vocab = builtin
    c = G.compile_spec({"kind": "json_schema", "schema": SCHEMA}, tok, vocab_size=vocab)
    done = tok.encode('{"name":"al', add_special_tokens=False)
    live = c.matcher()
    for t in done:
        live.consume(t)
    resumed = c.matcher(done)
    assert allowed(resumed.mask()) == allowed(live.mask())
    resumed.rebuild([])
    assert [tok.token_bytes(t) for t in allowed(resumed.mask())] == [b"{"]


def test_choice_and_regex_with_the_byte_tokenizer():
    bt = ByteTokenizer()
    m = G.compile_spec({"kind": "choice", "choices": ["yes", "no"]}, bt, vocab_size=258).matcher()
    assert allowed(m.mask()) == [ord("n"), ord("y")]
    for b in b"no":
        m.consume(b)
    assert m.done() and allowed(m.mask()) == [257]
    r = G.compile_spec({"kind": "regex", "pattern": "[0-9]{2}"}, bt, vocab_size=258).matcher([ord("4")])
    assert allowed(r.mask()) == list(range(ord("0"), ord("9") + 1))


def test_lark_with_json_and_specials_never_allowed(builtin):
    tok, vocab = builtin
    lark = 'start: "A:" obj\nobj: %json {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    m = G.compile_spec({"kind": "lark", "grammar": lark}, tok, vocab_size=vocab).matcher()
    assert tok.bos_token_id not in allowed(m.mask())
    s = G.compile_spec({"kind": "regex", "pattern": ".{0,5}"}, tok, vocab_size=vocab).matcher()
    assert tok.bos_token_id not in allowed(s.mask())


def test_mask_deadline_fails_the_matcher(builtin):
    tok, vocab = builtin
    m = G.compile_spec({"kind": "json_object"}, tok, vocab_size=vocab).matcher(deadline_s=0.0)
    with pytest.raises(G.GrammarError, match="deadline"):
        m.mask()


def test_all_allowed_rows():
    m = G.all_allowed(3, 258)
    assert m.shape == (3, 9) and m.dtype == np.int32 and (m == -1).all()
