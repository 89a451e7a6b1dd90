"""Tool calling at the gateway (issue 13): the Hermes-format parser (whole and streamed, with the
holdback), the default template's tools section and history, the grammar forcing a call for
`tool_choice` "required" or a named function (checked by llguidance itself when it is installed:
the calls it accepts are exactly the ones that validate), and the request checks."""
from __future__ import annotations

import json

import pytest

from gateway.chat import ChatTemplate, default_template
from gateway.schemas import ChatBody
from gateway.toolparse import ToolCallStream, call_id, parse_tool_calls
from gateway.tools import TOOLS_HEADER, ToolDef, call_grammar, plan
from tandem_core.errors import InvalidRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 16}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "weather in Paris?"}]


def _body(**kw) -> ChatBody:
    return ChatBody.model_validate({"messages": USER, **kw})


# ---------------------------------------------------------------- parsing


def test_parse_one_call_and_content():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "chatcmpl-1")
    assert content == "Let me look."
    assert calls == [{"id": call_id("chatcmpl-1", 0, 0), "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]
    assert calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == 29


def test_parse_several_calls_content_none():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "parameters": {}}</tool_call>')
    content, calls = parse_tool_calls(text, "r")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[1]["function"]["arguments"] == "{}" and calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # malformed JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>["get_weather"]</tool_call>',  # not an object
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {}}',  # never closed
    "no calls at all, <tool_ca",
])
def test_what_is_not_a_call_stays_text(text):
    content, calls = parse_tool_calls(text, "r")
    assert calls == [] and content == text


def test_arguments_as_a_json_string_are_read():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "r")
    assert calls[0]["function"]["arguments"] == '{"a":1}'


def _stream(pieces: list[str]) -> tuple[list[str], list[dict], str]:
    s = ToolCallStream("r")
    texts, calls = [], []
    for p in pieces:
        t, c = s.feed(p)
        texts.append(t)
        calls += c
    return texts, calls, s.finish()


def test_stream_holds_back_a_possible_open_tag_and_emits_the_call_whole():
    whole = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> done'
    pieces = [whole[i:i + 3] for i in range(0, len(whole), 3)]  # every split point of the tags is crossed
    texts, calls, rest = _stream(pieces)
    assert "".join(texts) + rest == "Sure.  done"
    assert not any("<" in t for t in texts)  # nothing of the tag leaks out
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    # The call is emitted with the piece that closes it, not before.
    closing = next(i for i, p in enumerate(pieces) if "".join(pieces[: i + 1]).endswith("</tool_call>")
                   or "</tool_call>" in "".join(pieces[: i + 1]))
    s = ToolCallStream("r")
    assert all(s.feed(p)[1] == [] for p in pieces[:closing])


def test_stream_releases_text_that_was_not_a_tag():
    texts, calls, rest = _stream(["a <tool", "bar> b", " <tool_c"])
    assert calls == [] and "".join(texts) == "a <toolbar> b " and rest == "<tool_c"


def test_stream_and_whole_agree():
    text = 'x<tool_call>{"name": "a", "arguments": {}}</tool_call>y<tool_call>bad</tool_call>'
    texts, calls, rest = _stream(list(text))
    content, whole_calls = parse_tool_calls(text, "r")
    assert "".join(texts) + rest == "xy<tool_call>bad</tool_call>" == content
    assert [{k: v for k, v in c.items() if k != "index"} for c in calls] == whole_calls


# ---------------------------------------------------------------- the prompt


def test_default_template_lists_tools_and_renders_history():
    tools = [WEATHER, TIME]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1"}]
    text = default_template(msgs, tools)
    system, rest = text.split("<|user|>\n", 1)
    assert system.startswith("<|system|>\n" + TOOLS_HEADER)
    assert json.dumps(WEATHER, separators=(", ", ": ")) in system and '"name": "get_time"' in system
    assert '<tool_call>{"name": <function name>, "arguments":' in system
    assert rest == ("weather in Paris?\n<|assistant|>\n"
                    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                    '<|tool|>\n{"temp_c": 21}\n<|assistant|>\n')
    # A system message keeps its text, with the tools section after it; no tools: as before.
    own = default_template([{"role": "system", "content": "be brief"}, *USER], tools)
    assert own.startswith("<|system|>\nbe brief\n\n# Tools\n")
    assert default_template(USER) == "<|user|>\nweather in Paris?\n<|assistant|>\n"


def test_history_from_the_request_reaches_the_template():
    body = ChatBody.model_validate({"messages": [
        *USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": [{"type": "text", "text": "21C"}], "tool_call_id": "call_9"}],
        "tools": [WEATHER]})
    msgs = body.chat_messages()
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object, as HF templates want
    assert msgs[2] == {"role": "tool", "content": "21C", "tool_call_id": "call_9"}
    assert '"arguments": {"city": "Paris"}}</tool_call>\n<|tool|>\n21C\n' in ChatTemplate().render(msgs, [WEATHER])


def test_a_model_template_gets_tools():
    src = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[-1].content }}"
    assert ChatTemplate(src).render(USER, [WEATHER, TIME]) == "[get_weather][get_time]weather in Paris?"
    assert ChatTemplate(src).render(USER) == "weather in Paris?"


# ---------------------------------------------------------------- tool_choice


def test_auto_parses_and_none_hides_the_tools():
    auto = _body(tools=[WEATHER]).tool_plan()
    assert auto.parse and auto.grammar is None and auto.tools[0]["function"]["name"] == "get_weather"
    none = _body(tools=[WEATHER], tool_choice="none").tool_plan()
    assert none.tools is None and not none.parse and none.grammar is None
    assert _body(tool_choice="auto").tool_plan().tools is None  # auto without tools: plain chat
    assert _body(tools=[WEATHER]).to_params().grammar is None


GRAMMAR_NAMED = (
    'start: call\n'
    'call: "<tool_call>" body "</tool_call>"\n'
    'body: fn_0\n'
    'fn_0: %json {"type":"object","properties":{"name":{"const":"get_weather"},"arguments":{"type":"object",'
    '"properties":{"city":{"type":"string"},"days":{"type":"integer","minimum":1,"maximum":16}},"required":["city"],'
    '"additionalProperties":false}},"required":["name","arguments"],"additionalProperties":false,'
    '"x-guidance":{"whitespace_flexible":false}}\n')


def test_named_function_forces_its_schema():
    p = _body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}).to_params()
    assert p.grammar == {"kind": "lark", "grammar": GRAMMAR_NAMED} and p.grammar_param == "tool_choice"


def test_required_allows_any_tool_and_parallel_calls():
    g = _body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True).to_params().grammar["grammar"]
    assert g.startswith("start: call{1,8}\n") and "body: fn_0 | fn_1\n" in g
    assert '"name":{"const":"get_time"},"arguments":{"type":"object","properties":{},"additionalProperties":false}' in g
    for parallel in (False, None):  # absent: one call too (it ends within max_tokens)
        one = _body(tools=[WEATHER], tool_choice="required", parallel_tool_calls=parallel).to_params().grammar
        assert one["grammar"].startswith("start: call\n") and "body: fn_0\n" in one["grammar"]


@pytest.mark.parametrize("kw,param,words", [
    ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", ["nope", "not in tools"]),
    ({"tools": [WEATHER, WEATHER]}, "tools", ["twice"]),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", ["tool_choice", "at most one"]),
])
def test_bad_tool_requests(kw, param, words):
    with pytest.raises(InvalidRequest) as e:
        _body(**kw).to_params()
    assert e.value.param == param and all(w in e.value.message for w in words), e.value.message


def _matcher(grammar: str):
    llg = pytest.importorskip("llguidance")
    hf = pytest.importorskip("llguidance.hf")
    transformers = pytest.importorskip("transformers")
    from tandem_core.models import resolve_model

    info = resolve_model("builtin")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{info.path}/tokenizer.json")
    lltok = hf.from_tokenizer(tok, n_vocab=info.vocab_size, eos_token=info.eos_token_ids[0])
    compiled = llg.LLMatcher.grammar_from_lark(grammar)
    assert llg.LLMatcher.validate_grammar(compiled) == ""

    def accepts(text: str) -> bool:
        m = llg.LLMatcher(lltok, compiled)
        ids = tok.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    return accepts


def test_llguidance_accepts_exactly_the_valid_calls():
    accepts = _matcher(call_grammar([ToolDef.model_validate(WEATHER), ToolDef.model_validate(TIME)], many=True)
                       ["grammar"])
    assert accepts('<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>')
    assert accepts('<tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":2}}</tool_call>'
                   '<tool_call>{"name":"get_time","arguments":{}}</tool_call>')
    assert not accepts('<tool_call>{"name":"get_weather","arguments":{}}</tool_call>')  # city is required
    assert not accepts('<tool_call>{"name":"other","arguments":{}}</tool_call>')
    assert not accepts('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')  # no free whitespace
    assert not accepts("plain text")


def test_check_spec_accepts_the_tool_grammar():
    grammar = pytest.importorskip("tandem_core.grammar")
    from tandem_core.tokenizer import load_tokenizer
    from tandem_core.models import resolve_model

    spec = plan([ToolDef.model_validate(WEATHER)], "required", None).grammar
    grammar.check_spec(spec, load_tokenizer(resolve_model("builtin")))
