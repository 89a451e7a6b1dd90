"""Structured outputs and tools through the real clients (issue 13), over real HTTP on loopback:
the `openai` SDK and langchain-openai against the gateway, real Redis, and a fake worker that
records each admitted request and answers with a scripted text (the workers' constrained decoding
is theirs to test; this checks what the clients send is accepted, reaches the request as the right
grammar and prompt, and that what comes back parses in the clients: tool calls, streamed deltas,
structured objects)."""
from __future__ import annotations

import asyncio
import json
import threading
import uuid

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel

from tandem_core.models import BYTE_EOS
from tandem_core.types import GenerationRequest
from tests.integration.scripted_worker import serve_scripted
from tests.integration.test_gateway_relay import Gateway, _settings

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class Script:
    """What the fake worker answers next, and the requests it saw."""

    def __init__(self) -> None:
        self.reply = "hello"
        self.seen: list[GenerationRequest] = []


async def _serve(redis_url: str, pool: str, script: Script, stop: threading.Event) -> None:
    await serve_scripted(redis_url, pool, "tools", lambda req: [*script.reply.encode(), BYTE_EOS], script.seen, stop)


def _run(redis_url: str, pool: str, script: Script, stop: threading.Event) -> None:
    try:
        asyncio.run(_serve(redis_url, pool, script, stop))
    except BaseException as e:
        script.error = e
        raise


@pytest.fixture(scope="module")
def gw(redis_url):
    pool = f"gtools-{uuid.uuid4().hex[:8]}"
    script, stop = Script(), threading.Event()
    worker = threading.Thread(target=lambda: _run(redis_url, pool, script, stop), daemon=True)
    worker.start()
    g = Gateway(_settings(redis_url, pool, max_prompt_len=2048, max_context_len=4096, max_tokens_limit=256)).start()
    g.script = script
    try:
        yield g
    finally:
        g.stop()
        stop.set()
        worker.join(timeout=10)


def _client(gw) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _prompt(req: GenerationRequest) -> str:
    return bytes(t for t in req.prompt_ids if t < 256).decode()


def test_openai_named_tool_choice(gw):
    gw.script.reply = CALL
    out = _client(gw).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=128)
    req = gw.script.seen[-1]
    assert req.grammar["kind"] == "lark" and '"name":{"const":"get_weather"}' in req.grammar["grammar"]
    assert "<tools>" in _prompt(req) and '"name": "get_weather"' in _prompt(req)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert call.function.name == "get_weather" and args == {"city": "Paris"}


def test_openai_streamed_tool_call_deltas_assemble(gw):
    gw.script.reply = "Checking. " + CALL
    stream = _client(gw).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], stream=True,
        max_tokens=128)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert gw.script.seen[-1].grammar is None  # "auto": free text, parsed
    assert content == "Checking. " and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_openai_history_with_a_tool_result(gw):
    gw.script.reply = "It is 21C in Paris."
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    out = _client(gw).chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=64)
    assert out.choices[0].message.content == "It is 21C in Paris." and out.choices[0].finish_reason == "stop"
    prompt = _prompt(gw.script.seen[-1])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<|tool|>\n' in prompt


class Person(BaseModel):
    name: str
    age: int


def test_openai_parse_response_format(gw):
    gw.script.reply = '{"name": "Ada", "age": 36}'
    out = _client(gw).beta.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "a person"}], response_format=Person, max_tokens=64)
    assert out.choices[0].message.parsed == Person(name="Ada", age=36)
    grammar = gw.script.seen[-1].grammar
    assert grammar["kind"] == "json_schema" and grammar["schema"]["required"] == ["name", "age"]


def test_openai_guided_extras_on_completions(gw):
    gw.script.reply = "yes"
    out = _client(gw).completions.create(model="tiny", prompt="ok?", max_tokens=8,
                                         extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text == "yes"
    assert gw.script.seen[-1].grammar == {"kind": "choice", "choices": ["yes", "no"]}
    with pytest.raises(openai.BadRequestError) as e:
        _client(gw).completions.create(model="tiny", prompt="ok?", max_tokens=8,
                                       extra_body={"guided_choice": ["yes"], "guided_regex": "y"})
    assert e.value.body["param"] == "guided_choice"


def _langchain(gw):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(model="tiny", base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30,
                         max_tokens=128)


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str


def test_langchain_bind_tools_invoke_stream_and_tool_message(gw):
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = _langchain(gw).bind_tools([GetWeather], tool_choice="GetWeather")
    gw.script.reply = '<tool_call>{"name": "GetWeather", "arguments": {"city": "Paris"}}</tool_call>'
    msg = llm.invoke("weather in Paris?")
    assert msg.tool_calls[0]["name"] == "GetWeather" and msg.tool_calls[0]["args"] == {"city": "Paris"}
    assert gw.script.seen[-1].grammar["kind"] == "lark"
    GetWeather.model_validate(msg.tool_calls[0]["args"])
    total = None
    for chunk in llm.stream("weather in Paris?"):
        total = chunk if total is None else total + chunk
    assert total.tool_calls[0]["args"] == {"city": "Paris"}
    gw.script.reply = "21C."
    history = [HumanMessage("weather in Paris?"), msg,
               ToolMessage('{"temp_c": 21}', tool_call_id=msg.tool_calls[0]["id"])]
    assert _langchain(gw).bind_tools([GetWeather]).invoke(history).content == "21C."
    assert "<|tool|>\n{\"temp_c\": 21}\n" in _prompt(gw.script.seen[-1])


@pytest.mark.parametrize("method,kind", [("json_schema", "json_schema"), ("json_mode", "json_object")])
def test_langchain_with_structured_output(gw, method, kind):
    gw.script.reply = '{"name": "Ada", "age": 36}'
    llm = _langchain(gw).with_structured_output(Person, method=method)
    assert llm.invoke("a person, as JSON") == Person(name="Ada", age=36)
    assert gw.script.seen[-1].grammar["kind"] == kind
