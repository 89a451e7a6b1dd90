"""Structured outputs and tool-call responses at the gateway (issue 13): `response_format` and
vLLM's `guided_*`/`structured_outputs` into `GenerationRequest.grammar` (bounded in size, one at
most), and the tool-call response shapes, whole and streamed, read by the real clients' own
parsers (the openai SDK's models, langchain-openai's message conversion)."""
from __future__ import annotations

import json

import pytest

from gateway.jsonbody import parse_body
from gateway.relay import Delta
from gateway.resume import StreamMeta
from gateway.schemas import ChatBody, CompletionBody
from gateway.settings import GatewaySettings
from gateway.sse import Formatter
from gateway.validation import build_request
from tandem_core.errors import InvalidRequest
from tandem_core.models import resolve_model
from tandem_core.tokenizer import load_tokenizer
from tandem_core.types import GenerationRequest

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**kw):
    p = ChatBody.model_validate({"messages": USER, **kw}).to_params()
    p.prompt = "<|user|>\nhi\n<|assistant|>\n"
    return p


def _cmpl(**kw):
    return CompletionBody.model_validate({"prompt": "hi", **kw}).to_params()


@pytest.mark.parametrize("kw,spec,param", [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, {"kind": "json_object"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     {"kind": "json_schema", "schema": SCHEMA}, "response_format"),
    ({"guided_json": SCHEMA}, {"kind": "json_schema", "schema": SCHEMA}, "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, {"kind": "json_schema", "schema": SCHEMA}, "guided_json"),
    ({"guided_regex": "[a-z]+"}, {"kind": "regex", "pattern": "[a-z]+"}, "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, {"kind": "choice", "choices": ["yes", "no"]}, "guided_choice"),
    ({"guided_grammar": 'start: "a"'}, {"kind": "lark", "grammar": 'start: "a"'}, "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, {"kind": "json_schema", "schema": SCHEMA}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": ["x"]}}, {"kind": "choice", "choices": ["x"]}, "structured_outputs.choice"),
])
def test_chat_specs(kw, spec, param):
    p = _chat(**kw)
    assert p.grammar == spec and p.grammar_param == param


def test_completion_specs_and_no_response_format():
    assert _cmpl(structured_outputs={"regex": "a|b"}).grammar == {"kind": "regex", "pattern": "a|b"}
    with pytest.raises(Exception):
        CompletionBody.model_validate({"prompt": "hi", "response_format": {"type": "json_object"}})


@pytest.mark.parametrize("kw,param,words", [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     ["response_format", "at most one"]),
    ({"response_format": {"type": "xml"}}, "response_format", ["text", "json_object", "json_schema"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema",
     ["required"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}},
     "response_format.json_schema.schema", []),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema", ["unknown"]),
    ({"guided_json": "[1, 2]"}, "guided_json", ["schema object"]),
    ({"guided_regex": ""}, "guided_regex", ["empty"]),
    ({"guided_choice": ["a", ""]}, "guided_choice", ["empty"]),
    ({"structured_outputs": {"json": SCHEMA, "grammar": "start: x"}}, "structured_outputs.grammar", ["at most one"]),
])
def test_bad_specs(kw, param, words):
    with pytest.raises(InvalidRequest) as e:
        parse_body(json.dumps({"messages": USER, **kw}).encode(), ChatBody).to_params()
    assert e.value.param == param and all(w in e.value.message for w in words), e.value.message


@pytest.fixture(scope="module")
def model():
    info = resolve_model("builtin")
    return info, load_tokenizer(info)


def test_build_request_carries_the_grammar_and_bounds_it(model):
    info, tok = model
    prep = build_request(_chat(guided_choice=["yes", "no"]), GatewaySettings(), info, tok)
    assert prep.request.grammar == {"kind": "choice", "choices": ["yes", "no"]}
    assert GenerationRequest.from_json(prep.request.to_json()).grammar == prep.request.grammar
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    with pytest.raises(InvalidRequest) as e:
        build_request(_chat(response_format={"type": "json_schema", "json_schema": {"schema": big}}),
                      GatewaySettings(max_grammar_bytes=1024), info, tok)
    assert e.value.param == "response_format" and "max_grammar_bytes" in e.value.message


# ---------------------------------------------------------------- tool-call responses, as clients read them

CALL_TEXT = 'I will check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _deltas(text: str, finish: str = "stop", step: int = 4) -> list[Delta]:
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    return [Delta(i, 100 + i, p, finish if i == len(pieces) - 1 else None, i + 1) for i, p in enumerate(pieces)]


def _meta(tools: bool = True) -> StreamMeta:
    return StreamMeta("chat", "chatcmpl-t1", 1700000000, "tiny", 5, tools=tools)


def _whole(text: str, finish: str = "stop", tools: bool = True) -> dict:
    fmt = Formatter(_meta(tools))
    for d in _deltas(text, finish):
        fmt.add(d)
    return fmt.whole()


def test_whole_message_parses_in_the_openai_sdk_and_langchain():
    from openai.types.chat import ChatCompletion

    body = _whole(CALL_TEXT)
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check."
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    from langchain_openai.chat_models.base import _convert_dict_to_message
    msg = _convert_dict_to_message(body["choices"][0]["message"])
    assert msg.tool_calls == [{"name": "get_weather", "args": {"city": "Paris"}, "id": call.id, "type": "tool_call"}]
    assert not msg.invalid_tool_calls


def test_without_tools_or_without_a_call_the_text_is_unchanged():
    assert _whole(CALL_TEXT, tools=False)["choices"][0]["message"] == {
        "role": "assistant", "content": CALL_TEXT, "refusal": None}
    plain = _whole("just text <b>", tools=True)["choices"][0]
    assert plain["message"]["content"] == "just text <b>" and plain["finish_reason"] == "stop"
    assert "tool_calls" not in plain["message"]
    cut = _whole(CALL_TEXT[:-5], finish="length")["choices"][0]  # an unclosed call stays text
    assert cut["message"]["content"] == CALL_TEXT[:-5] and cut["finish_reason"] == "length"


def test_streamed_deltas_assemble_in_the_openai_sdk_and_langchain():
    from openai.types.chat import ChatCompletionChunk

    fmt = Formatter(_meta())
    chunks = [fmt.chunk(d) for d in _deltas(CALL_TEXT)]
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    content = "".join(c.choices[0].delta.content or "" for c in parsed)
    assert content == "I will check." and "<" not in content
    calls = [tc for c in parsed for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert parsed[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in parsed[:-1])

    from langchain_core.messages import AIMessageChunk
    from langchain_openai.chat_models.base import _convert_delta_to_message_chunk
    total = None
    for c in chunks:
        part = _convert_delta_to_message_chunk(c["choices"][0]["delta"], AIMessageChunk)
        total = part if total is None else total + part
    assert total.tool_calls == [{"name": "get_weather", "args": {"city": "Paris"}, "id": calls[0].id,
                                 "type": "tool_call"}]


def test_a_resumed_stream_repeats_the_same_events():
    first = Formatter(_meta())
    again = Formatter(_meta())
    assert [first.chunk(d) for d in _deltas(CALL_TEXT)] == [again.chunk(d) for d in _deltas(CALL_TEXT)]


def test_an_unsupported_schema_is_a_400_before_enqueueing(model):
    pytest.importorskip("tandem_core.grammar")
    info, tok = model
    bad = {"type": "object", "properties": {"a": {"$ref": "https://example.com/remote.json"}}}
    with pytest.raises(InvalidRequest) as e:
        build_request(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}),
                      GatewaySettings(), info, tok)
    assert e.value.param == "response_format" and e.value.message.startswith("response_format: "), e.value.message
