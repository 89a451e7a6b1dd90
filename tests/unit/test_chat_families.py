"""Chat per model family at the gateway (issue 28): each family's chat template renders with tools
and its reasoning toggle exactly as transformers renders it; the family's output format is chosen
from the template (and config.json's model_type); forced tool calls keep their grammar guarantee
in the family's own wrapper (checked by llguidance with a tokenizer that has the family's special
tokens, then parsed back into the call from the decoded ids); the response formatter puts
thinking into `reasoning_content`, streamed and whole; resumable streams keep all of it.

The templates are tests/fixtures/chat_templates (see its README). Set TANDEM_CHAT_TEMPLATES_DIR to
a directory of the published templates (`<family>.jinja`) to render those too."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gateway.chat import ChatTemplate, read_template
from gateway.chatformat import ChatFormat, ChatFormatError, ChoiceParser, detect, model_type
from gateway.relay import Delta
from gateway.resume import ResumeRecord, StreamMeta
from gateway.schemas import ChatBody
from gateway.sse import Formatter
from gateway.tools import CallSyntax, ToolDef, call_grammar
from tandem_core.errors import InvalidRequest
from tests.chat_family import TEMPLATES, family_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time"}}
CALL = {"id": "call_0123456789abcdef01234567", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "weather in Paris?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Paris?"}],
    "tool history": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "I need the tool."},
        {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": CALL["id"]},
        {"role": "assistant", "content": "21C and sunny."}, {"role": "user", "content": "thanks"}],
}
FAMILIES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
# what each family's template refuses, by conversation
REFUSES = {("gemma2", "system"): "System role not supported", ("gemma2", "tool history"): "System role",
           ("gemma3", "tool history"): "roles must alternate"}


def _templates() -> list[tuple[str, Path]]:
    out = [(f, TEMPLATES / f"{f}.jinja") for f in FAMILIES]
    real = os.environ.get("TANDEM_CHAT_TEMPLATES_DIR")
    if real:
        out += [(f"published:{p.stem}", p) for p in sorted(Path(real).glob("*.jinja"))]
    return out


def _render_like_transformers(source: str, messages: list[dict], tools, kwargs: dict) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    from gateway.chat import _for_template

    rendered, _ = render_jinja_template([[_for_template(m) for m in messages]], tools=tools, chat_template=source,
                                        add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                                        pad_token="", unk_token="", **kwargs)
    return rendered[0]


# ---------------------------------------------------------------- the templates render, as transformers renders them


@pytest.mark.parametrize("name,path", _templates(), ids=[n for n, _ in _templates()])
def test_each_template_renders_like_transformers(name, path):
    pytest.importorskip("transformers")
    source = path.read_text()
    tmpl = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    fmt = ChatFormat(*detect(source, ""), template=source)
    rendered = 0
    for conv, msgs in CONVERSATIONS.items():
        msgs = fmt.history(msgs)
        for tools in (None, [WEATHER, TIME]):
            for kwargs in ({}, {"enable_thinking": False}, {"reasoning_effort": "high"}):
                try:
                    want = _render_like_transformers(source, msgs, tools, kwargs)
                except Exception as e:  # noqa: BLE001 - the template's own refusal
                    with pytest.raises(InvalidRequest) as got:
                        tmpl.render(msgs, tools, kwargs)
                    assert got.value.param == "messages" and str(e) in got.value.message
                    assert REFUSES.get((name.removeprefix("published:"), conv), "?") in str(e), (conv, str(e))
                    continue
                assert tmpl.render(msgs, tools, kwargs) == want, (conv, bool(tools), kwargs)
                rendered += 1
    assert rendered >= 6


def _render(family: str, conv: str = "one turn", tools=None, **kwargs) -> str:
    source = (TEMPLATES / f"{family}.jinja").read_text()
    fmt = ChatFormat(*detect(source, ""), template=source)
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
        fmt.history(CONVERSATIONS[conv]), tools, kwargs)


def test_qwen_templates_show_tools_and_the_thinking_toggle():
    for family in ("qwen2_5", "qwen3"):
        text = _render(family, tools=[WEATHER])
        assert "<tools>\n" + json.dumps(WEATHER) in text and "<tool_call>\n{\"name\": <function-name>" in text
        assert text.endswith("<|im_start|>assistant\n")
    assert _render("qwen3", enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _render("qwen3_thinking").endswith("<|im_start|>assistant\n<think>\n")
    history = _render("qwen3", "tool history", [WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in history
    assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in history
    assert "I need the tool." not in history  # thinking before the last user turn is dropped


def test_gpt_oss_template_takes_the_reasoning_effort_and_the_functions():
    text = _render("gpt_oss", "system", [WEATHER], reasoning_effort="high")
    assert "Reasoning: high" in text and "# Instructions\n\nBe brief." in text
    assert "type get_weather = (_: {\n// the city\ncity: string,\nunit?: \"c\" | \"f\",\n}) => any;" in text
    assert text.endswith("<|start|>user<|message|>weather in Paris?<|end|><|start|>assistant")
    history = _render("gpt_oss", "tool history", [WEATHER])
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>') in history


def test_mistral_history_ids_are_cut_to_what_its_template_accepts():
    for family, piece in (("mistral_v3", '"id": "f01234567"}]'), ("mistral_v11", "[CALL_ID]f01234567[ARGS]")):
        text = _render(family, "tool history", [WEATHER])
        assert piece in text and "[AVAILABLE_TOOLS]" in text
        assert ChatFormat("hermes").history(CONVERSATIONS["tool history"])[2]["tool_calls"][0]["id"] == CALL["id"]
    with pytest.raises(InvalidRequest, match="length 9"):  # the template's own check, without the fix-up
        ChatTemplate((TEMPLATES / "mistral_v3.jinja").read_text()).render(CONVERSATIONS["tool history"])


def test_gemma_without_system_role_is_a_clear_400():
    with pytest.raises(InvalidRequest) as e:
        _render("gemma2", "system")
    assert e.value.http_status == 400 and e.value.param == "messages"
    assert "System role not supported" in e.value.message and "template" in e.value.message
    assert _render("gemma3", "system").startswith("<s><start_of_turn>user\nBe brief.\n\nweather in Paris?")


def test_chat_template_kwargs_cannot_set_the_render_arguments():
    with pytest.raises(InvalidRequest) as e:
        _render("qwen3", add_generation_prompt=False)
    assert e.value.param == "chat_template_kwargs" and "add_generation_prompt" in e.value.message
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}],
                                    "chat_template_kwargs": {"enable_thinking": False}})
    assert body.chat_template_kwargs == {"enable_thinking": False}


def test_template_file_beside_the_tokenizer_wins(tmp_path):
    d = family_dir(tmp_path, "qwen2_5")
    assert "Qwen" in read_template(d)[0]
    (d / "chat_template.jinja").write_text((TEMPLATES / "gemma3.jinja").read_text())
    source, tokens = read_template(d)
    assert "<start_of_turn>" in source and tokens["bos_token"] == "<s>"


def test_past_thinking_reaches_the_template_under_both_names():
    body = ChatBody.model_validate({"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "why"},
        {"role": "user", "content": "q2"}]})
    msgs = body.chat_messages()
    assert msgs[1]["reasoning_content"] == "why"
    src = "{% for m in messages %}{{ m.thinking or '' }}|{{ m.reasoning_content or '' }};{% endfor %}"
    assert ChatTemplate(src).render(msgs) == "|;why|why;|;"
    with pytest.raises(InvalidRequest, match="assistant message only"):
        ChatBody.model_validate({"messages": [{"role": "user", "content": "q", "reasoning": "x"}]}).chat_messages()


# ---------------------------------------------------------------- choosing the format


@pytest.mark.parametrize("family,want", [
    ("qwen2_5", ("hermes", "")), ("qwen3", ("hermes", "qwen3")), ("qwen3_thinking", ("hermes", "qwen3")),
    ("gemma2", ("hermes", "")), ("gemma3", ("hermes", "")), ("mistral_v3", ("mistral", "")),
    ("mistral_v11", ("mistral", "")), ("gpt_oss", ("openai", "openai_gptoss")),
])
def test_format_is_read_from_the_template(family, want):
    assert detect((TEMPLATES / f"{family}.jinja").read_text(), "llama") == want


def test_format_from_model_type_settings_and_errors(tmp_path):
    assert detect(None, "gpt_oss") == ("openai", "openai_gptoss")
    assert detect(None, "qwen3_moe") == ("hermes", "qwen3") and detect(None, "mixtral") == ("mistral", "")
    assert detect(None, "llama") == ("hermes", "")
    assert detect("{{ messages }}", "mistral") == ("mistral", "")  # a template without markers: the family's
    qwen3 = (TEMPLATES / "qwen3.jinja").read_text()
    assert detect(qwen3, "qwen3", reasoning="none") == ("hermes", "")
    assert detect(qwen3, "qwen3", reasoning="deepseek_r1", tool_parser="mistral") == ("mistral", "deepseek_r1")
    with pytest.raises(ChatFormatError, match="reasoning_parser 'nope'"):
        detect(qwen3, "qwen3", reasoning="nope")
    with pytest.raises(ChatFormatError, match="needs reasoning_parser openai_gptoss"):
        detect(qwen3, "qwen3", tool_parser="openai")
    d = family_dir(tmp_path, "qwen3", model_type="qwen3")
    assert model_type(str(d)) == "qwen3" and model_type(None) == ""


def test_settings_offer_exactly_the_registered_parsers():
    from typing import get_args

    from gateway.chatformat import REASONING, TOOLS
    from gateway.settings import GatewaySettings

    fields = GatewaySettings.model_fields
    assert set(get_args(fields["reasoning_parser"].annotation)) == {"auto", "none", *REASONING}
    assert set(get_args(fields["tool_call_parser"].annotation)) == {"auto", *TOOLS}


def test_prompt_decides_where_the_thinking_starts():
    fmt = ChatFormat("hermes", "qwen3")
    assert fmt.output(_render("qwen3_thinking"), True).reasoning_open
    assert not fmt.output(_render("qwen3"), True).reasoning_open
    assert not fmt.output(_render("qwen3", enable_thinking=False), False).reasoning_open
    assert not ChatFormat("openai", "openai_gptoss").output("<think>", False).reasoning_open
    assert ChatFormat("openai", "openai_gptoss").keeps_specials(False)
    assert ChatFormat("mistral").keeps_specials(True) and not ChatFormat("mistral").keeps_specials(False)
    assert not ChatFormat("hermes", "qwen3").keeps_specials(True)


# ---------------------------------------------------------------- forced calls in the family's format


def _family_tokenizer(tmp_path, family: str):
    from tandem_core.models import resolve_model
    from tandem_core.tokenizer import load_tokenizer

    d = family_dir(tmp_path, family)
    return load_tokenizer(resolve_model(str(d))), (d / "tokenizer_config.json")


FORCED = {  # family -> (an accepted call as the model writes it, one that must be refused)
    "qwen3": ('<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',
              '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>'),
    "mistral_v3": ('[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"}}]',
                   '[TOOL_CALLS][{"name":"get_weather","arguments":{"town":"Paris"}}]'),
    "mistral_v11": ('[TOOL_CALLS]get_weather[ARGS]{"city":"Paris"}', '[TOOL_CALLS]get_time[ARGS]{"city":"Paris"}'),
    "gpt_oss": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}',
                '<|channel|>analysis<|message|>{"city":"Paris"}'),
}


@pytest.mark.parametrize("family", sorted(FORCED))
def test_forced_call_grammar_emits_the_family_wrapper(tmp_path, family):
    grammar = pytest.importorskip("tandem_core.grammar")
    from tandem_core.tokenizer import Detokenizer

    tok, _ = _family_tokenizer(tmp_path, family)
    source = (TEMPLATES / f"{family}.jinja").read_text()
    fmt = ChatFormat(*detect(source, ""), template=source, tokenizer=tok)
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    spec = body.to_params(fmt.syntax).grammar
    assert body.tool_plan().grammar == spec
    if fmt.tool_parser != "hermes":
        assert "<[" in spec["grammar"]  # the markers are special tokens, emitted by id
    compiled = grammar.compile_spec(spec, tok)
    good, bad = FORCED[family]

    def accepted(text: str) -> list[int] | None:
        m = compiled.matcher()
        ids = tok.encode(text, add_special_tokens=False)
        for i in ids:
            if not (int(m.mask()[i // 32]) >> (i % 32)) & 1:  # packed bitmask: what sampling may draw
                return None
            m.consume(i)
        return ids if m.accepting() else None

    ids = accepted(good)
    assert ids is not None and accepted(bad) is None
    # the ids the grammar allowed, decoded as the relay decodes them for this family, parse to the call
    det = Detokenizer(tok, skip_special_tokens=not fmt.keeps_specials(True))
    text = "".join(det.feed(i) for i in ids) + det.flush()
    out = ChoiceParser(fmt.output("", True), "r")
    r, c, calls = out.feed(text)
    r2, c2, calls2 = out.finish()
    assert [(k["function"]["name"], k["function"]["arguments"]) for k in calls + calls2] \
        == [("get_weather", '{"city":"Paris"}')], text
    assert (c + c2).strip() == "" and r + r2 == ""


def test_required_with_parallel_calls_per_family():
    tools = [ToolDef.model_validate(WEATHER), ToolDef.model_validate(TIME)]
    assert call_grammar(tools, True, CallSyntax("mistral", (("[TOOL_CALLS]", "<[7]>"),)))["grammar"].startswith(
        'start: <[7]> "[" body ("," body){0,7} "]"\n')
    assert call_grammar(tools, True, CallSyntax("mistral_args"))["grammar"].startswith(
        'start: call{1,8}\ncall: "[TOOL_CALLS]" body\n')
    harmony = call_grammar(tools, True, CallSyntax("harmony"))["grammar"]
    assert harmony.startswith('start: "<|channel|>" "commentary to=functions." body\n')  # one call per message


# ---------------------------------------------------------------- the response: reasoning_content, streamed and whole


def _meta(**kw) -> StreamMeta:
    return StreamMeta(kind="chat", request_id="chatcmpl-x", created=0, model="m", prompt_tokens=3, **kw)


def _deltas(text: str, size: int = 3) -> list[Delta]:
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    return [Delta(index=i, token_id=i, text=t, finish_reason="stop" if i == len(chunks) - 1 else None,
                  completion_tokens=i + 1) for i, t in enumerate(chunks)]


HARMONY_OUT = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}')


@pytest.mark.parametrize("meta,text,want", [
    (_meta(reasoning="qwen3"), "<think>\nHmm.\n</think>\n\nHello!",
     {"reasoning_content": "\nHmm.\n", "content": "\n\nHello!", "finish": "stop", "calls": []}),
    (_meta(reasoning="openai_gptoss", tool_parser="openai", tools=True), HARMONY_OUT,
     {"reasoning_content": "Need the weather.", "content": None, "finish": "tool_calls",
      "calls": [("get_weather", '{"city":"Paris"}')]}),
    (_meta(tools=True, tool_parser="mistral"), '[TOOL_CALLS]get_time[ARGS]{}',
     {"reasoning_content": None, "content": None, "finish": "tool_calls", "calls": [("get_time", "{}")]}),
])
def test_formatter_streams_and_collects_reasoning_content(meta, text, want):
    deltas = _deltas(text)
    streamed = Formatter(meta)
    chunks = [streamed.chunk(d)["choices"][0] for d in deltas]
    got_reasoning = "".join(c["delta"].get("reasoning_content", "") for c in chunks)
    got_content = "".join(c["delta"]["content"] for c in chunks)
    calls = [(k["function"]["name"], k["function"]["arguments"])
             for c in chunks for k in c["delta"].get("tool_calls", [])]
    assert (got_reasoning or None) == want["reasoning_content"] and calls == want["calls"]
    assert (got_content.strip() or None) == (want["content"].strip() if want["content"] else None)
    assert chunks[-1]["finish_reason"] == want["finish"] and chunks[0]["delta"]["role"] == "assistant"
    assert all("<|" not in c["delta"]["content"] and "[TOOL_CALLS]" not in c["delta"]["content"] for c in chunks)
    whole = Formatter(meta)
    for d in deltas:
        whole.add(d)
    choice = whole.whole()["choices"][0]
    msg = choice["message"]
    assert msg["content"] == want["content"] and choice["finish_reason"] == want["finish"]
    assert msg.get("reasoning_content") == want["reasoning_content"]
    assert ("reasoning_content" in msg) == bool(meta.reasoning)
    assert [(k["function"]["name"], k["function"]["arguments"]) for k in msg.get("tool_calls", [])] == want["calls"]


def test_plain_chat_is_unchanged():
    whole = Formatter(_meta())
    for d in _deltas("<think>x</think>"):
        whole.add(d)
    msg = whole.whole()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "<think>x</think>", "refusal": None}


def test_resume_record_keeps_the_output_format_and_reads_old_records():
    meta = _meta(reasoning="qwen3", reasoning_open=True, tool_parser="mistral", tools=True)
    rec = ResumeRecord(meta=meta, stop=[], max_tokens=5, stop_token_ids=[1], deadline_ts=1.0, skip_special_tokens=False)
    back = ResumeRecord.from_json(rec.to_json())
    assert back == rec and back.meta.reasoning_open and not back.skip_special_tokens
    old = json.loads(rec.to_json())
    for k in ("reasoning", "reasoning_open", "tool_parser"):
        del old["meta"][k]
    del old["skip_special_tokens"]
    prior = ResumeRecord.from_json(json.dumps(old))
    assert prior.meta.tool_parser == "hermes" and prior.meta.reasoning == "" and prior.skip_special_tokens
