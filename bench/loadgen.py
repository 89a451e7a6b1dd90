"""A light load generator for any OpenAI-compatible `/v1/completions` endpoint, and its statistics.

Why it is this small: on a 2-core machine the client competes with the server for the CPUs, so every
system is driven by the same one-process asyncio client (httpx, one streamed request per task,
token-id prompts so the client never tokenizes, `ignore_eos` so outputs have the asked length).

Workloads are lists of `RequestSpec` (arrival offset, prompt length, output length, kind) built from
a seed: Poisson arrivals at a rate, a fixed concurrency (closed loop), fixed lengths or a synthetic
chat-like distribution (log-normal prompt and output lengths), and bursts of long prompts laid over
a steady stream. Per request it records the time to first token, every inter-token gap (between
consecutive streamed token events), the end-to-end latency, tokens in and out, and the error.

The statistics (percentiles, SLO attainment, goodput: the highest rate at which >= 90% of requests
meet both a TTFT and a time-per-output-token SLO, DistServe's measure) are pure functions over
recorded timings, unit-tested on synthetic ones. It knows nothing of Tandem.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

CLIENT_NAME = "bench/loadgen.py (one asyncio process, httpx streaming, token-id prompts, ignore_eos)"


def prioritize_client() -> str:
    """Run this thread (the load generator's event loop) at the lowest real-time round-robin
    priority, and whatever it starts (servers, helper threads) at the normal policy
    (SCHED_RESET_ON_FORK). On a 2-vCPU machine a server that keeps both CPUs busy leaves a client
    at the normal policy runnable but not run for a whole request: with vLLM CPU (its worker
    computing on one CPU, its engine core yield-spinning on the other) the client waited
    110-630 ms on the run queue per one-stream request (/proc/self/schedstat, 2026-12-07), read
    every token of it at once, and the bench judged vLLM unhealthy for it. At SCHED_RR it waited
    0-1.6 ms and read one token per event ~2 ms apart. The same for every system. Returns how the
    client runs (for the report)."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(1))
        return "SCHED_RR priority 1"
    except (AttributeError, OSError) as e:  # not Linux, or not allowed
        return f"the normal policy (SCHED_RR refused: {type(e).__name__})"


def add_client_policy(p) -> None:
    """The `--normal-client` flag of a bench that runs this client (argparse parser `p`)."""
    p.add_argument("--normal-client", action="store_true",
                   help="the client at the normal scheduling policy, not SCHED_RR (how the benches ran before 2026-12-07)")


def client_policy(normal: bool) -> str:
    """Put the client at SCHED_RR (`prioritize_client`) unless `normal`; how it runs (for the report)."""
    return "the normal policy (--normal-client)" if normal else prioritize_client()


def runqueue_wait_ms() -> float | None:
    """How long this process's main thread (the client's event loop) has been runnable but not
    running so far, in ms (/proc/self/schedstat's second field; None where the kernel keeps none)."""
    try:
        return int(Path("/proc/self/schedstat").read_text().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class RequestSpec:
    arrival_s: float  # offset from the start of the run; ignored in closed-loop mode
    prompt_len: int
    output_len: int
    kind: str = "short"  # "short" (steady stream) or "long" (burst)
    prompt: list[int] = field(default_factory=list)


@dataclass
class RequestResult:
    kind: str
    prompt_len: int
    output_len: int  # asked
    sent_s: float  # offset from the start of the run
    ttft_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)  # offset of every token event from the run start
    e2e_s: float = math.nan
    tokens_out: int = 0  # token events (SSE data lines with a choice)
    error: str | None = None
    reads: int = 0  # network reads that carried at least one token event
    usage_tokens: int | None = None  # completion_tokens of the final usage chunk, when one came

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens_out > 0

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (DistServe's per-token measure)."""
        if self.tokens_out <= 1:
            return 0.0 if self.ok else math.nan
        return (self.e2e_s - self.ttft_s) / (self.tokens_out - 1)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# workloads


def chat_lengths(rng: np.random.Generator, n: int, prompt_median: int = 48, output_median: int = 32,
                 sigma: float = 0.6, max_prompt: int = 256, max_output: int = 128) -> list[tuple[int, int]]:
    """Synthetic chat-like lengths: log-normal around the medians (ShareGPT's shape, scaled to a
    tiny model's context), clipped to [4, max]."""
    p = np.clip(np.round(rng.lognormal(math.log(prompt_median), sigma, n)), 4, max_prompt).astype(int)
    o = np.clip(np.round(rng.lognormal(math.log(output_median), sigma, n)), 4, max_output).astype(int)
    return list(zip(p.tolist(), o.tolist()))


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> list[float]:
    """n arrival offsets of a Poisson process of `rate` requests/s (exponential gaps)."""
    if rate <= 0:
        return [0.0] * n
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


def make_workload(seed: int, n: int, rate: float, lengths: str | tuple[int, int], vocab: int,
                  bursts: tuple[int, float, int, int] | None = None) -> list[RequestSpec]:
    """`n` steady requests arriving at `rate` (0: all at once, for closed-loop runs), with fixed
    (prompt, output) lengths or "chat" lengths; plus, when `bursts` = (size, every_s, prompt_len,
    output_len), a burst of `size` long prompts every `every_s` seconds over the same span."""
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rng, rate, n)
    lens = chat_lengths(rng, n) if lengths == "chat" else [tuple(lengths)] * n
    specs = [RequestSpec(a, p, o, "short") for a, (p, o) in zip(arrivals, lens)]
    if bursts:
        size, every_s, blen, bout = bursts
        span = arrivals[-1] if arrivals else 0.0
        t = every_s / 2
        while t < span:
            specs += [RequestSpec(t, blen, bout, "long") for _ in range(size)]
            t += every_s
    specs.sort(key=lambda s: s.arrival_s)
    for s in specs:  # ids from [3, vocab): clear of the usual special tokens at 0..2
        s.prompt = rng.integers(3, vocab, s.prompt_len).tolist()
    return specs


# ---------------------------------------------------------------------------------------------
# the client


def _parse_event(data: str) -> tuple[int, str | None, int | None]:
    """(token events in this SSE data line, in-band error, usage completion_tokens). Usage-only
    chunks count zero events."""
    obj = json.loads(data)
    if "error" in obj:
        return 0, str(obj["error"].get("message", obj["error"])), None
    usage = obj.get("usage") or {}
    done = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return (1 if obj.get("choices") else 0), None, (int(done) if done is not None else None)


async def _sse_lines(resp):
    """(line, index of the network read that completed it). Lines split on "\n" only: httpx's
    aiter_lines also splits on the Unicode line boundaries (U+0085, U+2028, ...) that a JSON string
    carrying generated text may hold unescaped."""
    buf = ""
    n = 0
    async for text in resp.aiter_text():
        n += 1
        buf += text
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.rstrip("\r"), n
    if buf:
        yield buf, n


async def _one(client, url: str, model: str, spec: RequestSpec, t0: float, extra: dict,
               timeout_s: float) -> RequestResult:
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len, "temperature": 0,
            "stream": True, "ignore_eos": True, **extra}
    res = RequestResult(spec.kind, spec.prompt_len, spec.output_len, time.perf_counter() - t0)
    start = time.perf_counter()
    last = start
    last_read = 0
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line, read in _sse_lines(resp):
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                n, err, usage = _parse_event(line[5:].strip())
                if err:
                    res.error = err
                    break
                if usage is not None:
                    res.usage_tokens = usage
                if not n:
                    continue
                if read != last_read:
                    res.reads += 1
                    last_read = read
                now = time.perf_counter()
                if res.tokens_out == 0:
                    res.ttft_s = now - start
                else:
                    res.itl_s.append(now - last)
                res.token_s.append(now - t0)
                res.tokens_out += n
                last = now
    except Exception as e:  # noqa: BLE001 - recorded per request; the run goes on
        res.error = f"{type(e).__name__}: {e}"
    res.e2e_s = last - start if res.tokens_out else math.nan
    return res


async def run_load(base_url: str, model: str, specs: Sequence[RequestSpec], *, concurrency: int = 0,
                   extra: dict | None = None, timeout_s: float = 120.0) -> tuple[list[RequestResult], float]:
    """Send `specs` and return (results in spec order, wall seconds). concurrency > 0: closed loop
    with that many requests in flight (arrival offsets ignored); else open loop at the offsets."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    extra = extra or {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        t0 = time.perf_counter()
        if concurrency > 0:
            results: list[RequestResult | None] = [None] * len(specs)
            it = iter(enumerate(specs))

            async def worker() -> None:
                for i, s in it:
                    results[i] = await _one(client, url, model, s, t0, extra, timeout_s)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            async def delayed(s: RequestSpec) -> RequestResult:
                await asyncio.sleep(max(0.0, s.arrival_s - (time.perf_counter() - t0)))
                return await _one(client, url, model, s, t0, extra, timeout_s)

            results = await asyncio.gather(*(delayed(s) for s in specs))
        return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# statistics (pure)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default); NaN for no values."""
    v = sorted(x for x in values if not math.isnan(x))
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def pcts(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in qs}


def slo_attainment(results: Sequence[RequestResult], ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Fraction of requests that finished without error and met both SLOs (failures count as misses)."""
    if not results:
        return math.nan
    good = sum(1 for r in results if r.ok and r.ttft_s <= ttft_slo_s and r.tpot_s <= tpot_slo_s)
    return good / len(results)


def summarize(results: Sequence[RequestResult], wall_s: float, ttft_slo_s: float, tpot_slo_s: float,
              kinds: Sequence[str] | None = None) -> dict:
    """Latency percentiles, throughput and SLO attainment of one run (of the given request kinds)."""
    rs = [r for r in results if kinds is None or r.kind in kinds]
    ok = [r for r in rs if r.ok]
    itl = [g for r in ok for g in r.itl_s]
    tokens = sum(r.tokens_out for r in rs)
    return {
        "requests": len(rs), "errors": len(rs) - len(ok),
        "ttft_s": pcts([r.ttft_s for r in ok]), "itl_s": pcts(itl), "e2e_s": pcts([r.e2e_s for r in ok]),
        "tpot_s": pcts([r.tpot_s for r in ok]),
        "tokens_in": sum(r.prompt_len for r in rs), "tokens_out": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else math.nan,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else math.nan,
        "slo_attainment": slo_attainment(rs, ttft_slo_s, tpot_slo_s),
        "wall_s": wall_s,
    }


def goodput(points: Sequence[tuple[float, float]], target: float = 0.9) -> float:
    """The highest request rate whose SLO attainment is >= `target`, from (rate, attainment) points of
    a sweep. Rates are taken in increasing order up to the first miss; between the last passing and
    the first missing rate the crossing is interpolated linearly. 0.0 when the lowest rate misses."""
    pts = sorted((r, a) for r, a in points if not math.isnan(a))
    best = 0.0
    prev: tuple[float, float] | None = None
    for rate, att in pts:
        if att < target:
            if prev is None:
                return 0.0
            r0, a0 = prev
            return r0 + (rate - r0) * (a0 - target) / (a0 - att)
        best, prev = rate, (rate, att)
    return best


def delayed_step_fraction(results: Sequence[RequestResult], factor: float = 3.0,
                          kinds: Sequence[str] = ("short",)) -> float:
    """Fraction of inter-token gaps (decode steps seen by a client) longer than `factor` x the
    median gap of the same run: steps that had something else (a prefill) in their way."""
    gaps = [g for r in results if r.ok and r.kind in kinds for g in r.itl_s]
    if not gaps:
        return math.nan
    med = percentile(gaps, 50)
    return sum(1 for g in gaps if g > factor * med) / len(gaps)


# A step (a gap between two tokens of one short request) is "delayed" when it is longer than this
# many times the run's median gap (bench/interleave.py's measure).
DELAY_FACTOR = 3.0


def burst_windows(results: Sequence[RequestResult]) -> list[tuple[float, float]]:
    """[sent, last token] of every long request: the spans during which a long prompt is in flight."""
    return [(r.sent_s, r.sent_s + (r.e2e_s if r.ok else r.ttft_s or 0.0)) for r in results
            if r.kind == "long" and r.ok]


def gaps_under_burst(results: Sequence[RequestResult]) -> list[float]:
    """Short requests' inter-token gaps that end inside a burst window."""
    wins = burst_windows(results)
    out = []
    for r in results:
        if r.kind != "short" or not r.ok:
            continue
        for gap, t in zip(r.itl_s, r.token_s[1:]):
            if any(a <= t <= b for a, b in wins):
                out.append(gap)
    return out


def burst_summary(results: Sequence[RequestResult], wall_s: float, slo: tuple[float, float],
                  delay_factor: float = DELAY_FACTOR) -> dict:
    """A `burst` workload's run (short requests with bursts of long prompts laid over them): the
    short, long and all requests' summaries, the short requests' gaps under bursts, and the delayed
    steps (bench/serve.py's burst runs, read by bench/interleave.py)."""
    return {
        "short": summarize(results, wall_s, *slo, kinds=("short",)),
        "long": summarize(results, wall_s, *slo, kinds=("long",)),
        "all": summarize(results, wall_s, *slo),
        "itl_under_burst_s": pcts(gaps_under_burst(results)),
        "delayed_step_fraction": delayed_step_fraction(results, delay_factor),
    }
