"""Request bodies of the OpenAI-compatible endpoints, and the strict parse that turns raw bytes
into one of them.

Strict means: the body must be UTF-8 JSON (no NaN/Infinity, no unpaired surrogates, bounded
nesting), unknown fields are rejected by name, and the OpenAI parameters Tandem cannot serve
honestly are rejected with "not supported yet" unless they carry their no-op value (clients such
as LangChain send `presence_penalty: 0` or `logprobs: null` by default). Every failure is an
`InvalidRequest` naming the field. Transport-neutral output: `CompletionParams` and chat messages.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from gateway.validation import CompletionParams
from tandem_core.errors import InvalidRequest

MAX_JSON_DEPTH = 32
CHAT_ROLES = ("system", "user", "assistant")
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields both endpoints share, plus Tandem's extensions (`top_k`, `ignore_eos`, `priority`,
    `resumable`). Unsupported OpenAI fields are declared `Any` so they get a clear message."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: StrictBool = False
    priority: Literal["normal", "high"] | None = None
    resumable: StrictBool = False
    # Accepted only with their no-op value (see NOOPS):
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: int | None) -> CompletionParams:
        _check_unsupported(self)
        if self.n not in (None, 1):
            raise InvalidRequest(f"n must be 1 (one choice per request), got {self.n}", param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return CompletionParams(
            model=self.model, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos, priority=self.priority,
        )


class CompletionBody(_Common):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int]
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    def to_params(self) -> CompletionParams:
        p = self._params(self.max_tokens)
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
    model_config = ConfigDict(extra="forbid")
    role: str = Field(max_length=32)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, max_length=256)


class ChatBody(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: StrictBool | None = None  # meaningless without tools; accepted
    store: Any = None
    metadata: dict[str, str] | None = None  # accepted and ignored
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None

    def to_params(self) -> CompletionParams:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequest(
                "send max_completion_tokens or max_tokens, not both with different values",
                param="max_completion_tokens",
            )
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(mt)

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation as [{"role", "content"}] with text content only."""
        if not self.messages:
            raise InvalidRequest("messages is empty: send at least one message", param="messages")
        return [_message(i, m) for i, m in enumerate(self.messages)]


def _message(i: int, m: ChatMessage) -> dict[str, str]:
    role = _ROLE_ALIASES.get(m.role, m.role)
    if role not in CHAT_ROLES:
        raise InvalidRequest(
            f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m.role[:32]!r}",
            param=f"messages[{i}].role",
        )
    content = m.content
    if isinstance(content, list):
        content = "".join(_text_part(i, j, part) for j, part in enumerate(content))
    if content is None:
        if role != "assistant":
            raise InvalidRequest(f"messages[{i}].content is required for role {role!r}",
                                 param=f"messages[{i}].content")
        content = ""
    out = {"role": role, "content": content}
    if m.name:
        out["name"] = m.name
    return out


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


# Unsupported parameters and the values that mean "off" (accepted and ignored).
NOOPS: dict[str, tuple] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
}


def _check_unsupported(body: BaseModel) -> None:
    for name, noops in NOOPS.items():
        value = getattr(body, name, None)
        if value is None:
            continue
        if not any(_same(value, x) for x in noops if x is not None):
            raise InvalidRequest(
                f"{name} is not supported yet (Tandem's workers do not report it); omit it or send "
                f"{' or '.join(json.dumps(x) for x in noops)}", param=name,
            )


def _same(value: Any, noop: Any) -> bool:
    """JSON equality: 0 == 0.0, but False != 0 and [] != {}."""
    if isinstance(noop, bool) or isinstance(value, bool):
        return value is noop
    if isinstance(noop, (int, float)):
        return isinstance(value, (int, float)) and value == noop
    return type(value) is type(noop) and value == noop


# ---------------------------------------------------------------- strict parse


def _reject_constant(name: str) -> float:
    raise InvalidRequest(f"request body is not valid JSON: {name} is not a JSON number")


def load_json(raw: bytes) -> dict:
    """UTF-8 JSON object, bounded nesting, no surrogates; else InvalidRequest."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8: byte {e.start} ({e.reason})") from e
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise InvalidRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep") from e
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    _check_tree(data)
    return data


def _check_tree(data: dict) -> None:
    """Depth bound and well-formed Unicode everywhere (an escaped lone surrogate such as "\\ud800"
    is valid JSON but not text), without recursion."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep",
                                 param=path or None)
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, dict):
            for k, v in node.items():
                _check_text(k, path or "body")
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))


def _check_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{path[:200] or 'body'} contains an unpaired surrogate at character {e.start} (invalid Unicode)",
            param=path[:200] or None,
        ) from e


def parse_body(raw: bytes, model: type[BaseModel]):
    data = load_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _loc(loc: tuple) -> str:
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif x not in _UNION_TAGS and "[" not in x and x != "body":
            out += f".{x}" if out else x
    return out or "body"


def validation_error(e: ValidationError) -> InvalidRequest:
    err = e.errors(include_url=False)[0]
    field = _loc(err.get("loc", ()))[:200]
    if err.get("type") == "extra_forbidden":
        return InvalidRequest(f"unknown field {field!r}", param=field)
    if err.get("type") == "missing":
        return InvalidRequest(f"field {field!r} is required", param=field)
    return InvalidRequest(f"invalid value for {field!r}: {err.get('msg')}", param=field)
