"""/v1/responses through the whole cluster with the real clients: the openai SDK's
`responses.create` (plain, streamed, a tool round trip) and the OpenAI Agents SDK's default model
(OpenAIResponsesModel) with a tool and a structured final output. Then structured output that
always ends: json_object, an open json_schema and forced tool calls whose schema does not say
additionalProperties: false, at temperature 1 over 20 seeds and small max_tokens, every output
parses (the budget closes it, tandem_core/grammar.py)."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import openai
import pytest

pytestmark = pytest.mark.e2e
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
           "required": ["city"]}  # no additionalProperties: false, no maxLength: only the budget ends it
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}
OPEN = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age"]}
LONG_PROMPT = "Describe one person as JSON. " * 6  # past direct_prefill_max_tokens: the prefill pod


def _client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_responses_plain_and_streamed_agree(local_cluster):
    client = _client(local_cluster)
    kw = dict(model="builtin", instructions="Write Python.", input="def add(a, b):", max_output_tokens=12,
              temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.model == local_cluster.model
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    assert r.status == ("incomplete" if r.usage.output_tokens == 12 else "completed")
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text  # greedy: the same tokens


def test_responses_tool_round_trip(local_cluster):
    client = _client(local_cluster)
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    r = client.responses.create(model="builtin", input=[ask], tools=[TOOL], tool_choice="required",
                                max_output_tokens=64, temperature=1.0, extra_body={"seed": 1})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    back = client.responses.create(model="builtin", tools=[TOOL], max_output_tokens=16, temperature=0, input=[
        ask, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert back.output[0].type == "message"
    # the tool result reached the prompt: the round trip's prompt is longer than the question's
    assert back.usage.input_tokens > r.usage.input_tokens


def test_responses_parse_with_a_pydantic_model(local_cluster):
    """`responses.parse(text_format=Model)`: text.format json_schema, output_parsed every time."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        population: int = Field(ge=0, le=10**8)

    client = _client(local_cluster)
    for seed in range(3):
        r = client.responses.parse(model="builtin", input="A city as JSON.", text_format=City, temperature=1.0,
                                   max_output_tokens=64, extra_body={"seed": seed})
        assert r.status == "completed" and isinstance(r.output_parsed, City)


def test_agents_sdk_default_model(local_cluster):
    """Agent + Runner.run with the SDK's default (Responses) model pointed at the cluster: a forced
    tool call, the tool's result sent back, a structured final answer; then streamed."""
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_api,
                        set_default_openai_client, set_tracing_disabled)
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        city: str = Field(max_length=12)
        sunny: bool

    seen: list[str] = []

    @function_tool  # an enum argument: the call ends by itself (an output the budget closed is "incomplete",
    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # which the SDK raises on)
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    async def run() -> tuple:
        set_tracing_disabled(True)
        set_default_openai_api("responses")
        set_default_openai_client(openai.AsyncOpenAI(base_url=local_cluster.base_url + "/v1", api_key="unused",
                                                     max_retries=0, timeout=120), use_for_tracing=False)
        settings = ModelSettings(tool_choice="required", temperature=0, max_tokens=96)
        agent = Agent(name="weather", instructions="Answer about the weather.", model=local_cluster.model,
                      tools=[get_weather], output_type=Answer, model_settings=settings)
        done = await Runner.run(agent, "Is it sunny in Paris?")
        streamed = Runner.run_streamed(Agent(name="plain", model=local_cluster.model, output_type=Answer,
                                             model_settings=ModelSettings(temperature=0)), "Paris?")
        kinds = [ev.type async for ev in streamed.stream_events()]
        return done, streamed, kinds

    done, streamed, kinds = asyncio.run(run())
    assert isinstance(done.final_output, Answer) and len(seen) == 1
    assert [type(i).__name__ for i in done.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(streamed.final_output, Answer) and "raw_response_event" in kinds


CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@pytest.mark.parametrize("prompt", ["JSON:", LONG_PROMPT], ids=["decode-prefills", "prefill-pod"])
def test_structured_output_always_ends_within_max_tokens(local_cluster, prompt):
    """Temperature 1, 20 seeds, max_tokens from the smallest valid value up: every output parses;
    an output the budget closed says finish_reason "length"."""
    client = _client(local_cluster)
    msgs = [{"role": "user", "content": prompt}]
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    closed = 0
    for seed in range(20):
        mt = 12 + seed  # {"name":"","age":0} is 12 tokens of the built-in tokenizer, the smallest call 37
        kinds = [("json_object", dict(response_format={"type": "json_object"})),
                 ("json_schema", dict(response_format={"type": "json_schema",
                                                       "json_schema": {"name": "p", "schema": OPEN}})),
                 ("tool", dict(tools=[chat_tool], tool_choice="required"))]
        for kind, extra in kinds:
            r = client.chat.completions.create(model=local_cluster.model, messages=msgs, temperature=1.0,
                                               seed=seed, max_tokens=mt + (25 if kind == "tool" else 0), **extra)
            ch = r.choices[0]
            assert r.usage.completion_tokens <= mt + 25
            if kind == "tool":
                assert ch.message.tool_calls, (seed, ch)
                json.loads(ch.message.tool_calls[0].function.arguments)
            else:
                json.loads(ch.message.content)  # raises if it does not parse
            closed += ch.finish_reason == "length"
            assert ch.finish_reason in ("stop", "length", "tool_calls"), ch.finish_reason
    assert closed > 0  # at these budgets the model does not close by itself every time


def test_langchain_function_calling_with_an_open_schema(local_cluster):
    """LangChain's with_structured_output(method="function_calling"): a forced tool call whose
    schema has unbounded strings and no additionalProperties: false. At temperature 1 and a small
    max_tokens the budget closes the call, so every invocation returns the object, never None."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        city: str

    llm = ChatOpenAI(model=local_cluster.model, base_url=local_cluster.base_url + "/v1", api_key="unused",
                     temperature=1.0, max_tokens=60, max_retries=0)
    structured = llm.with_structured_output(Person, method="function_calling")
    for _ in range(5):
        assert isinstance(structured.invoke("Describe a person."), Person)
