"""Model output -> OpenAI tool calls, one parser class per tool-call format, whole and streamed.

- `ToolCallStream` (`hermes`): Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, the format of Qwen2.5/Qwen3 templates and of the default chat template (`tools.py`).
- `MistralCalls` (`mistral`): everything after Mistral's `[TOOL_CALLS]` marker, either the JSON
  list of v3 templates, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` (with an optional `[CALL_ID]id` before `[ARGS]`), repeated.
  The marker is a special token: the relay decodes such a model's output with special tokens
  kept (`chatformat.py` says so per format). Its call ids are 9 alphanumeric characters, what
  Mistral templates require of the ids in the history.
(gpt-oss's commentary-channel calls are parsed with its channels, in `harmony.py`.)

A call is a JSON object with a string `name` and an object `arguments` (`parameters` is read as
its alias; arguments written as a JSON string are parsed); anything else, a block that does not
parse or one that never closes, stays text. Streamed, a parser holds back text that may be the
start of its marker (as the relay holds back a possible stop string) and emits a call whole, name
and arguments in one delta, once it is complete. Call ids are derived from the request id, the
choice and the call's position, so a resumed stream repeats them exactly.

Every parser has the same shape: `feed(text) -> (text to emit, calls completed)`, `finish() ->
text still held`, `calls` (all so far). Pure: text in, text and calls out. It must not know about
HTTP or the token stream.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id(request_id: str, choice: int, k: int) -> str:
    return "call_" + hashlib.sha256(f"{request_id}/{choice}/{k}".encode()).hexdigest()[:24]


def short_call_id(request_id: str, choice: int, k: int) -> str:
    """9 alphanumeric characters (lowercase hex), the id Mistral's templates accept."""
    return hashlib.sha256(f"{request_id}/{choice}/{k}".encode()).hexdigest()[:9]


def compact_args(args: object) -> str | None:
    """Arguments as compact JSON object text, or None when they are not an object (a JSON string
    holding an object, as some models write them, is read)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def call_of(obj: object) -> tuple[str, str] | None:
    """(name, arguments as compact JSON text) of a decoded call object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = compact_args(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else (obj["name"], args)


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as compact JSON text), or None when the body is not a call."""
    try:
        return call_of(json.loads(body))
    except ValueError:
        return None


def holdback(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`: text
    that must wait for the next piece before it is known not to start a marker."""
    longest = max(len(m) for m in markers) - 1
    for k in range(min(len(text), longest), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def _holdback(text: str) -> int:
    return holdback(text, (OPEN,))


def new_call(calls: list[dict], ident: str, name: str, args: str) -> dict:
    """Append one call, in the streamed shape (with its index), to `calls` and return it."""
    call = {"index": len(calls), "id": ident, "type": "function", "function": {"name": name, "arguments": args}}
    calls.append(call)
    return call


@dataclass
class ToolCallStream:
    """One choice's output, fed in pieces: `feed(text) -> (text to emit, calls completed)`."""

    request_id: str
    choice: int = 0
    calls: list[dict] = field(default_factory=list)  # every call so far, OpenAI's shape
    _held: str = ""  # text that may be the start of OPEN
    _body: str | None = None  # inside a block: its text so far

    def feed(self, new: str) -> tuple[str, list[dict]]:
        out, done = [], []
        pending = self._held + new
        self._held = ""
        while pending:
            if self._body is not None:
                seen = self._body + pending  # the closing tag may straddle two pieces
                end = seen.find(CLOSE, max(0, len(self._body) - len(CLOSE) + 1))
                if end < 0:
                    self._body = seen
                    break
                body, pending = seen[:end], seen[end + len(CLOSE):]
                self._body = None
                call = self._call(body)
                if call is None:
                    out.append(OPEN + body + CLOSE)
                else:
                    done.append(call)
                continue
            start = pending.find(OPEN)
            if start >= 0:
                out.append(pending[:start])
                self._body, pending = "", pending[start + len(OPEN):]
                continue
            keep = _holdback(pending)
            out.append(pending[: len(pending) - keep])
            self._held = pending[len(pending) - keep:]
            break
        return "".join(out), done

    def finish(self) -> str:
        """What is still held once the output has ended: an unclosed block stays text."""
        text = self._held if self._body is None else OPEN + self._body
        self._held, self._body = "", None
        return text

    def _call(self, body: str) -> dict | None:
        parsed = parse_call(body.strip())
        if parsed is None:
            return None
        return new_call(self.calls, call_id(self.request_id, self.choice, len(self.calls)), *parsed)


HermesCalls = ToolCallStream


TC, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


@dataclass
class MistralCalls:
    """Mistral's calls: text before `[TOOL_CALLS]` is content, what follows it is calls, in the
    v3 list form or the `name[ARGS]{...}` form (see the module docstring). A call is emitted once
    its JSON is complete (a JSON object or list decodes only when it is closed); what never
    completes is given back as text by `finish`."""

    request_id: str
    choice: int = 0
    calls: list[dict] = field(default_factory=list)
    _held: str = ""  # text mode: a possible start of the marker
    _body: str | None = None  # after a marker: its text so far

    def feed(self, new: str) -> tuple[str, list[dict]]:
        out, done = [], []
        if self._body is None:
            pending, self._held = self._held + new, ""
        else:
            self._body, pending = self._body + new, ""
        while True:
            if self._body is None:
                start = pending.find(TC)
                if start < 0:
                    keep = holdback(pending, (TC,))
                    out.append(pending[: len(pending) - keep])
                    self._held = pending[len(pending) - keep:]
                    break
                out.append(pending[:start])
                self._body, pending = pending[start + len(TC):], ""
            parsed = self._take(self._body)
            if parsed is None:
                break
            calls, rest = parsed
            done += calls
            self._body, pending = None, rest
        return "".join(out), done

    def _take(self, body: str) -> tuple[list[dict], str] | None:
        """The calls at the start of `body` and the text after them, once they are complete."""
        head = body.lstrip()
        if head[:1] in ("[", "{"):  # v3: a JSON list of calls (or one call object)
            if not head.rstrip().endswith(("]", "}")):
                return None
            try:
                obj, end = _DECODER.raw_decode(head)
            except ValueError:
                return None
            items = obj if isinstance(obj, list) else [obj]
            parsed = [call_of(o) for o in items]
            if not items or any(p is None for p in parsed):
                return None
            return [self._call(*p) for p in parsed if p is not None], head[end:]
        at = body.find(ARGS)  # newer: name[ARGS]{...}, maybe name[CALL_ID]id[ARGS]{...}
        if at < 0:
            return None
        name = body[:at].split(CALL_ID, 1)[0].strip()
        args_text = body[at + len(ARGS):].lstrip()
        if not name or not args_text.rstrip().endswith("}"):
            return None
        try:
            args, end = _DECODER.raw_decode(args_text)
        except ValueError:
            return None
        text = compact_args(args)
        if text is None:
            return None
        return [self._call(name, text)], args_text[end:]

    def _call(self, name: str, args: str) -> dict:
        return new_call(self.calls, short_call_id(self.request_id, self.choice, len(self.calls)), name, args)

    def finish(self) -> str:
        """What is still held: a marker whose calls never completed stays text."""
        text = self._held if self._body is None else TC + self._body
        self._held, self._body = "", None
        return text


_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str, request_id: str, choice: int = 0) -> tuple[str | None, list[dict]]:
    """A whole output -> (content, calls): content is the text outside the calls (None when only
    whitespace is left and there are calls), calls in OpenAI's message shape (no `index`)."""
    s = ToolCallStream(request_id, choice)
    head, _ = s.feed(text)
    content = head + s.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in s.calls]
    if calls and not content.strip():
        return None, calls
    return (content.strip() if calls else content), calls
