"""OpenAI response shapes for both endpoints, streamed (SSE) and whole.

One SSE event per relayed token, `id: <token index>`, so a client that lost its connection can
resume with `Last-Event-ID` (see `resume.py`): the event for index i is the same on every
connection. After the last token: a usage chunk (if `stream_options.include_usage`) and
`data: [DONE]`, neither with an id. Errors after the headers are sent go in-band as
`data: {"error": {...}}` the way OpenAI does.

Chat chunks carry `delta.role` on the event of index 0 and `delta.content` on every event; a
reasoning model's thinking goes in `delta.reasoning_content` (the whole body's
`message.reasoning_content`), split off by the family's parser (gateway/chatformat.py).
With n > 1 each event is one choice's token (`index` is the choice); with logprobs each carries
that token's logprobs (gateway/logprobs.py); with echo, a completion's first event starts with
the prompt's text (and, with logprobs, the prompt's logprobs). A chat with tools parses each
choice's text for tool calls in the family's format (`chatformat.ChoiceParser`, after the
reasoning parser took the thinking out): text that may open a call is held
back, a completed call goes out as `delta.tool_calls` (name and arguments whole) and the choice
finishes with "tool_calls"; the whole body gets `message.tool_calls` the same way.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request

from gateway.chatformat import ChoiceParser, OutputSpec
from gateway.logprobs import CompletionLogprobs, TokenText, chat_logprobs, empty_completion, merge_completion
from gateway.relay import Delta
from gateway.resume import StreamMeta
from gateway.validation import Prepared
from tandem_core.errors import TandemError, WorkerFailed

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


def error_body(e: TandemError) -> dict:
    code = e.error_type if not isinstance(e, WorkerFailed) else "worker_error"
    return {"message": e.message, "type": e.error_type, "param": e.param, "code": code}


def usage(meta: StreamMeta, completion_tokens: int) -> dict:
    p = meta.prompt_tokens
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


class Formatter:
    """One response's chunks (streamed) or body (whole), for any n, with logprobs and echo.

    Per choice it keeps what runs on across chunks: the completions logprobs' text offsets and,
    for the whole body, the text, finish reason and logprobs so far."""

    def __init__(self, meta: StreamMeta, names: TokenText | None = None, prompt_ids: list[int] | None = None) -> None:
        self.meta = meta
        self.names = names
        self.prompt_ids = prompt_ids or []
        self._offsets: dict[int, CompletionLogprobs] = {}
        self._text: dict[int, list[str]] = {}
        self._finish: dict[int, str | None] = {}
        self._lps: dict[int, list] = {}
        self._reasoning: dict[int, list[str]] = {}
        self._parsers: dict[int, ChoiceParser] = {}  # chat with tools or reasoning: each choice's parser
        self._spec = OutputSpec(meta.reasoning, meta.reasoning_open, meta.tool_parser, meta.tools)
        self._parse = meta.kind == "chat" and (meta.tools or bool(meta.reasoning))
        self.completion_tokens = 0

    def chunk(self, d: Delta | None, usage_: dict | None = None) -> dict:
        """One streamed chunk: a token's delta, or (d None) the usage chunk with no choices."""
        m = self.meta
        obj = "chat.completion.chunk" if m.kind == "chat" else "text_completion"
        c = {"id": m.request_id, "object": obj, "created": m.created, "model": m.model,
             "choices": [] if d is None else [self._choice(d)]}
        if m.continuous_usage and d is not None:
            c["usage"] = usage(m, d.completion_tokens)
        elif m.include_usage:
            c["usage"] = usage_
        return c

    def _choice(self, d: Delta) -> dict:
        lp = self._logprobs(d)
        if self.meta.kind == "chat":
            reasoning, text, calls, finish = self._parsed(d) if self._parse else ("", d.text, [], d.finish_reason)
            delta = {"role": "assistant", "content": text} if d.index == 0 else {"content": text}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if calls:
                delta["tool_calls"] = calls
            return {"index": d.choice, "delta": delta, "finish_reason": finish, "logprobs": lp}
        text = self.meta.echo + d.text if self.meta.echo is not None and d.index == 0 else d.text
        return {"index": d.choice, "text": text, "finish_reason": d.finish_reason, "logprobs": lp}

    def _parsed(self, d: Delta) -> tuple[str, str, list[dict], str | None]:
        """This delta's text past the family's parsers: its reasoning, its content, the calls it
        completed, and its finish reason ("tool_calls" when the choice made calls)."""
        parser = self._parsers.get(d.choice)
        if parser is None:
            parser = self._parsers[d.choice] = ChoiceParser(self._spec, self.meta.request_id, d.choice)
        reasoning, text, calls = parser.feed(d.text)
        finish = d.finish_reason
        if finish is not None:
            r, t, c = parser.finish()
            reasoning, text, calls = reasoning + r, text + t, calls + c
            if finish == "stop" and parser.calls:
                finish = "tool_calls"
        return reasoning, text, calls, finish

    def _message(self, i: int, text: str) -> dict:
        parser = self._parsers.get(i)
        msg: dict = {"role": "assistant", "content": text, "refusal": None}
        if self.meta.reasoning:
            msg["reasoning_content"] = "".join(self._reasoning.get(i, ())) or None
        if parser is None or not parser.calls:
            return msg
        calls = [{k: v for k, v in c.items() if k != "index"} for c in parser.calls]
        return {**msg, "content": text.strip() or None, "tool_calls": calls}

    def _logprobs(self, d: Delta) -> dict | None:
        m = self.meta
        if m.logprobs is None or self.names is None:
            return None
        if m.kind == "chat":
            content = [chat_logprobs(self.names, d.token_id, d.logprobs)] if d.logprobs is not None else []
            return {"content": content, "refusal": None}
        clp = self._offsets.setdefault(d.choice, CompletionLogprobs(self.names))
        parts = []
        if d.index == 0 and m.echo is not None and d.prompt_logprobs is not None:
            parts.append(clp.prompt(self.prompt_ids, d.prompt_logprobs))
        if d.token_id >= 0:
            parts.append(clp.token(d.token_id, d.logprobs))
        return merge_completion(parts) or empty_completion()

    def add(self, d: Delta) -> None:
        """Accumulate one Delta into the whole body."""
        ch = self._choice(d)
        self._text.setdefault(d.choice, []).append(ch["text"] if "text" in ch else ch["delta"]["content"])
        if "delta" in ch and "reasoning_content" in ch["delta"]:
            self._reasoning.setdefault(d.choice, []).append(ch["delta"]["reasoning_content"])
        self._finish[d.choice] = ch["finish_reason"]
        if ch["logprobs"] is not None:
            self._lps.setdefault(d.choice, []).append(ch["logprobs"])
        self.completion_tokens = d.completion_tokens

    def whole(self) -> dict:
        """The non-streamed response body."""
        m = self.meta
        choices = []
        for i in sorted(self._text):
            text, finish, lps = "".join(self._text[i]), self._finish.get(i), self._lps.get(i)
            if m.kind == "chat":
                lp = {"content": [x for p in lps for x in p["content"]], "refusal": None} if lps else None
                if m.logprobs is not None and lp is None:
                    lp = {"content": [], "refusal": None}
                choices.append({"index": i, "message": self._message(i, text), "finish_reason": finish,
                                "logprobs": lp})
            else:
                lp = merge_completion(lps) if lps else None
                choices.append({"index": i, "text": text, "finish_reason": finish, "logprobs": lp})
        obj = "chat.completion" if m.kind == "chat" else "text_completion"
        return {"id": m.request_id, "object": obj, "created": m.created, "model": m.model,
                "choices": choices, "usage": usage(m, self.completion_tokens)}


def event(data: dict | str, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}data: {payload}\n\n".encode()


def formatter(prep: Prepared, token_text: TokenText) -> Formatter:
    meta: StreamMeta = prep.meta
    names = token_text if meta.logprobs is not None else None
    return Formatter(meta, names, prep.request.prompt_ids)


async def sse_events(deltas: AsyncIterator[Delta], prep: Prepared, token_text: TokenText,
                     start: int = 0) -> AsyncIterator[bytes]:
    """The events of `deltas` (the request's relay, `Streaming.stream`) from token index
    `start` on, then usage (if asked) and [DONE]. With n > 1 the events carry no id (a resume
    serves one choice)."""
    meta: StreamMeta = prep.meta
    fmt = formatter(prep, token_text)
    single = prep.request.n <= 1
    n = 0
    try:
        async for d in deltas:
            n = d.completion_tokens
            if d.index >= start:
                yield event(fmt.chunk(d), d.index if single else None)
        if meta.include_usage:
            yield event(fmt.chunk(None, usage(meta, n)))
    except TandemError as e:
        yield event({"error": error_body(e)})
    except Exception as e:
        log.exception("relay failed request_id=%s", prep.request.request_id)
        yield event({"error": {"message": f"internal error: {type(e).__name__}", "type": "internal_error",
                               "param": None, "code": "internal_error"}})
    yield event("[DONE]")


async def _collect(deltas: AsyncIterator[Delta], prep: Prepared, token_text: TokenText) -> dict:
    fmt = formatter(prep, token_text)
    async for d in deltas:
        fmt.add(d)
    return fmt.whole()


async def collect_unless_disconnected(request: Request, deltas: AsyncIterator[Delta], prep: Prepared,
                                      token_text: TokenText, collect: Awaitable[dict] | None = None) -> dict | None:
    """The whole response body of `deltas` (or what `collect`, which reads them, returns), or None
    if the client hung up first (then the relay is cancelled: it sets the cancel key, or for a
    resumable request starts the grace period)."""
    task = asyncio.ensure_future(collect if collect is not None else _collect(deltas, prep, token_text))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client disconnected request_id=%s", prep.request.request_id)
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
