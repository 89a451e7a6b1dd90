"""Chat per model family through the real gateway (issue 28): real HTTP on loopback, real Redis, the
`openai` SDK, and a model directory per family (tests/chat_family.py: the family's chat template,
its markers in the tokenizer as the real checkpoints have them). A fake worker records each
admitted request and answers with a scripted text encoded by that family's tokenizer, special
tokens included, the way the model would write it; the engine's tokens are not what is tested
here (the lead's family checkpoints wire that end to end), the gateway's reading of them is:
the prompt the template renders, thinking into `reasoning_content`, the family's calls into
`tool_calls`, forced calls in the family's wrapper, the template's refusals as 400s, and a
resumed stream parsed alike."""
from __future__ import annotations

import asyncio
import json
import threading
import uuid

import httpx
import pytest

openai = pytest.importorskip("openai")

from tandem_core.models import resolve_model
from tandem_core.tokenizer import load_tokenizer
from tandem_core.types import GenerationRequest
from tests.chat_family import family_dir
from tests.integration.scripted_worker import serve_scripted
from tests.integration.test_gateway_relay import Gateway, _settings

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
USER = [{"role": "user", "content": "weather in Paris?"}]


class Family:
    """One family's gateway, the fake worker's next reply and the requests it saw."""

    def __init__(self, path) -> None:
        self.tok = load_tokenizer(resolve_model(str(path)))
        self.reply = "hello"
        self.seen: list[GenerationRequest] = []

    def prompt(self) -> str:
        return self.tok.decode(self.seen[-1].prompt_ids, skip_special_tokens=False)


async def _serve(redis_url: str, pool: str, fam: Family, stop: threading.Event) -> None:
    def answer(req: GenerationRequest) -> list[int]:
        return fam.tok.encode(fam.reply, add_special_tokens=False) + [fam.tok.eos_token_ids[0]]

    await serve_scripted(redis_url, pool, "fam", answer, fam.seen, stop)


@pytest.fixture(scope="module")
def families(redis_url, tmp_path_factory):
    """family name -> (gateway, Family), one gateway per family template."""
    stop, threads, out = threading.Event(), [], {}
    tmp = tmp_path_factory.mktemp("families")
    try:
        for name in ("qwen3", "gpt_oss", "mistral_v11", "gemma2"):
            path = family_dir(tmp, name)
            pool = f"gfam-{name}-{uuid.uuid4().hex[:6]}"
            fam = Family(path)
            t = threading.Thread(target=lambda p=pool, f=fam: asyncio.run(_serve(redis_url, p, f, stop)), daemon=True)
            t.start()
            threads.append(t)
            settings = _settings(redis_url, pool, served_model_name=name, max_prompt_len=4096, max_context_len=8192,
                                 max_tokens_limit=256).model_copy(update={"model": str(path)})
            gw = Gateway(settings).start()
            out[name] = (gw, fam)
        yield out
    finally:
        for gw, _ in out.values():
            gw.stop()
        stop.set()
        for t in threads:
            t.join(timeout=10)


def _client(gw) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _stream(gw, model: str, **kw) -> tuple[str, str, dict, str | None]:
    """(reasoning, content, calls by index, finish) assembled from the streamed deltas."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in _client(gw).chat.completions.create(model=model, stream=True, max_tokens=128, **kw):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_qwen3_thinking_is_reasoning_content(families):
    gw, fam = families["qwen3"]
    fam.reply = "<think>\nThey want the weather.\n</think>\n\nIt is sunny."
    out = _client(gw).chat.completions.create(model="qwen3", messages=USER, max_tokens=128)
    msg = out.choices[0].message
    assert msg.model_extra["reasoning_content"] == "\nThey want the weather.\n" and msg.content == "\n\nIt is sunny."
    assert fam.prompt().endswith("<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert _stream(gw, "qwen3", messages=USER) == ("\nThey want the weather.\n", "\n\nIt is sunny.", {}, "stop")


def test_qwen3_enable_thinking_false_and_a_hermes_call(families):
    gw, fam = families["qwen3"]
    fam.reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    out = _client(gw).chat.completions.create(model="qwen3", messages=USER, tools=[WEATHER], max_tokens=128,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert fam.prompt().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "<tools>" in fam.prompt()
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] is None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_gpt_oss_analysis_and_commentary_call(families):
    gw, fam = families["gpt_oss"]
    fam.reply = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>"
                 'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
    out = _client(gw).chat.completions.create(model="gpt_oss", messages=USER, tools=[WEATHER], max_tokens=128)
    choice = out.choices[0]
    ends = [fam.tok.encode(t, add_special_tokens=False)[0] for t in ("<|return|>", "<|call|>")]
    assert set(ends) <= set(fam.seen[-1].stop_token_ids)  # the turn ends there, whatever config.json's EOS
    assert fam.prompt().endswith("<|start|>user<|message|>weather in Paris?<|end|><|start|>assistant")
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in fam.prompt()
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather tool."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] \
        == [("get_weather", '{"city":"Paris"}')]
    reasoning, content, calls, finish = _stream(gw, "gpt_oss", messages=USER, tools=[WEATHER])
    assert (reasoning, content.strip(), finish) == ("Need the weather tool.", "", "tool_calls")
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city":"Paris"}'


def test_gpt_oss_final_answer_and_forced_call_grammar(families):
    gw, fam = families["gpt_oss"]
    fam.reply = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi there!"
    out = _client(gw).chat.completions.create(model="gpt_oss", messages=USER, max_tokens=64, reasoning_effort="low")
    assert "Reasoning: low" in fam.prompt()
    _client(gw).chat.completions.create(model="gpt_oss", messages=USER, max_tokens=64, reasoning_effort="low",
                                        extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    assert "Reasoning: high" in fam.prompt()
    msg = out.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"]) == ("Hi there!", "Easy.")
    fam.reply = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    out = _client(gw).chat.completions.create(model="gpt_oss", messages=USER, tools=[WEATHER], max_tokens=64,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ids = {t: fam.tok.encode(t, add_special_tokens=False)[0] for t in ("<|channel|>", "<|constrain|>", "<|message|>")}
    g = fam.seen[-1].grammar["grammar"]
    assert g.startswith(f'start: <[{ids["<|channel|>"]}]> "commentary to=functions." body\n')
    assert f'"get_weather " <[{ids["<|constrain|>"]}]> "json" <[{ids["<|message|>"]}]> %json' in g
    assert out.choices[0].message.tool_calls[0].function.arguments == '{"city":"Paris"}'


def test_gpt_oss_resumed_stream_is_parsed_alike(families):
    gw, fam = families["gpt_oss"]
    fam.reply = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    body = {"model": "gpt_oss", "messages": USER, "stream": True, "resumable": True, "max_tokens": 64}
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        first = http.post("/v1/chat/completions", json=body)
        rid = first.headers["X-Request-Id"]
        again = http.get(f"/v1/requests/{rid}/stream", params={"from": 0})
    assert first.status_code == again.status_code == 200

    def fields(text: str) -> tuple[str, str]:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.splitlines()
                  if line.startswith("data: {")]
        return "".join(d.get("reasoning_content", "") for d in deltas), "".join(d["content"] for d in deltas)

    assert fields(first.text) == fields(again.text) == ("Think.", "Done.")


def test_mistral_calls_get_short_ids_that_its_template_takes_back(families):
    gw, fam = families["mistral_v11"]
    fam.reply = 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    out = _client(gw).chat.completions.create(model="mistral_v11", messages=USER, tools=[WEATHER], max_tokens=64)
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].message.content == "Checking." and out.choices[0].finish_reason == "tool_calls"
    assert len(call.id) == 9 and call.function.arguments == '{"city":"Paris"}'
    assert "[AVAILABLE_TOOLS]" in fam.prompt() and fam.prompt().endswith("[INST]weather in Paris?[/INST]")
    fam.reply = "It is 21C."
    for cid in (call.id, "call_" + "7" * 24):  # its own id, and another server's long one (cut to 9)
        history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": cid, "content": "21C"}]
        out = _client(gw).chat.completions.create(model="mistral_v11", messages=history, tools=[WEATHER],
                                                  max_tokens=64)
        assert out.choices[0].message.content == "It is 21C."
        assert f"[TOOL_CALLS]get_weather[CALL_ID]{cid[-9:]}[ARGS]" in fam.prompt()


def test_gemma_system_message_is_a_400(families):
    gw, _ = families["gemma2"]
    with pytest.raises(openai.BadRequestError) as e:
        _client(gw).chat.completions.create(
            model="gemma2", messages=[{"role": "system", "content": "Be brief."}, *USER], max_tokens=8)
    assert e.value.status_code == 400 and "System role not supported" in str(e.value)
    assert e.value.body["param"] == "messages"


def test_tokenize_renders_the_chat_as_the_chat_endpoint_does(families):
    gw, fam = families["qwen3"]
    body = {"model": "qwen3", "messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    got = httpx.post(f"{gw.url}/tokenize", json=body, timeout=30).json()
    assert fam.tok.decode(got["tokens"], skip_special_tokens=False).endswith("assistant\n<think>\n\n</think>\n\n")
    gw, fam = families["mistral_v11"]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_" + "8" * 24, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_" + "8" * 24, "content": "21C"}]
    got = httpx.post(f"{gw.url}/tokenize", json={"model": "mistral_v11", "messages": history}, timeout=30)
    assert got.status_code == 200 and "[CALL_ID]888888888[ARGS]" in fam.tok.decode(got.json()["tokens"],
                                                                                  skip_special_tokens=False)
