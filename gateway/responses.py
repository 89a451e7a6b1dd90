"""OpenAI's Responses API (`POST /v1/responses`), stateless as vLLM serves it, on the chat path.

A Responses body is translated into a chat body (`to_chat`): `instructions` become the first
system message; `input` (a string, or items) becomes the messages: a message item (role user,
system, developer or assistant; content a string or `input_text`/`output_text` parts), a
`function_call` item (an assistant's tool call), a `function_call_output` item (a tool message);
`reasoning` items from an earlier turn are dropped (a chat template does not show past reasoning).
`tools` (function tools, flat: `{"type": "function", "name", "parameters"}`), `tool_choice`,
`parallel_tool_calls`, `text.format` (`json_object`, `json_schema`), `max_output_tokens`,
`temperature`, `top_p` map one to one; vLLM's extras `seed`, `top_k`, `priority` too. From there
the request is a chat request: rendered with the chat template, constrained by the same grammar,
its output parsed for tool calls by the same parser (`sse.Formatter`). The answer is shaped back
(`Shaper`): a `reasoning` item when the model wrote `<think>...</think>` first (or the prompt
ended in `<think>`: the model starts inside it), a `message` item with one `output_text` part,
one `function_call` item per call. `status` is "completed", or "incomplete" with reason
`max_output_tokens` when the output ended at the budget (finish "length", including structured
output the budget closed early: it parses, see tandem_core/grammar.py).

Streamed, the events are OpenAI's: response.created, response.in_progress, then per item
response.output_item.added, (response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done | response.reasoning_text.delta...,
response.reasoning_text.done | response.function_call_arguments.delta,
response.function_call_arguments.done), response.output_item.done, and last response.completed
(or response.incomplete); each with its `sequence_number`. An error after the headers is an
`error` event.

Stateless: nothing is stored, so `previous_response_id`, `conversation`, `background` and
item references are refused with a 400 that says to send the whole conversation in `input`;
`store` is accepted and nothing is kept. It must not know about Redis or the workers.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from gateway.jsonbody import validation_error
from gateway.relay import Delta
from gateway.schemas import ChatBody, JsonInt, Number, _doc
from gateway.sse import Formatter, error_body
from tandem_core.errors import InvalidRequest, TandemError

log = logging.getLogger(__name__)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesBody(BaseModel):
    """POST /v1/responses. Fields the Agents SDK and the openai SDK send are named here; those a
    stateless server cannot honour take only their empty value."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = Field(default=None, max_length=256)
    input: StrictStr | list[dict[str, Any]] = _doc(..., minLength=1, minItems=1)
    instructions: StrictStr | None = None
    max_output_tokens: JsonInt | None = _doc(minimum=1)
    temperature: Number | None = _doc(minimum=0, maximum=2)
    top_p: Number | None = _doc(exclusiveMinimum=0, maximum=1)
    top_k: JsonInt | None = _doc(minimum=0)  # vLLM's extra
    seed: JsonInt | None = None  # vLLM's extra
    priority: Literal["normal", "high"] | None = None  # Tandem's own
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None  # {"format": {...}, "verbosity": ...}
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: accepted, ignored
    store: StrictBool | None = None  # accepted: nothing is stored
    include: list[StrictStr] | None = None  # accepted, ignored
    reasoning: dict[str, Any] | None = None  # effort / summary: accepted, ignored
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = Field(default=None, max_length=256)
    truncation: Literal["disabled", "auto"] | None = None  # nothing is truncated: a long input is a 400
    top_logprobs: JsonInt | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    service_tier: Literal["auto", "default"] | None = None
    previous_response_id: None = None
    conversation: None = None
    background: Literal[False] | None = None
    prompt: None = None
    max_tool_calls: None = None
    context_management: None = None
    prompt_cache_options: None = None


_STATELESS = {"previous_response_id", "conversation", "background", "prompt", "max_tool_calls",
              "context_management", "prompt_cache_options"}


def parse(data: dict) -> ResponsesBody:
    """The body, with a 400 that explains what a stateless server cannot do."""
    for name in _STATELESS:
        if data.get(name) not in (None, False):
            raise InvalidRequest(f"{name} is not supported: this server keeps no responses or conversations "
                                 f"(stateless, as vLLM); send the whole conversation in input", param=name)
    if data.get("top_logprobs") not in (None, 0):
        raise InvalidRequest("top_logprobs is not supported on /v1/responses yet; use /v1/chat/completions",
                             param="top_logprobs")
    try:
        return ResponsesBody.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


# ---------------------------------------------------------------- request: Responses -> chat


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            shown = kind[:32] if isinstance(kind, str) else type(part).__name__
            raise InvalidRequest(f"{where}[{j}]: only text parts (input_text, output_text) are supported, got "
                                 f"{shown!r}", param=f"{where}[{j}]")
        out.append(part["text"])
    return "".join(out)


def _messages(body: ResponsesBody) -> list[dict]:
    msgs: list[dict] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        if not body.input:
            raise InvalidRequest("input is empty: send the text to answer, or a list of items", param="input")
        msgs.append({"role": "user", "content": body.input})
        return msgs
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise InvalidRequest(f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}",
                                     param=f"{where}.role")
            msgs.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not all(isinstance(x, str) for x in (call_id, name, args)) or not call_id or not name:
                raise InvalidRequest(f"{where}: a function_call item needs call_id, name and arguments as strings",
                                     param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # text then calls: one assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(f"{where}.call_id is required (the call this output answers)",
                                     param=f"{where}.call_id")
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: chat templates do not show it again
        elif kind == "item_reference":
            raise InvalidRequest(f"{where}: item_reference is not supported (nothing is stored); send the item "
                                 f"itself", param=where)
        else:
            shown = kind[:32] if isinstance(kind, str) else type(kind).__name__
            raise InvalidRequest(f"{where}: item type {shown!r} is not supported; send message, function_call "
                                 f"or function_call_output items", param=f"{where}.type")
    if not any(m["role"] != "system" for m in msgs):
        raise InvalidRequest("input has no message to answer", param="input")
    return msgs


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            kind = t.get("type")
            shown = kind[:32] if isinstance(kind, str) else type(kind).__name__
            raise InvalidRequest(f"tools[{i}]: only function tools are supported, got type {shown!r}",
                                 param=f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise InvalidRequest(f"tools[{i}]: unknown field {unknown[0][:32]!r}", param=f"tools[{i}]")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                         param="tool_choice")


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format.schema must be a JSON schema object", param="text.format.schema")
        inner = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": inner}
    raise InvalidRequest("text.format.type must be one of 'text', 'json_object', 'json_schema'",
                         param="text.format.type")


def to_chat(body: ResponsesBody) -> ChatBody:
    """The chat body that serves this Responses body. A tool_choice that forces a call wins over
    `text.format` (that turn's output is the call; the format is for a text answer), where chat
    refuses the two together."""
    forced = body.tool_choice == "required" or isinstance(body.tool_choice, dict)
    data = {"model": body.model, "messages": _messages(body), "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
            "priority": body.priority, "tools": _tools(body.tools), "tool_choice": _tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls, "response_format": None if forced else _response_format(body.text),
            "user": body.user, "stream": body.stream}
    try:
        return ChatBody.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from e


# ---------------------------------------------------------------- answer: chat output -> Responses


class ThinkSplit:
    """Splits a streamed output into reasoning and answer text at `<think>...</think>`: text that
    may still be the start of a tag is held back, as the tool-call parser does."""

    def __init__(self, inside: bool = False) -> None:
        self.mode = "think" if inside else "start"  # start: not yet known whether <think> opens it
        self._held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """[(kind, text)] with kind "reasoning" or "text", in order."""
        buf, out = self._held + text, []
        self._held = ""
        while buf:
            if self.mode == "start":
                lead = buf.lstrip()
                if lead.startswith(THINK_OPEN):
                    buf, self.mode = lead[len(THINK_OPEN):], "think"
                elif THINK_OPEN.startswith(lead):
                    self._held = buf
                    return out
                else:
                    self.mode = "text"
            elif self.mode == "think":
                at = buf.find(THINK_CLOSE)
                if at >= 0:
                    out.append(("reasoning", buf[:at]))
                    buf, self.mode = buf[at + len(THINK_CLOSE):].lstrip("\n"), "text"
                    continue
                keep = next((k for k in range(min(len(buf), len(THINK_CLOSE) - 1), 0, -1)
                             if THINK_CLOSE.startswith(buf[-k:])), 0)
                out.append(("reasoning", buf[:len(buf) - keep]))
                self._held = buf[len(buf) - keep:]
                return [x for x in out if x[1]]
            else:
                out.append(("text", buf))
                buf = ""
        return [x for x in out if x[1]]

    def finish(self) -> list[tuple[str, str]]:
        held, self._held = self._held, ""
        if not held:
            return []
        return [("reasoning" if self.mode == "think" else "text", held)]


def _uid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Shaper:
    """One Responses answer, whole (`whole`) or as events (`events`), from the chat Formatter's
    chunks: the chat path's text, tool calls and finish reason."""

    def __init__(self, body: ResponsesBody, response_id: str, model: str, prompt_tokens: int,
                 starts_thinking: bool = False) -> None:
        self.body = body
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.output_tokens = 0
        self.finish: str | None = None
        self.output: list[dict] = []  # items, in order
        self._split = ThinkSplit(starts_thinking)
        self._open: dict | None = None  # the reasoning or message item being written
        self._seq = 0

    # -- the response object
    def response(self, status: str) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        b = self.body
        fmt = (b.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None, "incomplete_details": incomplete,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "max_tool_calls": None,
            "model": self.model, "output": self.output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": b.reasoning or {"effort": None, "summary": None},
            "service_tier": "default", "store": False, "temperature": b.temperature, "text": {"format": fmt},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "top_p": b.top_p,
            "truncation": b.truncation or "disabled", "user": b.user, "metadata": b.metadata or {},
            "usage": None if status == "in_progress" else self.usage(),
        }

    def usage(self) -> dict:
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.output_tokens}

    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    # -- events
    def _ev(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def start(self) -> list[dict]:
        return [self._ev("response.created", response=self.response("in_progress")),
                self._ev("response.in_progress", response=self.response("in_progress"))]

    def _index(self, item: dict) -> int:
        return self.output.index(item)

    def _write(self, kind: str, text: str) -> list[dict]:
        evs: list[dict] = []
        want = "reasoning" if kind == "reasoning" else "message"
        if self._open is not None and self._open["type"] != want:
            evs += self._close()
        if self._open is None:
            evs += self._begin(want)
        item = self._open
        part = item["content"][0]
        part["text"] += text
        delta = "response.reasoning_text.delta" if want == "reasoning" else "response.output_text.delta"
        extra = {} if want == "reasoning" else {"logprobs": []}
        evs.append(self._ev(delta, item_id=item["id"], output_index=self._index(item), content_index=0,
                            delta=text, **extra))
        return evs

    def _begin(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _uid("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
            self.output.append(item)
            self._open = item
            return [self._ev("response.output_item.added", output_index=self._index(item),
                             item={**item, "content": []})]
        item = {"type": "message", "id": _uid("msg"), "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.output.append(item)
        self._open = item
        i = self._index(item)
        return [self._ev("response.output_item.added", output_index=i, item={**item, "content": []}),
                self._ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        i, part = self._index(item), item["content"][0]
        if item["type"] == "reasoning":
            return [self._ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=part["text"]),
                    self._ev("response.output_item.done", output_index=i, item=item)]
        return [self._ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                         text=part["text"], logprobs=[]),
                self._ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                         part=part),
                self._ev("response.output_item.done", output_index=i, item=item)]

    def _call(self, call: dict) -> list[dict]:
        evs = self._close()
        fn = call["function"]
        item = {"type": "function_call", "id": _uid("fc"), "call_id": call["id"], "name": fn["name"],
                "arguments": fn["arguments"], "status": "completed"}
        self.output.append(item)
        i = self._index(item)
        return evs + [
            self._ev("response.output_item.added", output_index=i,
                     item={**item, "arguments": "", "status": "in_progress"}),
            self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                     delta=fn["arguments"]),
            self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                     name=fn["name"], arguments=fn["arguments"]),
            self._ev("response.output_item.done", output_index=i, item=item)]

    def feed(self, chunk: dict, completion_tokens: int) -> list[dict]:
        """The events of one chat chunk (`Formatter.chunk`): its text, its calls, its finish."""
        self.output_tokens = completion_tokens
        evs: list[dict] = []
        for ch in chunk["choices"]:
            delta = ch["delta"]
            if delta.get("reasoning_content"):  # split out by the model family's reasoning parser
                evs += self._write("reasoning", delta["reasoning_content"])
            for kind, text in self._split.feed(delta.get("content") or ""):
                evs += self._write(kind, text)
            for call in delta.get("tool_calls") or ():
                evs += self._call(call)
            if ch["finish_reason"] is not None:
                self.finish = ch["finish_reason"]
                for kind, text in self._split.finish():
                    evs += self._write(kind, text)
        return evs

    def end(self) -> list[dict]:
        evs = self._close()
        if not any(it["type"] in ("message", "function_call") for it in self.output):
            evs += self._begin("message") + self._close()  # always one answer item, even empty
        status = self.status()
        return evs + [self._ev(f"response.{status}", response=self.response(status))]


async def events(deltas: AsyncIterator[Delta], fmt: Formatter, shaper: Shaper) -> AsyncIterator[bytes]:
    """The SSE stream of a Responses request (`event:` lines name each type)."""
    for ev in shaper.start():
        yield _sse(ev)
    try:
        async for d in deltas:
            for ev in shaper.feed(fmt.chunk(d), d.completion_tokens):
                yield _sse(ev)
        for ev in shaper.end():
            yield _sse(ev)
    except TandemError as e:
        err = error_body(e)
        yield _sse(shaper._ev("error", code=err["code"], message=err["message"], param=err["param"]))
    except Exception as e:
        log.exception("relay failed response_id=%s", shaper.id)
        yield _sse(shaper._ev("error", code="internal_error", message=f"internal error: {type(e).__name__}",
                              param=None))


async def whole(deltas: AsyncIterator[Delta], fmt: Formatter, shaper: Shaper) -> dict:
    """The non-streamed response object."""
    async for d in deltas:
        shaper.feed(fmt.chunk(d), d.completion_tokens)
    shaper.end()
    return shaper.response(shaper.status())


def _sse(ev: dict) -> bytes:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()
