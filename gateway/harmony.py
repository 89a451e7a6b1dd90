"""Model output in OpenAI's harmony format (gpt-oss) -> (reasoning, content, tool calls), whole
and streamed.

gpt-oss writes messages on channels. Its chat template ends the prompt with `<|start|>assistant`,
so the output opens with a message header, and each message is
`<header><|message|><body>` ended by `<|end|>` (another message follows, `<|start|>assistant...`),
`<|call|>` (a tool call) or `<|return|>` (the answer is done). The last two are EOS ids, so they
do not reach the text; the end of the output ends the message. A header names the channel
(`<|channel|>analysis`) and may name a recipient (`to=functions.get_weather`, before or after the
channel) and a content type (`<|constrain|>json`, or ` json`). Routing, as vLLM's harmony parsing
reports it:
- `analysis`: the model's thinking -> `reasoning_content`;
- a message to `functions.NAME`: a tool call, its body the JSON arguments -> `tool_calls` (when
  the request has tools; otherwise its body is content);
- `final`, a `commentary` message to nobody (a preamble), or no channel: `content`.
The markers are special tokens: the relay decodes this model's output with special tokens kept
(`chatformat.py`). Streamed, a body's text is emitted as it comes, holding back what may be the
start of a marker; a call is emitted whole when its message ends. Pure; it must not know HTTP.
"""
from __future__ import annotations

import re

from gateway.toolparse import call_id, compact_args, holdback, new_call

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
_ENDS = (END, CALL, RETURN, START)  # what ends a message's body (START: a model that skipped <|end|>)
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


def route(header: str) -> tuple[str, str]:
    """("reasoning" | "content" | "call", the function's name for a call) of a message header."""
    to = _RECIPIENT.search(header)
    if to and to.group(1).startswith(FUNCTIONS) and len(to.group(1)) > len(FUNCTIONS):
        return "call", to.group(1)[len(FUNCTIONS):]
    channel = _CHANNEL.search(header)
    if channel and channel.group(1) == "analysis":
        return "reasoning", ""
    return "content", ""


class HarmonyParser:
    """One choice's output, fed in pieces: `feed(text) -> (reasoning, content, calls completed)`."""

    name = "openai_gptoss"

    def __init__(self, request_id: str, choice: int = 0, tools: bool = True) -> None:
        self.request_id, self.choice, self.tools = request_id, choice, tools
        self.calls: list[dict] = []
        self._header: str | None = ""  # in a header: its text so far; None in a body
        self._kind, self._name = "content", ""  # the current body's route
        self._body = ""  # a call's body so far, or a text body's held-back tail

    def feed(self, new: str) -> tuple[str, str, list[dict]]:
        out = {"reasoning": [], "content": []}
        done: list[dict] = []
        pending = new
        while pending:
            if self._header is not None:
                seen = self._header + pending
                at = seen.find(MESSAGE)
                if at < 0:
                    self._header = seen
                    break
                self._kind, self._name = route(seen[:at])
                self._header, self._body, pending = None, "", seen[at + len(MESSAGE):]
                continue
            seen = self._body + pending
            ends = [(i, m) for m in _ENDS if (i := seen.find(m)) >= 0]
            if not ends:
                if self._kind == "call":
                    self._body = seen
                else:
                    keep = holdback(seen, _ENDS)
                    out[self._kind].append(seen[: len(seen) - keep])
                    self._body = seen[len(seen) - keep:]
                break
            at, marker = min(ends)
            self._close(seen[:at], out, done)
            # after <|end|> comes <|start|>assistant...: the next header; START itself opens one
            pending = seen[at + len(marker):] if marker != START else seen[at:]
            self._header = ""
        return "".join(out["reasoning"]), "".join(out["content"]), done

    def _close(self, body: str, out: dict, done: list[dict]) -> None:
        self._body = ""
        if self._kind != "call":
            out[self._kind].append(body)
            return
        args = compact_args(body.strip()) if self.tools else None
        if args is None:  # not JSON, or the request has no tools: the body stays text
            out["content"].append(body)
            return
        done.append(new_call(self.calls, call_id(self.request_id, self.choice, len(self.calls)), self._name, args))

    def finish(self) -> tuple[str, str, list[dict]]:
        """The output has ended (a `<|call|>` or `<|return|>` EOS, or max_tokens): close the open
        message. A header cut short is dropped, unless it is plain text (a model not writing
        harmony at all), which is content."""
        out = {"reasoning": [], "content": []}
        done: list[dict] = []
        if self._header is None:
            self._close(self._body, out, done)
        elif "<|" not in self._header:
            out["content"].append(self._header)
        self._header, self._body = "", ""
        return "".join(out["reasoning"]), "".join(out["content"]), done


def parse_harmony(text: str, request_id: str, choice: int = 0,
                  tools: bool = True) -> tuple[str | None, str | None, list[dict]]:
    """A whole output -> (reasoning or None, content or None, calls without `index`)."""
    p = HarmonyParser(request_id, choice, tools)
    r1, c1, _ = p.feed(text)
    r2, c2, _ = p.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in p.calls]
    return (r1 + r2) or None, (c1 + c2) or None, calls
