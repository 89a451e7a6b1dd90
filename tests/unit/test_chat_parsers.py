"""The per-family output parsers (issue 28): reasoning into `reasoning_content` (Qwen3's think tags,
also when the prompt opened `<think>`; gpt-oss's harmony analysis channel) and tool calls into
`tool_calls` (Hermes blocks, Mistral's `[TOOL_CALLS]` in both its forms, gpt-oss's commentary
calls). Each is checked whole and streamed: the output cut at every position, and in random
token-sized pieces, must give exactly what the whole output gives, with no marker leaking into
the text."""
from __future__ import annotations

import json
import random

import pytest

from gateway.chatformat import ChoiceParser, OutputSpec, parse_output
from gateway.harmony import HarmonyParser, parse_harmony, route
from gateway.reasoning import ThinkTags, opened_in, split_reasoning
from gateway.toolparse import MistralCalls, ToolCallStream, short_call_id

RID = "chatcmpl-test"


def pieces(text: str, rng: random.Random) -> list[str]:
    """`text` cut into random pieces of 1..8 characters (tokens, and tags split across them)."""
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        out.append(text[i:i + n])
        i += n
    return out


def splits(text: str, trials: int = 40) -> list[list[str]]:
    """Every two-piece split, one character at a time, and `trials` random cuts."""
    rng = random.Random(1234)
    return ([[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
            + [pieces(text, rng) for _ in range(trials)])


def run_choice(spec: OutputSpec, parts: list[str]) -> tuple[str, str, list[dict]]:
    p = ChoiceParser(spec, RID)
    r, c, calls = [], [], []
    for part in parts:
        a, b, k = p.feed(part)
        r.append(a)
        c.append(b)
        calls += k
    a, b, k = p.finish()
    return "".join(r) + a, "".join(c) + b, calls + k


def check_streams(spec: OutputSpec, text: str) -> dict:
    """Streamed in every way == whole; returns the whole result."""
    whole = parse_output(text, spec, RID)
    for parts in splits(text):
        r, c, calls = run_choice(spec, parts)
        assert (r or None) == whole["reasoning_content"], parts
        got = [{k: v for k, v in x.items() if k != "index"} for x in calls]
        assert got == whole["tool_calls"], parts
        if whole["tool_calls"]:
            assert (c.strip() or None) == whole["content"], parts
        else:
            assert c == whole["content"], parts
    return whole


# ---------------------------------------------------------------- Qwen3's think tags

QWEN3 = OutputSpec(reasoning="qwen3", tool_parser="hermes")
QWEN3_TOOLS = OutputSpec(reasoning="qwen3", tool_parser="hermes", tools=True)


def test_think_tags_split_off_the_reasoning():
    out = check_streams(QWEN3, "<think>\nThe user greets me.\n</think>\n\nHello!")
    assert out == {"reasoning_content": "\nThe user greets me.\n", "content": "\n\nHello!", "tool_calls": []}


def test_no_think_block_is_all_content():
    # Qwen3 with enable_thinking=false: the template wrote the empty block into the prompt
    assert check_streams(QWEN3, "Hello! <think> is a tag.")["reasoning_content"] is None
    assert parse_output("  Hello!", QWEN3, RID)["content"] == "  Hello!"


def test_prompt_that_opened_think_starts_in_reasoning():
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert opened_in(prompt) and not opened_in(prompt + "x</think>\n\n")
    assert not opened_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=false
    spec = OutputSpec(reasoning="qwen3", reasoning_open=True)
    out = check_streams(spec, "Greeting; reply.\n</think>\n\nHello!")
    assert out["reasoning_content"] == "Greeting; reply.\n" and out["content"] == "\n\nHello!"


def test_unclosed_thinking_stays_reasoning():
    out = check_streams(QWEN3, "<think>\nstill thinking when max_tokens ran ou")
    assert out == {"reasoning_content": "\nstill thinking when max_tokens ran ou", "content": "", "tool_calls": []}
    assert split_reasoning("<thi") == (None, "<thi")  # a cut-short tag is text
    assert split_reasoning("   ") == (None, "   ")


def test_think_tag_never_leaks_while_streaming():
    p = ThinkTags()
    seen = [p.feed(c) for c in "<think>ab</think>cd"]
    assert all("<" not in r + c and ">" not in r + c for r, c in seen)
    assert "".join(r for r, _ in seen) == "ab" and "".join(c for _, c in seen) == "cd"


def test_reasoning_then_hermes_call():
    text = ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    out = check_streams(QWEN3_TOOLS, text)
    assert out["reasoning_content"] == "\nI need the weather.\n" and out["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out["tool_calls"]] \
        == [("get_weather", {"city": "Paris"})]


def test_a_call_written_inside_the_thinking_is_reasoning():
    text = '<think><tool_call>{"name": "f", "arguments": {}}</tool_call></think>done'
    out = check_streams(QWEN3_TOOLS, text)
    assert out["tool_calls"] == [] and out["content"] == "done" and "<tool_call>" in out["reasoning_content"]


# ---------------------------------------------------------------- Hermes (Qwen2.5, Qwen3), as the templates teach it

HERMES = OutputSpec(tool_parser="hermes", tools=True)


def test_hermes_blocks_with_newlines_and_several_calls():
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    out = check_streams(HERMES, text)
    assert out["content"] == "Checking." and [c["function"]["name"] for c in out["tool_calls"]] \
        == ["get_weather", "get_time"]
    assert out["tool_calls"][0]["id"] != out["tool_calls"][1]["id"]


# ---------------------------------------------------------------- Mistral

MISTRAL = OutputSpec(tool_parser="mistral", tools=True)


def test_mistral_v3_list():
    text = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}]')
    out = check_streams(MISTRAL, text)
    assert out["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]] \
        == [("get_weather", '{"city":"Paris"}'), ("get_time", '{"tz":"CET"}')]
    ids = [c["id"] for c in out["tool_calls"]]
    assert ids == [short_call_id(RID, 0, 0), short_call_id(RID, 0, 1)]
    assert all(len(i) == 9 and i.isalnum() for i in ids)  # what Mistral's templates accept back


def test_mistral_args_form_with_and_without_call_id():
    text = ('Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}'
            '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}')
    out = check_streams(MISTRAL, text)
    assert out["content"] == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]] \
        == [("get_weather", '{"city":"Paris","days":[1,2]}'), ("get_time", "{}")]


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS][{"name": "f", "arguments": {"a": ',  # cut by max_tokens
    '[TOOL_CALLS][{"arguments": {}}]',  # no name
    '[TOOL_CALLS]f[ARGS][1, 2]',  # arguments not an object
    "plain answer, no calls [TOOL_CALL",
])
def test_mistral_what_is_not_a_call_stays_text(text):
    out = check_streams(MISTRAL, text)
    assert out["tool_calls"] == [] and out["content"] == text


def test_mistral_call_is_emitted_when_it_completes():
    p = MistralCalls(RID)
    assert p.feed('[TOOL_CALLS]f[ARGS]{"a": {"b": 1}') == ("", [])
    text, calls = p.feed("}")
    assert text == "" and [c["function"]["arguments"] for c in calls] == ['{"a":{"b":1}}']


# ---------------------------------------------------------------- gpt-oss (harmony)

HARMONY = OutputSpec(reasoning="openai_gptoss", tool_parser="openai", tools=True)
HARMONY_NO_TOOLS = OutputSpec(reasoning="openai_gptoss", tool_parser="openai")


def test_harmony_analysis_then_final():
    text = ("<|channel|>analysis<|message|>User says hi. Reply briefly.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")
    out = check_streams(HARMONY_NO_TOOLS, text)
    assert out == {"reasoning_content": "User says hi. Reply briefly.", "content": "Hello! How can I help?",
                   "tool_calls": []}


@pytest.mark.parametrize("call", [
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}",
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}",
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    "{\"city\":\"Paris\"}<|call|>",
])
def test_harmony_commentary_call_in_either_header_order(call):
    text = "<|channel|>analysis<|message|>Need weather.<|end|>" + call
    out = check_streams(HARMONY, text)
    assert out["reasoning_content"] == "Need weather." and out["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]] \
        == [("get_weather", '{"city":"Paris"}')]


def test_harmony_preamble_is_content_and_bad_json_stays_text():
    text = ("<|channel|>commentary<|message|>Looking it up.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{not json")
    out = check_streams(HARMONY, text)
    assert out["tool_calls"] == [] and out["content"] == "Looking it up.{not json"


def test_harmony_without_tools_keeps_a_call_as_text():
    r, c, calls = parse_harmony("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}", RID,
                                tools=False)
    assert calls == [] and c == "{}" and r is None


def test_harmony_plain_text_and_cut_headers():
    assert parse_harmony("just text, no channels", RID) == (None, "just text, no channels", [])
    assert parse_harmony("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|chan", RID) == ("x", None, [])
    assert route("<|channel|>analysis") == ("reasoning", "")
    assert route(" to=functions.lookup<|channel|>commentary json") == ("call", "lookup")
    assert route("<|channel|>commentary to=browser.search") == ("content", "")


def test_harmony_markers_never_leak_while_streaming():
    text = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>answer")
    p = HarmonyParser(RID)
    out = [p.feed(ch) for ch in text]
    assert all("<|" not in r + c and "|>" not in r + c for r, c, _ in out)


# ---------------------------------------------------------------- the whole-output shape


def test_parse_output_without_parsers_is_the_text():
    spec = OutputSpec()
    assert parse_output('<tool_call>{"name": "f", "arguments": {}}</tool_call>', spec, RID)["tool_calls"] == []
    assert ChoiceParser(spec, RID).feed("<think>x</think>") == ("", "<think>x</think>", [])


def test_streamed_calls_carry_indexes_and_same_ids_as_whole():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    _, _, calls = run_choice(HERMES, [text])
    assert [c["index"] for c in calls] == [0, 1]
    whole = parse_output(text, HERMES, RID)["tool_calls"]
    assert [c["id"] for c in calls] == [c["id"] for c in whole]
    assert ToolCallStream(RID).feed(text)[1][0]["id"] == calls[0]["id"]  # the Hermes parser's own ids
