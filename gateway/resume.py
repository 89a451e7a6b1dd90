"""Resumable streams: what a gateway (any replica) needs to replay a request's stream later.

A request sent with `"resumable": true` gets a small record in Redis next to its token stream:
`tandem:gw:resume:{request_id}`, a hash with `rec` (the JSON below) and `attach` (how many
times a client attached), EXPIRE request_timeout_s + token_ttl_s. The tokens themselves are
already in `tandem:tok:{request_id}`; a resume relays that stream again from its first entry
through the same detokenizer and stop strings, so the text of every event index is exactly what
the first connection got, and skips the indices the client already has.

Disconnect policy: when the client of a resumable request goes away before the end, the gateway
does not cancel at once. It waits `resume_grace_s`; if no client attached in the meantime (the
`attach` counter did not move) it sets the cancel key then. A gateway that dies leaves the request
running; workers still drop it at its deadline.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from tandem_core.bus import admission, cancel
from tandem_core.errors import InvalidRequest
from tandem_core.bus import KeySpace

log = logging.getLogger(__name__)


def record_key(ks: KeySpace, request_id: str) -> str:
    return admission.resume_record_key(ks, request_id)


def key_digest(api_key: str) -> str:
    """Who may resume: a digest of the API key that created the request (never the key itself)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass
class StreamMeta:
    """What the HTTP layer needs to format a stream: the same on the first connection and on resume."""

    kind: str  # "completion" | "chat"
    request_id: str
    created: int
    model: str
    prompt_tokens: int
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk (vLLM's stream_options.continuous_usage_stats)
    logprobs: int | None = None  # completions: `logprobs`; chat: `top_logprobs` when `logprobs` is true
    echo: str | None = None  # completions with echo: the prompt's text, written before the output
    tools: bool = False  # chat with tools: the output is parsed for tool calls (toolparse.py)
    # chat: how the model family's output is parsed (gateway/chatformat.py's OutputSpec)
    reasoning: str = ""  # reasoning parser, "" for none
    reasoning_open: bool = False  # the prompt ended inside the model's thinking
    tool_parser: str = "hermes"


@dataclass
class ResumeRecord:
    meta: StreamMeta
    stop: list[str]
    max_tokens: int
    stop_token_ids: list[int]
    deadline_ts: float  # wall clock, as in GenerationRequest
    key: str = ""  # key_digest of the creator's API key
    skip_special_tokens: bool = True  # how the tokens are decoded (a resume decodes them alike)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> "ResumeRecord":
        d = json.loads(s)
        d["meta"] = StreamMeta(**d["meta"])
        d.pop("extra", None)  # written by gateways before it was removed (unused)
        return cls(**d)


async def save(r: aioredis.Redis, ks: KeySpace, rec: ResumeRecord, ttl_s: int) -> None:
    k = record_key(ks, rec.meta.request_id)
    pipe = r.pipeline(transaction=True)
    pipe.hset(k, mapping={"rec": rec.to_json(), "attach": 0})
    pipe.expire(k, ttl_s)
    await pipe.execute()


async def load(r: aioredis.Redis, ks: KeySpace, request_id: str) -> ResumeRecord | None:
    raw = await r.hget(record_key(ks, request_id), "rec")
    return ResumeRecord.from_json(raw) if raw else None


async def attach(r: aioredis.Redis, ks: KeySpace, request_id: str) -> int:
    """Count one more client attached; returns the new count (the caller's attach number)."""
    return int(await r.hincrby(record_key(ks, request_id), "attach", 1))


async def cancel_unless_attached(r: aioredis.Redis, ks: KeySpace, request_id: str, attach_no: int, grace_s: float,
                                 cancel_ttl_s: int) -> None:
    """After `grace_s`, cancel the request unless another client attached since `attach_no`."""
    await asyncio.sleep(grace_s)
    now = await r.hget(record_key(ks, request_id), "attach")
    if now is not None and int(now) != attach_no:
        return
    log.info("no client resumed within %.1fs; cancelling request_id=%s", grace_s, request_id)
    await cancel.request_cancel(r, ks, request_id, cancel_ttl_s)


def start_index(last_event_id: str | None, from_index: str | None) -> int:
    """First token index to send: Last-Event-ID + 1, or ?from=N (the larger if both)."""
    start = 0
    if last_event_id is not None and last_event_id.strip() != "":
        v = last_event_id.strip()
        if not (v.isascii() and v.isdigit()) or len(v) > 9:
            raise InvalidRequest(
                f"Last-Event-ID must be a token index (a non-negative integer), got {v[:32]!r}",
                param="Last-Event-ID",
            )
        start = int(v) + 1
    if from_index is not None:
        if not (from_index.isascii() and from_index.isdigit()) or len(from_index) > 9:
            raise InvalidRequest(f"from must be a non-negative integer, got {from_index[:32]!r}", param="from")
        start = max(start, int(from_index))
    return start
