"""/v1/responses without a cluster: a Responses body becomes the chat body that serves it (items,
instructions, tools, tool outputs, text.format), what a stateless server cannot do is a 400 that
says so, and the chat path's chunks become the Responses events in OpenAI's order (text, reasoning
from <think>, function calls), closing with response.completed or response.incomplete."""
from __future__ import annotations

import pytest

from gateway import responses as R
from tandem_core.errors import InvalidRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}


def test_items_become_the_chat_conversation():
    body = R.parse({"model": "builtin", "instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]},
    ], "tools": [TOOL], "tool_choice": "auto", "max_output_tokens": 20, "temperature": 0.5, "store": False,
        "include": [], "text": {"format": {"type": "json_schema", "name": "a", "schema": WEATHER}}})
    chat = R.to_chat(body)
    msgs = chat.chat_messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "system"]
    assert msgs[2]["content"] == "Let me look."
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert msgs[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert chat.max_tokens == 20 and chat.temperature == 0.5
    assert chat.tools[0].function.name == "get_weather"
    assert chat.response_format.json_schema.schema_ == WEATHER


def test_a_forced_call_wins_over_the_text_format():
    body = R.parse({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
                    "text": {"format": {"type": "json_object"}}})
    chat = R.to_chat(body)
    assert chat.response_format is None and chat.tool_plan().grammar is not None


@pytest.mark.parametrize("data, param, words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "whole conversation"),
    ({"input": "hi", "background": True}, "background", "stateless"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "item_reference"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "web_search_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "input_image"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "user"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "call"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "function"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "no message"),
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "no message"),
])
def test_what_cannot_be_served_is_a_400_that_says_why(data, param, words):
    with pytest.raises(InvalidRequest, match=words) as e:
        R.to_chat(R.parse(data))
    assert e.value.param == param


def _chunk(text="", calls=(), finish=None):
    delta = {"content": text}
    if calls:
        delta["tool_calls"] = list(calls)
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _shaper(**kw):
    return R.Shaper(R.parse({"input": "hi", **kw}), "resp_1", "builtin", 5)


def test_events_of_a_text_answer_in_order():
    s = _shaper()
    evs = s.start() + s.feed(_chunk("Hel"), 1) + s.feed(_chunk("lo", finish="stop"), 2) + s.end()
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    done = evs[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello"
    assert done["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7}


def test_reasoning_then_text_then_a_call():
    s = _shaper()
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"P"}'}}
    evs = s.start()
    for piece in ["<thi", "nk>let me", " think</th", "ink>\nIt is", " sunny"]:
        evs += s.feed(_chunk(piece), 1)
    evs += s.feed(_chunk(calls=[call], finish="tool_calls"), 9) + s.end()
    out = evs[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"][0]["text"] == "let me think"
    assert out[1]["content"][0]["text"] == "It is sunny"
    assert out[2]["call_id"] == "call_1" and out[2]["arguments"] == '{"city":"P"}'
    kinds = [e["type"] for e in evs]
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    item_events = [(e["type"], e["item"]["type"]) for e in evs if "item" in e]
    assert item_events == [  # one item at a time: each is done before the next is added
        ("response.output_item.added", "reasoning"), ("response.output_item.done", "reasoning"),
        ("response.output_item.added", "message"), ("response.output_item.done", "message"),
        ("response.output_item.added", "function_call"), ("response.output_item.done", "function_call")]


def test_a_prompt_that_opens_think_starts_in_reasoning():
    split = R.ThinkSplit(inside=True)
    assert split.feed("hmm</think>answer") == [("reasoning", "hmm"), ("text", "answer")]
    plain = R.ThinkSplit()
    assert plain.feed("<") == [] and plain.feed("b>") == [("text", "<b>")]


def test_the_budget_ending_it_is_incomplete():
    s = _shaper(max_output_tokens=2)
    s.start()
    s.feed(_chunk("ab", finish="length"), 2)
    evs = s.end()
    assert evs[-1]["type"] == "response.incomplete"
    assert evs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
