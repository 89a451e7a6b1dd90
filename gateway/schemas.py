"""Request bodies of the OpenAI-compatible endpoints, as pydantic models (they are also what
/openapi.json documents), and their conversion into the transport-neutral `CompletionParams`.

Strict: unknown fields are rejected by name; numbers are numbers (`"4"` or `true` for an integer
is a 400 naming the field, while a JSON integer is a valid float and 4.0 a valid integer, as in
JSON Schema); the OpenAI parameters Tandem
cannot serve honestly (best_of, suffix, the legacy functions/function_call, audio ...) are rejected
with "not supported yet" unless they carry their no-op value. Structured outputs
(`response_format`, vLLM's `guided_*` and `structured_outputs`) become a grammar spec in
`structured.py`; `tools`/`tool_choice` a prompt section and maybe a grammar in `tools.py`. Range
checks that the settings or the model decide (n, logit_bias ids, lengths) live in `validation.py`,
shared with gRPC; the raw-bytes parse lives in `jsonbody.py`.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, Strict, StrictBool, StrictFloat, StrictStr,
    WithJsonSchema,
)

from gateway.jsonbody import MAX_JSON_DEPTH, load_json, parse_body, validation_error  # noqa: F401 - re-exported
from gateway.sampling_checks import check_logprobs
from gateway.structured import ChoiceList, JsonSchema, ResponseFormat, StructuredOutputs, guided_specs, one_spec
from gateway.structured import response_format_spec
from gateway.tools import HERMES, CallSyntax, ToolCallIn, ToolChoice, ToolDef, ToolPlan, history_calls, plan
from gateway.validation import CompletionParams
from tandem_core.errors import InvalidRequest

CHAT_ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions `logprobs`
_TOKEN_ID = re.compile(r"^[0-9]{1,12}$")

Number = StrictFloat  # a JSON number (an integer too), never a string or a boolean


def _integral(value: Any) -> Any:
    """4.0 is the integer 4 in JSON (and in JSON Schema); 4.5, "4" and true are not."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, Strict(), BeforeValidator(_integral)]


def _doc(default: Any = None, **schema: Any) -> Any:
    """A field whose documented bounds (JSON Schema, in /openapi.json) are enforced by the checks
    in validation.py and sampling_checks.py, with their own messages, not by pydantic."""
    return Field(default=default, json_schema_extra=schema)


# Unsupported parameters and the values that mean "off" (accepted and ignored).
NOOPS: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),  # legacy: send tools
    "function_call": (None, "none"),  # legacy: send tool_choice
    "store": (None, False),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "service_tier": (None, "auto", "default"),
}


def _const_schema(value: Any) -> dict:
    if value is None:
        return {"type": "null"}
    if value == [] or value == {}:
        return {"type": "array" if value == [] else "object", "maxItems" if value == [] else "maxProperties": 0}
    return {"const": value}


def _noop(name: str) -> Any:
    """An unsupported field: documented as accepting only its no-op values (see NOOPS)."""
    return Field(default=None, json_schema_extra={"anyOf": [_const_schema(v) for v in NOOPS[name]],
                                                  "description": "not supported yet: only its no-op values"})


def _empty() -> Any:
    """A message field the SDK writes as null or empty (`message.model_dump()`)."""
    return Field(default=None, json_schema_extra={"anyOf": [{"type": "null"}, {"const": ""},
                                                            {"type": "array", "maxItems": 0}]})


StopString = Annotated[StrictStr, Field(json_schema_extra={"minLength": 1, "maxLength": 256})]
TokenId = Annotated[JsonInt, Field(json_schema_extra={"minimum": 0})]
Bias = Annotated[Number, Field(json_schema_extra={"minimum": -100, "maximum": 100})]
TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
Content = Annotated[list[dict[str, Any]], WithJsonSchema({"type": "array", "items": TEXT_PART})]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: usage on every chunk
    include_obfuscation: StrictBool | None = None  # newer OpenAI SDKs; accepted, ignored (no padding sent)


class _Common(BaseModel):
    """Fields both endpoints share, plus the vLLM extras (`top_k`, `repetition_penalty`,
    `min_tokens`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`) and Tandem's own
    (`priority`, `resumable`, `speculative`). Upper bounds that the settings decide (max_tokens, n, stop
    strings, logit_bias entries) are not in the schema; a request past them gets a 400."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = Field(default=None, max_length=256)
    max_tokens: JsonInt | None = _doc(minimum=1)
    temperature: Number | None = _doc(minimum=0, maximum=2)
    top_p: Number | None = _doc(exclusiveMinimum=0, maximum=1)
    top_k: JsonInt | None = _doc(minimum=0)
    seed: JsonInt | None = _doc(minimum=-(2**63), maximum=2**63 - 1)
    stop: StopString | list[StopString] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: JsonInt | None = _doc(1, minimum=1)
    user: StrictStr | None = Field(default=None, max_length=256)
    presence_penalty: Number | None = _doc(minimum=-2, maximum=2)
    frequency_penalty: Number | None = _doc(minimum=-2, maximum=2)
    logit_bias: dict[str, Bias] | None = _doc(propertyNames={"pattern": "^[0-9]{1,12}$"})
    repetition_penalty: Number | None = _doc(exclusiveMinimum=0, maximum=2)
    min_tokens: JsonInt | None = _doc(minimum=0)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=4096)] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: Literal["normal", "high"] | None = None
    resumable: StrictBool = False
    speculative: StrictBool = True  # false: no speculative decoding for this request (where a pod runs it)
    guided_json: JsonSchema | StrictStr | None = None  # vLLM's structured-output extras (structured.py)
    guided_regex: StrictStr | None = None
    guided_choice: ChoiceList | None = None
    guided_grammar: StrictStr | None = None  # llguidance's Lark dialect
    structured_outputs: StructuredOutputs | None = None

    def _specs(self) -> list[tuple[str, dict]]:
        return guided_specs(self)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: int | None, logprobs: int | None, logprobs_param: str) -> CompletionParams:
        _check_unsupported(self)
        if self.resumable and self.n not in (None, 1):
            raise InvalidRequest("n must be 1 with \"resumable\": true (a resumable stream serves one choice)",
                                 param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        so = self.stream_options
        grammar_param, grammar = one_spec(self._specs())
        return CompletionParams(grammar=grammar, grammar_param=grammar_param,
            model=self.model, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos, priority=self.priority,
            n=self.n, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=_logit_bias(self.logit_bias),
            min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs,
            logprobs_param=logprobs_param, skip_special_tokens=self.skip_special_tokens,
            continuous_usage=bool(so and so.continuous_usage_stats), speculative=self.speculative,
        )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends {"<token id>": bias}; the keys must be token ids written as decimal strings."""
    if not bias:
        return None
    bad = next((k for k in bias if not _TOKEN_ID.match(k)), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias keys must be token ids (decimal strings), got {bad[:32]!r}",
                             param="logit_bias")
    return {int(k): float(v) for k, v in bias.items()}


class CompletionBody(_Common):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[TokenId] = _doc(..., minLength=1, minItems=1)
    logprobs: JsonInt | None = _doc(minimum=0, maximum=MAX_COMPLETION_LOGPROBS)  # the sampled token's + top N
    echo: StrictBool = False
    best_of: Any = _noop("best_of")
    suffix: Any = _noop("suffix")

    def to_params(self) -> CompletionParams:
        p = self._params(self.max_tokens, check_logprobs(self.logprobs, "logprobs", MAX_COMPLETION_LOGPROBS),
                         "logprobs")
        p.echo = self.echo
        prompt = self.prompt
        if isinstance(prompt, list):
            if not prompt:
                raise InvalidRequest("prompt is empty: send a non-empty string", param="prompt")
            if all(isinstance(x, int) for x in prompt):
                p.prompt_ids = list(prompt)
                return p
            if len(prompt) != 1:
                raise InvalidRequest(
                    f"prompt must be a string, a list of one string or a list of token ids; got a list of "
                    f"{len(prompt)} strings", param="prompt",
                )
            prompt = prompt[0]
        p.prompt = prompt
        return p


class ChatMessage(BaseModel):
    """One message. An assistant's `tool_calls` and a tool result's `tool_call_id` are read; the
    other assistant fields the SDK's `message.model_dump()` writes (`refusal`, `function_call`,
    `audio`, `annotations`) are accepted when null or empty."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={  # content may be omitted by the assistant only
        "if": {"properties": {"role": {"enum": ["system", "user", "developer", "tool"]}}},
        "then": {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}}})
    role: StrictStr = Field(max_length=32, json_schema_extra={"enum": [*CHAT_ROLES, *_ROLE_ALIASES]})
    content: StrictStr | Content | None = None
    name: StrictStr | None = Field(default=None, max_length=256)
    refusal: Any = _empty()
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = Field(default=None, max_length=128)
    # an assistant's earlier thinking, as this API returned it (vLLM reads both names); templates
    # that show past thinking read it (Qwen3's `reasoning_content`, gpt-oss's `thinking`)
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None
    function_call: Any = _empty()
    audio: Any = _empty()
    annotations: Any = _empty()


class ChatBody(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = _doc(..., minItems=1)
    max_completion_tokens: JsonInt | None = _doc(minimum=1)
    logprobs: StrictBool | None = None
    top_logprobs: JsonInt | None = _doc(minimum=0, maximum=20)  # with logprobs true
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    functions: Any = _noop("functions")
    function_call: Any = _noop("function_call")
    response_format: ResponseFormat | None = None
    parallel_tool_calls: StrictBool | None = None  # with tool_choice "required": false = one call
    store: Any = _noop("store")
    metadata: dict[str, StrictStr] | None = None  # accepted and ignored
    modalities: Any = _noop("modalities")
    audio: Any = _noop("audio")
    prediction: Any = _noop("prediction")
    # OpenAI's reasoning effort: handed to the chat template as `reasoning_effort` (gpt-oss's
    # template writes it into its system message, as vLLM does); templates that do not read it ignore it
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    service_tier: Any = _noop("service_tier")
    # vLLM's extra: keyword arguments for the model's chat template (`enable_thinking` for Qwen3,
    # `reasoning_effort` for gpt-oss ...); see gateway/chat.py for the names it may not set
    chat_template_kwargs: dict[str, Any] | None = None
    _call_syntax: CallSyntax = PrivateAttr(default=HERMES)

    def to_params(self, syntax: CallSyntax = HERMES) -> CompletionParams:
        """`syntax`: how the served model writes a tool call (the forced-call grammar's wrapper)."""
        self._call_syntax = syntax
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequest(
                "send max_completion_tokens or max_tokens, not both with different values",
                param="max_completion_tokens",
            )
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        p = self._params(mt, self._top_logprobs(), "top_logprobs")
        p.max_tokens_to_context = True
        return p

    def _specs(self) -> list[tuple[str, dict]]:
        spec = response_format_spec(self.response_format)
        forced = self.tool_plan().grammar
        return ([("tool_choice", forced)] if forced else []) + ([("response_format", spec)] if spec else []) \
            + guided_specs(self)

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets besides the messages and tools: `chat_template_kwargs`, and
        `reasoning_effort` unless those set it."""
        effort = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {}
        return {**effort, **(self.chat_template_kwargs or {})}

    def tool_plan(self, syntax: CallSyntax | None = None) -> ToolPlan:
        return plan(self.tools, self.tool_choice, self.parallel_tool_calls, syntax or self._call_syntax)

    def _top_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs \"logprobs\": true", param="top_logprobs")
        if not self.logprobs:
            return None
        return check_logprobs(0 if self.top_logprobs is None else self.top_logprobs, "top_logprobs")

    def chat_messages(self) -> list[dict[str, str]]:
        return chat_messages(self.messages)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as [{"role", "content"}] with text content only, plus an assistant's
    `tool_calls` and a tool result's `tool_call_id`."""
    if not messages:
        raise InvalidRequest("messages is empty: send at least one message", param="messages")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: ChatMessage) -> dict[str, Any]:
    role = _ROLE_ALIASES.get(m.role, m.role)
    if role not in CHAT_ROLES:
        raise InvalidRequest(
            f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m.role[:32]!r}",
            param=f"messages[{i}].role",
        )
    for name in _MESSAGE_NOOPS:
        value = getattr(m, name)
        if value not in (None, "", []):
            raise InvalidRequest(f"messages[{i}].{name} is not supported yet (no legacy function calls, "
                                 f"audio or refusals); send null or omit it", param=f"messages[{i}].{name}")
    content = m.content
    if isinstance(content, list):
        content = "".join(_text_part(i, j, part) for j, part in enumerate(content))
    if content is None:
        if role != "assistant":
            raise InvalidRequest(f"messages[{i}].content is required for role {role!r}",
                                 param=f"messages[{i}].content")
        content = ""
    out: dict[str, Any] = {"role": role, "content": content}
    if m.name:
        out["name"] = m.name
    _tool_fields(i, m, role, out)
    thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if thinking is not None:
        if role != "assistant":
            raise InvalidRequest(f"messages[{i}].reasoning_content belongs on an assistant message only",
                                 param=f"messages[{i}].reasoning_content")
        out["reasoning_content"] = thinking  # chat.py also hands it to templates as `thinking`
    return out


def _tool_fields(i: int, m: ChatMessage, role: str, out: dict[str, Any]) -> None:
    if m.tool_calls:
        if role != "assistant":
            raise InvalidRequest(f"messages[{i}].tool_calls: only an assistant message has tool calls",
                                 param=f"messages[{i}].tool_calls")
        out["tool_calls"] = history_calls(m.tool_calls)
    if role == "tool":
        if not m.tool_call_id:
            raise InvalidRequest(f"messages[{i}].tool_call_id is required for role 'tool' (the id of the call "
                                 f"it answers)", param=f"messages[{i}].tool_call_id")
        out["tool_call_id"] = m.tool_call_id
    elif m.tool_call_id is not None:
        raise InvalidRequest(f"messages[{i}].tool_call_id belongs on a 'tool' message only",
                             param=f"messages[{i}].tool_call_id")


_MESSAGE_NOOPS = ("refusal", "function_call", "audio", "annotations")


def _text_part(i: int, j: int, part: dict[str, Any]) -> str:
    where = f"messages[{i}].content[{j}]"
    kind = part.get("type")
    if kind != "text":
        shown = kind[:32] if isinstance(kind, str) else type(kind).__name__
        raise InvalidRequest(f"{where}: only text content parts are supported, got type {shown!r}", param=where)
    unknown = sorted(set(part) - {"type", "text"})
    if unknown:
        raise InvalidRequest(f"{where}: unknown field {unknown[0][:32]!r}", param=where)
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
    return text


def _check_unsupported(body: BaseModel) -> None:
    for name, noops in NOOPS.items():
        value = getattr(body, name, None)
        if value is None:
            continue
        if not any(_same(value, x) for x in noops if x is not None):
            raise InvalidRequest(
                f"{name} is not supported yet; omit it or send "
                f"{' or '.join(json.dumps(x) for x in noops)}", param=name,
            )


def _same(value: Any, noop: Any) -> bool:
    """JSON equality: 0 == 0.0, but False != 0 and [] != {}."""
    if isinstance(noop, bool) or isinstance(value, bool):
        return value is noop
    if isinstance(noop, (int, float)):
        return isinstance(value, (int, float)) and value == noop
    return type(value) is type(noop) and value == noop


# ---------------------------------------------------------------- vLLM's /tokenize and /detokenize


class TokenizeBody(BaseModel):
    """POST /tokenize: a completion `prompt` or chat `messages` (as the chat endpoint renders
    them), with the prompt's ids, their count and the context length."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = Field(default=None, max_length=256)
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None  # with messages: rendered as chat does
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as on the chat endpoint
    add_special_tokens: StrictBool | None = None  # default: as the completion or chat endpoint encodes


class DetokenizeBody(BaseModel):
    """POST /detokenize: token ids -> text."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = Field(default=None, max_length=256)
    tokens: list[TokenId]
