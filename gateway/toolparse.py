"""Model output -> OpenAI tool calls: the parser for Hermes-style `<tool_call>{...}</tool_call>`
blocks (the format the default chat template teaches, see `tools.py`), whole and streamed.

A block becomes a call when its body is a JSON object with a string `name` and an object
`arguments` (`parameters` is read as its alias); anything else, a block that does not parse
or one that never closes, stays text. Streamed, `ToolCallStream` holds back text that may be the
start of `<tool_call>` (as the relay holds back a possible stop string) and emits a call whole,
name and arguments in one delta, once its closing tag arrives. Call ids are derived from the
request id, the choice and the call's position, so a resumed stream repeats them exactly.

Pure: text in, text and calls out. It must not know about HTTP or the token stream.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id(request_id: str, choice: int, k: int) -> str:
    return "call_" + hashlib.sha256(f"{request_id}/{choice}/{k}".encode()).hexdigest()[:24]


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as compact JSON text), or None when the body is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def _holdback(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPEN."""
    for k in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


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
        k = len(self.calls)
        call = {"index": k, "id": call_id(self.request_id, self.choice, k), "type": "function",
                "function": {"name": parsed[0], "arguments": parsed[1]}}
        self.calls.append(call)
        return call


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
