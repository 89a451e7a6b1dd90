"""Structured outputs and tool calling through the whole cluster, with the real clients: valid
JSON every time at temperature 1, even from the 4M-parameter built-in model, because every
sampled token is masked by the request's grammar (prefill pod, decode pod, colocated alike)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field


pytestmark = pytest.mark.e2e
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]
LONG_PROMPT = "Describe one person as JSON. " * 6  # past direct_prefill_max_tokens: the prefill pod


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)


def _client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("prompt", ["Person:", LONG_PROMPT], ids=["decode-prefills", "prefill-pod"])
def test_json_schema_is_valid_ten_times_in_ten(both_paths, prompt):
    client = _client(both_paths)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for i in range(10):
        r = client.chat.completions.create(model=both_paths.model, messages=[{"role": "user", "content": prompt}],
                                           response_format=fmt, temperature=1.0, seed=i, max_tokens=256)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_and_guided_extras(both_paths):
    client = _client(both_paths)
    r = client.chat.completions.create(model=both_paths.model, messages=[{"role": "user", "content": "JSON:"}],
                                       response_format={"type": "json_object"}, temperature=1.0, max_tokens=128)
    if r.choices[0].finish_reason != "length":  # an open object may run past max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(model=both_paths.model, prompt="Answer:", max_tokens=8, temperature=1.0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert c.choices[0].text in ("yes", "no")
    c = client.completions.create(model=both_paths.model, prompt="Code:", max_tokens=8, temperature=1.0,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert len(c.choices[0].text) == 6 and c.choices[0].text[3] == "-"


def test_langchain_with_structured_output(both_paths):
    """json_schema: a validated Person 10 times in 10. json_mode only promises a JSON object (the
    schema is not sent), so that is what is checked: the raw reply parses as one, every time."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=both_paths.model, base_url=both_paths.base_url + "/v1", api_key="unused", temperature=1.0,
                     max_tokens=256, max_retries=0)
    structured = llm.with_structured_output(Person, method="json_schema")
    for _ in range(10):
        assert isinstance(structured.invoke("Describe a person as JSON with name and age."), Person)
    # json_mode sends no schema: the grammar is "any JSON object", which bounds nothing, and the
    # built-in model often runs past max_tokens inside it (a known limit, in docs/limits.md)
    raw = llm.with_structured_output(Person, method="json_mode", include_raw=True)
    for _ in range(3):
        try:
            out = raw.invoke("Describe a person as JSON with name and age.")
        except openai.LengthFinishReasonError:
            continue
        assert isinstance(json.loads(out["raw"].content), dict)


def test_tools_required_and_named_give_valid_arguments(both_paths):
    client = _client(both_paths)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for i in range(5):
            r = client.chat.completions.create(model=both_paths.model, messages=msgs, tools=TOOLS, tool_choice=choice,
                                               temperature=1.0, seed=i, max_tokens=200)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls, r
            call = msg.tool_calls[0]
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # the call and its result sent back as history are accepted
    history = msgs + [msg.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 12}'}]
    r = client.chat.completions.create(model=both_paths.model, messages=history, tools=TOOLS, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_call_deltas_assemble(both_paths):
    client = _client(both_paths)
    stream = client.chat.completions.create(
        model=both_paths.model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
        tool_choice="required", temperature=1.0, max_tokens=200, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for ch in stream:
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function and tc.function.name:
                c["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for c in calls.values():
        assert c["name"] == "get_weather"
        jsonschema.validate(json.loads(c["arguments"]), WEATHER)


def test_langchain_bind_tools(both_paths):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=both_paths.model, base_url=both_paths.base_url + "/v1", api_key="unused", temperature=1.0,
                     max_tokens=200, max_retries=0)
    msg = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER)
