"""The client side of a fault test: greedy, resumable, streamed requests sent as a batch while a
fault is injected (`run_batch`), and the verdict on what came back against an unbroken reference
run (`judge`): every request finished, no token index missing or repeated, the same text.

Used by tests/e2e/faults.py (the scenarios) and, through it, by bench/faults.py (the report).
Knows nothing of how a fault is injected: that is tests/e2e/fault_inject.py.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass, field

import httpx

from tests.e2e.sse import sse_chunks

MODEL = "tiny"
CLIENT_WAIT_S = float(os.environ.get("TANDEM_FAULT_CLIENT_WAIT_S", "120"))  # a client's patience


@dataclass
class Stream:
    indices: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    error: str | None = None
    resumes: int = 0
    refused: int = 0  # 429/503 answers before admission (the client waited Retry-After and sent again)
    request_id: str = ""


@dataclass
class FaultResult:
    fault: str
    sent: int
    interrupted: int  # streams with tokens on both sides of the fault
    finished: int
    lost: int  # neither finished nor answered with an error: hung until the client gave up
    duplicated: int
    missing: int
    wrong_text: int
    recover_s: float
    notes: str = ""
    refused: int = 0  # 429/503 answers the clients got (and retried after Retry-After)
    failed: int = 0  # ended with a clear error from the server (not counted as lost)

    @property
    def ok(self) -> bool:
        return self.finished == self.sent and not (self.lost or self.duplicated or self.missing or self.wrong_text)


def prompts(n: int, long: bool = False) -> list[str]:
    pad = " and so on" * (30 if long else 1)
    return [f"request {i}: a prompt that is long enough for remote prefill{pad}" for i in range(n)]


async def stream_one(c: httpx.AsyncClient, prompt: str, max_tokens: int, out: Stream) -> None:
    """One streamed request. It is `resumable` and carries its own `X-Request-Id`: when the
    connection breaks (a gateway died), the client reattaches with the stream's next index, as an
    SSE client would, until the stream ends; when it broke before any answer, it sends the POST
    again with the same id, which the gateway replays instead of running twice."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "resumable": True}
    rid, answered = f"fault-{uuid.uuid4().hex}", False
    out.request_id = rid
    deadline = time.monotonic() + CLIENT_WAIT_S
    while time.monotonic() < deadline:
        try:
            if not answered:
                req = c.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": rid})
            else:
                nxt = out.indices[-1] + 1 if out.indices else 0
                req = c.stream("GET", f"/v1/requests/{rid}/stream", params={"from": nxt})
            async with req as resp:
                if resp.status_code in (429, 503) and not answered:  # not admitted: retry, as clients do
                    out.resumes += 1
                    out.refused += 1
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                    continue
                if resp.status_code != 200:
                    out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return
                answered = True
                await _read_sse(resp, out)
                return
        except httpx.HTTPError:
            # The gateway died or is restarting: resume (or send the POST again: same id, so safe).
            out.resumes += 1
            await asyncio.sleep(0.3)
    out.error = out.error or f"{GAVE_UP} {CLIENT_WAIT_S:g} s"


async def _read_sse(resp: httpx.Response, out: Stream) -> None:
    async for event_id, chunk in sse_chunks(resp):
        if "error" in chunk:
            out.error = chunk["error"]["message"]
            continue
        if chunk.get("choices"):
            ch = chunk["choices"][0]
            out.indices.append(event_id)
            out.times.append(time.monotonic())
            out.text += ch["text"]
            out.finish = ch["finish_reason"] or out.finish


async def run_batch(base: str, ps: list[str], max_tokens: int, inject=None, trigger=None,
                    late: int = 0) -> tuple[list[Stream], float]:
    """Stream all prompts at once; when `trigger(streams)` first holds, `await inject()`. The last
    `late` prompts are sent only once the fault has struck (requests arriving during it)."""
    outs = [Stream() for _ in ps]
    first = len(ps) - late
    fault_at = 0.0
    async with httpx.AsyncClient(base_url=base, timeout=240) as c:
        tasks = [asyncio.create_task(stream_one(c, p, max_tokens, o)) for p, o in zip(ps[:first], outs)]
        if inject is not None:
            deadline = time.monotonic() + 60
            while not await trigger(c, outs[:first]) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            injecting = asyncio.create_task(inject())
            if late:
                await asyncio.sleep(0.2)  # the fault has struck; the late requests arrive during it
                tasks += [asyncio.create_task(stream_one(c, p, max_tokens, o))
                          for p, o in zip(ps[first:], outs[first:])]
            fault_at = await injecting or time.monotonic()  # inject returns the moment it struck
        await asyncio.gather(*tasks)
    return outs, fault_at


GAVE_UP = "did not finish within"  # the client's own verdict: the server never answered


def judge(fault: str, ref: list[Stream], got: list[Stream], max_tokens: int, fault_at: float, notes="") -> FaultResult:
    finished = sum(1 for g in got if g.finish and not g.error)
    dup = sum(len(g.indices) - len(set(g.indices)) for g in got)
    missing = sum(len(set(range(max_tokens)) - set(g.indices)) for g in got if g.finish)
    wrong = sum(1 for r, g in zip(ref, got) if g.finish and g.text != r.text)
    # Streams the fault caught mid-flight: a token before it and another after it. Recovery is
    # the longest such gap (for a stream not started yet, from the fault to its first token).
    # (Tokens already in Redis at the fault can still reach the client after it, so the stall is
    # the longest gap that ends after the fault, not just the one spanning it.)
    interrupted, recover = 0, 0.0
    for g in got:
        before = [t for t in g.times if t <= fault_at]
        after = [t for t in g.times if t > fault_at]
        if before and after:
            interrupted += 1
            times = before[-1:] + after
            recover = max(recover, max(b - a for a, b in zip(times, times[1:])))
        elif after:
            recover = max(recover, after[0] - fault_at)
    errors = "; ".join(sorted({g.error for g in got if g.error}))[:300]
    gave_up = [g for g in got if not g.finish and (not g.error or g.error.startswith(GAVE_UP))]
    if gave_up:  # named, to look them up in the cluster's log (--cluster-log)
        errors = " ".join(f"lost {g.request_id} after {len(g.indices)} tokens;" for g in gave_up) + " " + errors
    for r, g in zip(ref, got):
        if g.finish and g.text != r.text:
            at = next((i for i, (a, b) in enumerate(zip(r.text, g.text)) if a != b), min(len(r.text), len(g.text)))
            errors += f" text differs at char {at}: {r.text[at:at + 12]!r} vs {g.text[at:at + 12]!r};"
    failed = sum(1 for g in got if g.error and not g.error.startswith(GAVE_UP))
    return FaultResult(fault, len(got), interrupted, finished, len(got) - finished - failed, dup, missing, wrong,
                       round(recover, 2), notes or errors, refused=sum(g.refused for g in got), failed=failed)
