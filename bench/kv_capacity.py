"""KV capacity, throughput and KV bytes moved, fixed slots against paged KV at the same KV memory
(issue 30), on the whole system as a user runs it: `tandem local` (1 prefill + 1 decode pod) and a
real HTTP client (bench/loadgen.py).

    python bench/kv_capacity.py [--quick] [--no-write] [--slots S] [--max-len M] [--block-size B]
                                [--configs slots,paged] [--tandem-args ARGS] [--ready-timeout SECONDS]

Two configurations, back to back in one run, with the SAME KV memory budget (S x M positions):
  * slots  `tandem local --slots S --max-len M`: a pool of S x M positions for S rows, so every row
           can reach M at once (the capacity of the slot layout issue 43 deleted, which set M
           positions aside per slot);
  * paged  `--slots R --max-len M --kv-blocks S*ceil(M/B) --kv-block-size B`
           (R = --paged-rows, default 4 S: rows are cheap, blocks are the memory). `--tandem-args`
           replaces the flags after --max-len (a --slots among them wins over R). When this checkout's `tandem local --help` does not list every flag
           the paged side needs, the paged side is NOT run and the section says so (no numbers).
Each configuration runs three parts on one cluster:
  1. capacity: a mixed-length workload (`chat_pairs`: log-normal prompt and output lengths shaped
     like ShareGPT's, scaled to the model's context, clipped to 32-900 / 16-256 and to prompt +
     output <= M), `--requests` requests from `--clients` closed-loop clients (more than the pod can
     hold: saturation), greedy, `ignore_eos`. /admin/cluster is sampled every 0.25 s: sequences the
     decode pod holds (its `requests.running`; slots - free_slots when absent; slots - free_slots is
     reported beside it as rows taken), max and median over
     the steady part (from 15% of the time the last request was sent to that time); output tok/s
     over the same window (tokens the client received in it); TTFT / TPOT p50 and p90 of all requests.
  2. multi-turn: one conversation of `--turns` turns, each turn's prompt = the previous prompt + a
     synthetic assistant reply + a new user message (token ids; synthetic replies as bench/prefix.py
     does: the completions API returns text). Per turn: the KV bytes the decode pod pulled (its
     heartbeat's `pulled_kv_bytes`) against what the new turn's tokens need (tokens not in the
     previous turn's prompt x per-token KV bytes = layers x 2 x kv_heads x head_dim x dtype bytes).
  3. prefix hits: `--prefix-requests` requests one after another, sharing a 384-token system prompt
     never sent before; the bytes the prefill pod's prefix cache copied for its hits (the pods'
     `prefix_cache.hit_copy_bytes`) per request that hit and per hit token.
Writes bench/out/kv_capacity.json and, unless --no-write, the `kv_capacity` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import code_version, machine_info, machine_line, markdown_table, merge_summary, write_section
from bench.loadgen import CLIENT_NAME, RequestSpec, add_client_policy, client_policy, percentile, run_load
from bench.systems import ROOT, TandemLocal, model_id, warm_up

OUT = ROOT / "bench" / "out" / "kv_capacity"
SECTION = "kv_capacity"
EXTRA = {"ignore_eos": True, "temperature": 0.0}

# The chat shape: ShareGPT's lengths as the vLLM paper reports them (mean input 161, mean output 338
# tokens, for a 2,048-token context), log-normal (long right tails), scaled by context / 2,048.
REF_CONTEXT = 2048
PROMPT_MEAN, OUTPUT_MEAN = 161.0, 338.0
PROMPT_SIGMA, OUTPUT_SIGMA = 1.0, 0.8
PROMPT_RANGE, OUTPUT_RANGE = (32, 900), (16, 256)
TARGET_HELD, TARGET_TOKS = 3.0, 1.5  # issue 30: paged / slots
MIN_SAMPLES = 5  # heartbeat samples in the window below which the held ratio is the client view's


# ---------------------------------------------------------------------------------------------
# workloads and arithmetic (pure)


def chat_pairs(seed: int, n: int, context: int, prompt_range: tuple[int, int] = PROMPT_RANGE,
               output_range: tuple[int, int] = OUTPUT_RANGE, prompt_mean: float = PROMPT_MEAN,
               output_mean: float = OUTPUT_MEAN, sigmas: tuple[float, float] = (PROMPT_SIGMA, OUTPUT_SIGMA),
               ref_context: int = REF_CONTEXT) -> list[tuple[int, int]]:
    """`n` (prompt length, output length) pairs, seeded: log-normal with the given means scaled by
    context / ref_context (a log-normal's median is its mean / exp(sigma^2 / 2)), rounded, clipped
    to the ranges, and the output cut so that prompt + output <= context (the prompt first capped at
    context - the shortest output)."""
    lo_p, hi_p = prompt_range
    lo_o, hi_o = output_range
    hi_p = min(hi_p, context - lo_o)
    if context < lo_p + lo_o or hi_p < lo_p or hi_o < lo_o:
        raise ValueError(f"a context of {context} cannot hold a prompt of {lo_p} and an output of {lo_o}")
    rng = np.random.default_rng(seed)
    scale = context / ref_context
    sp, so = sigmas
    p = rng.lognormal(math.log(prompt_mean * scale) - sp * sp / 2, sp, n)
    o = rng.lognormal(math.log(output_mean * scale) - so * so / 2, so, n)
    p = np.clip(np.round(p), lo_p, hi_p).astype(int)
    o = np.clip(np.round(o), lo_o, hi_o).astype(int)
    o = np.minimum(o, context - p)
    return list(zip(p.tolist(), o.tolist()))


def specs_of(pairs: list[tuple[int, int]], vocab: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed + 1)
    return [RequestSpec(0.0, p, o, "chat", rng.integers(3, vocab, p).tolist()) for p, o in pairs]


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one position in every layer."""
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def paged_blocks(slots: int, max_len: int, block: int) -> int:
    """The blocks that hold the same KV as `slots` slots of `max_len` positions."""
    return slots * -(-max_len // block)


def conversation(seed: int, turns: int, vocab: int, system_len: int = 64, user_len: tuple[int, int] = (24, 48),
                 assistant_len: int = 48) -> list[list[int]]:
    """prompts[k] = turn k+1's prompt: turn k's prompt + a synthetic assistant reply + a user message."""
    rng = np.random.default_rng(seed)
    history = rng.integers(3, vocab, system_len).tolist()
    out = []
    for k in range(turns):
        if k:
            history += rng.integers(3, vocab, assistant_len).tolist()
        history += rng.integers(3, vocab, int(rng.integers(user_len[0], user_len[1] + 1))).tolist()
        out.append(list(history))
    return out


def new_tokens(prompts: list[list[int]]) -> list[int]:
    """Per turn, the tokens not in the previous turn's prompt (the whole prompt for the first)."""
    return [len(p) - (len(prompts[i - 1]) if i else 0) for i, p in enumerate(prompts)]


def steady_window(sent_s: list[float], start_frac: float = 0.15) -> tuple[float, float]:
    """The saturated part of a closed-loop run: from `start_frac` of the time the last request was
    sent to that time (after it, fewer requests wait than clients)."""
    end = max(sent_s) if sent_s else 0.0
    return start_frac * end, end


def held_stats(samples: list[tuple[float, int]], window: tuple[float, float]) -> dict:
    """Max and median of the sequences held over the samples inside `window` (NaN when none)."""
    a, b = window
    xs = [h for t, h in samples if a <= t <= b]
    return {"max": max(xs) if xs else math.nan, "median": statistics.median(xs) if xs else math.nan,
            "samples": len(xs)}


def decoding_at_once(spans: list[tuple[float, float]], window: tuple[float, float], step_s: float = 0.05) -> dict:
    """The client's view of the sequences decoding at once: at every `step_s` in `window`, how many
    requests are between their second token (the decode pod's first) and their last; max and median."""
    a, b = window
    if b <= a:
        return {"max": math.nan, "median": math.nan}
    xs = [sum(1 for s, e in spans if s <= t <= e) for t in np.arange(a, b, step_s)]
    return {"max": max(xs), "median": statistics.median(xs)}


def tokens_per_s(token_times: list[float], window: tuple[float, float]) -> float:
    """Tokens received inside `window` over its length."""
    a, b = window
    if b <= a:
        return math.nan
    return sum(1 for t in token_times if a <= t <= b) / (b - a)


def ratio(after: float | None, before: float | None) -> float:
    if after is None or before is None or not before or math.isnan(after) or math.isnan(before):
        return math.nan
    return after / before


def turn_rows(prompts: list[list[int]], pulled: list[int | None], per_token: int) -> list[dict]:
    """Per turn: its prompt and new tokens, the bytes they need, the bytes pulled and the ratio."""
    rows = []
    for p, new, got in zip(prompts, new_tokens(prompts), pulled):
        need = new * per_token
        rows.append({"prompt_tokens": len(p), "new_tokens": new, "needed_bytes": need, "pulled_bytes": got,
                     "whole_prompt_bytes": len(p) * per_token,
                     "pulled_over_needed": got / need if got is not None and need else math.nan})
    return rows


def multi_turn_met(rows: list[dict], per_token: int, block: int) -> bool | None:
    """Every turn after the first pulled no more than its new tokens need, rounded up to whole
    blocks of `block` positions (a block transfer moves the partly filled last block too); None
    when a turn's bytes are unknown."""
    later = rows[1:]
    if not later or any(r["pulled_bytes"] is None for r in later):
        return None
    return all(r["pulled_bytes"] <= (-(-r["new_tokens"] // block) + 1) * block * per_token for r in later)


# ---------------------------------------------------------------------------------------------
# the systems


@dataclass
class Config:
    name: str
    args: list[str] = field(default_factory=list)  # `tandem local` flags after TandemLocal's own
    rows: int = 0  # sequences it may run at once: its --slots (slots, or the paged side's rows)
    kv_positions: int = 0  # the KV memory, in positions
    skipped: str = ""  # why it does not run here


def local_help(root: Path = ROOT) -> str:
    """`tandem local --help` of the checkout at `root`."""
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "local", "--help"], cwd=root, capture_output=True,
                         text=True, timeout=120)
    return out.stdout + out.stderr


def missing_flags(args: list[str], help_text: str) -> list[str]:
    """The `--flags` of `args` that `help_text` does not list."""
    listed = set(re.findall(r"--[A-Za-z0-9][\w-]*", help_text))
    return [a for a in args if a.startswith("--") and a.split("=", 1)[0] not in listed]


def flag_value(args: list[str], name: str) -> str | None:
    """The last value of `name` in `args` (`--x V` or `--x=V`), None when absent."""
    out = None
    for i, x in enumerate(args):
        if x == name and i + 1 < len(args):
            out = args[i + 1]
        elif x.startswith(name + "="):
            out = x.split("=", 1)[1]
    return out


def after_config(args: list[str], rows: int, max_len: int) -> Config:
    """The paged side as its flags say: rows from a --slots among them (else `rows`), KV positions
    from --kv-blocks x --kv-block-size (else rows x max_len)."""
    rows = int(flag_value(args, "--slots") or rows)
    blocks, block = flag_value(args, "--kv-blocks"), flag_value(args, "--kv-block-size")
    return Config("paged", args, rows, int(blocks) * int(block or 16) if blocks is not None else rows * max_len)


def configs(a) -> list[Config]:
    slots = Config("slots", ["--kv-block-size", str(a.block_size)], a.slots, a.slots * a.max_len)
    blocks = paged_blocks(a.slots, a.max_len, a.block_size)
    args = shlex.split(a.tandem_args) if a.tandem_args else [
        "--kv-blocks", str(blocks), "--kv-block-size", str(a.block_size)]
    paged = after_config(args, a.paged_rows, a.max_len)
    out = []
    for c in (slots, paged):
        if c.name not in a.configs:
            continue
        if c.args:
            gone = missing_flags(c.args, local_help())
            if gone:
                c.skipped = (f"`tandem local` does not accept {', '.join(gone)} yet in this checkout (paged KV and "
                             "block admission not merged): not run, no numbers")
        out.append(c)
    return out


def flags(c: Config, a) -> str:
    """The configuration's own `tandem local` flags (a later --slots in `args` wins)."""
    return " ".join([f"--slots {c.rows} --max-len {a.max_len}", *c.args])


def pod_args(a) -> list[str]:
    """Both sides' flags beyond TandemLocal's `--prefill 1 --decode 1` (the last of a flag wins)."""
    return ["--prefill", str(a.prefill_pods)] if a.prefill_pods != 1 else []


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def decode_workers(cluster: dict) -> list[dict]:
    return [w for w in cluster.get("workers", []) if w.get("role") == "decode" and not w.get("draining")]


def ready_now(cluster: dict) -> int:
    """Prefilled requests waiting for a decode pod to pull them (/admin/cluster's `queues.ready`)."""
    return int((cluster.get("queues") or {}).get("ready") or 0)


def starved_fraction(samples: list[tuple[float, int]], window: tuple[float, float]) -> float:
    """Of the samples in `window`, the fraction with nothing prefilled waiting for the decode pod:
    while it is high the decode pod was fed too slowly to be what limits the run (NaN: no samples)."""
    a, b = window
    xs = [n for t, n in samples if a <= t <= b]
    return sum(1 for n in xs if n == 0) / len(xs) if xs else math.nan


def held_now(cluster: dict) -> tuple[int, int]:
    """(sequences the decode pods run: `requests.running` from their heartbeats, else slots - free;
    slots - free: rows taken, a request being pulled or queued for its insert included)."""
    running = occupied = 0
    for w in decode_workers(cluster):
        taken = int(w.get("slots", 0)) - int(w.get("free_slots", 0))
        r = ((w.get("extra") or {}).get("requests") or {}).get("running")
        running += int(r) if r is not None else taken
        occupied += taken
    return running, occupied


def extra_sum(cluster: dict, key: str, role: str | None = None, sub: str | None = None) -> int | None:
    """The sum of the workers' heartbeat `extra[key]` (or `extra[sub][key]`); None when none reports it."""
    vals = []
    for w in cluster.get("workers", []):
        if role and w.get("role") != role:
            continue
        e = (w.get("extra") or {})
        e = (e.get(sub) or {}) if sub else e
        if key in e:
            vals.append(int(e[key] or 0))
    return sum(vals) if vals else None


class Sampler:
    """Samples /admin/cluster every `every_s` on a thread: (seconds since `t0`, sequences running,
    rows taken)."""

    def __init__(self, base_url: str, t0: float, every_s: float = 0.25) -> None:
        self.url, self.t0, self.every_s = base_url + "/admin/cluster", t0, every_s
        self.samples: list[tuple[float, int, int]] = []
        self.ready: list[tuple[float, int]] = []  # (seconds since t0, prefilled requests waiting)
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c = get_json(self.url)
                now = time.perf_counter() - self.t0
                self.samples.append((now, *held_now(c)))
                self.ready.append((now, ready_now(c)))
                self.last = c
            except OSError:
                pass
            self._stop.wait(self.every_s)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


async def settled(base_url: str, ok=lambda c: True, gap_s: float = 1.2, timeout_s: float = 20.0) -> dict:
    """/admin/cluster once `ok(cluster)` holds and two reads `gap_s` apart give the same counters
    (pods heartbeat every second)."""
    def counters(c: dict) -> tuple:
        return tuple((w.get("id"), (w.get("extra") or {}).get("pulled"), (w.get("extra") or {}).get("pulled_kv_bytes"),
                      json.dumps((w.get("extra") or {}).get("prefix_cache"), sort_keys=True))
                     for w in sorted(c.get("workers", []), key=lambda w: str(w.get("id"))))
    deadline = time.monotonic() + timeout_s
    last = get_json(base_url + "/admin/cluster")
    while time.monotonic() < deadline:
        await asyncio.sleep(gap_s)
        now = get_json(base_url + "/admin/cluster")
        if ok(now) and counters(now) == counters(last):
            return now
        last = now
    return last


# ---------------------------------------------------------------------------------------------
# the three parts


async def capacity(url: str, model: str, a, vocab: int) -> dict:
    specs = specs_of(chat_pairs(a.seed, a.requests, a.max_len), vocab, a.seed)
    warm = specs_of(chat_pairs(a.seed + 100, a.clients, a.max_len), vocab, a.seed + 100)
    await warm_up(url, model, specs, a.clients, EXTRA)  # every prefill bucket, then a full batch
    await run_load(url, model, [RequestSpec(0.0, s.prompt_len, 8, "warm", s.prompt) for s in warm],
                   concurrency=a.clients, extra=EXTRA, timeout_s=600)  # mixed prefill batches: compiled
    t0 = time.perf_counter()
    with Sampler(url, t0) as sampler:
        res, wall = await run_load(url, model, specs, concurrency=a.clients, extra=EXTRA, timeout_s=600)
    ok = [r for r in res if r.ok]
    window = steady_window([r.sent_s for r in res])
    held = held_stats([(t, run) for t, run, _ in sampler.samples], window)
    occupied = held_stats([(t, taken) for t, _, taken in sampler.samples], window)
    toks = tokens_per_s([t for r in ok for t in r.token_s], window)
    client = decoding_at_once([(r.token_s[1], r.token_s[-1]) for r in ok if len(r.token_s) > 1], window)
    out = {"requests": len(res), "errors": len(res) - len(ok), "wall_s": wall, "window_s": list(window),
           "held": held, "occupied": occupied, "decoding_client_view": client,
           "ready_empty_fraction": starved_fraction(sampler.ready, window), "output_tok_s": toks, "output_tok_s_whole_run": sum(r.tokens_out for r in ok) / wall,
           "ttft_ms": {f"p{q}": 1e3 * percentile([r.ttft_s for r in ok], q) for q in (50, 90)},
           "tpot_ms": {f"p{q}": 1e3 * percentile([r.tpot_s for r in ok], q) for q in (50, 90)},
           "samples": sampler.samples, "first_error": next((r.error for r in res if not r.ok), None),
           "decode_extra": [w.get("extra") for w in decode_workers(sampler.last)]}
    print(f"   capacity: running max {held['max']} median {held['median']} ({held['samples']} samples; rows taken "
          f"max {occupied['max']} median {occupied['median']}; decoding as the client sees it max {client['max']} "
          f"median {client['median']}), {len(res)} requests in {wall:.1f} s, "
          f"{toks:.1f} output tok/s, TTFT p50 {out['ttft_ms']['p50']:.0f} ms, TPOT p50 {out['tpot_ms']['p50']:.1f} ms, "
          f"errors {out['errors']}", flush=True)
    return out


async def multi_turn(url: str, model: str, a, vocab: int, per_token: int) -> dict:
    prompts = conversation(a.seed + 7, a.turns, vocab)
    if len(prompts[-1]) + a.turn_output > a.max_len:
        raise ValueError(f"the last turn's prompt ({len(prompts[-1])}) + {a.turn_output} passes --max-len {a.max_len}")
    c = await settled(url)
    pulls, got0 = extra_sum(c, "pulled", "decode"), extra_sum(c, "pulled_kv_bytes", "decode")
    pulled: list[int | None] = []
    errors = 0
    for k, p in enumerate(prompts):
        res, _ = await run_load(url, model, [RequestSpec(0.0, len(p), a.turn_output, "turn", p)], extra=EXTRA)
        errors += sum(1 for r in res if not r.ok)
        want = (pulls or 0) + k + 1
        c = await settled(url, ok=lambda c, want=want: (extra_sum(c, "pulled", "decode") or 0) >= want)
        got = extra_sum(c, "pulled_kv_bytes", "decode")
        pulled.append(None if got is None or got0 is None else got - got0)
        got0 = got
    rows = turn_rows(prompts, pulled, per_token)
    met = multi_turn_met(rows, per_token, a.block_size)
    print("   multi-turn: pulled / needed per turn " + ", ".join(f"{r['pulled_over_needed']:.1f}" for r in rows)
          + f"; errors {errors}", flush=True)
    return {"turns": rows, "errors": errors, "met": met}


async def prefix_hits(url: str, model: str, a, vocab: int) -> dict:
    rng = np.random.default_rng(a.seed + 11)
    system = rng.integers(3, vocab, a.system_len).tolist()
    prompts = [system + rng.integers(3, vocab, int(rng.integers(16, 33))).tolist() for _ in range(a.prefix_requests)]
    c0 = await settled(url)
    errors = 0
    for p in prompts:  # one after another: the first computes the system prompt, the rest hit it
        res, _ = await run_load(url, model, [RequestSpec(0.0, len(p), 8, "prefix", p)], extra=EXTRA)
        errors += sum(1 for r in res if not r.ok)
    c1 = await settled(url)

    def delta(key: str) -> int | None:
        # the prefill pods' prefix pools (a decode pod's heartbeat reports its KV pool's block
        # cache in the same shape: its hits are the pulls' reuse, counted by the multi-turn part)
        x0 = extra_sum(c0, key, role="prefill", sub="prefix_cache")
        x1 = extra_sum(c1, key, role="prefill", sub="prefix_cache")
        return None if x0 is None or x1 is None else x1 - x0

    copied, hit_tokens = delta("hit_copy_bytes"), delta("hits")
    hit_requests = len(prompts) - 1
    out = {"requests": len(prompts), "system_tokens": a.system_len, "hit_tokens": hit_tokens,
           "hit_copy_bytes": copied, "hit_requests": hit_requests, "errors": errors,
           "bytes_per_hit": copied / hit_requests if copied is not None and hit_requests else math.nan,
           "bytes_per_hit_token": copied / hit_tokens if copied is not None and hit_tokens else math.nan}
    print(f"   prefix hits: {hit_tokens} hit tokens, {copied} bytes copied "
          f"({out['bytes_per_hit']:.0f} per hit request); errors {errors}", flush=True)
    return out


def run_config(c: Config, a, vocab: int, per_token: int) -> dict:
    server = TandemLocal(c.name, a.model, colocated=False, slots=c.rows, max_len=a.max_len, pin="", env={},
                     log_path=a.out / f"{c.name}.log", extra_args=pod_args(a) + c.args,
                     ready_timeout=a.ready_timeout)
    t0 = time.monotonic()
    out: dict = {"args": c.args, "flags": flags(c, a), "rows": c.rows, "kv_positions": c.kv_positions,
                 "kv_bytes": c.kv_positions * per_token}
    try:
        server.start()
        out["ready_s"] = time.monotonic() - t0  # `tandem local` start to serving: the pods' warm-up
        print(f"   {c.name}: cluster ready in {out['ready_s']:.0f}s", flush=True)
        url = server.base_url
        model = model_id(url)

        async def all_parts() -> None:
            out["capacity"] = await capacity(url, model, a, vocab)
            out["multi_turn"] = await multi_turn(url, model, a, vocab, per_token)
            out["prefix"] = await prefix_hits(url, model, a, vocab)

        asyncio.run(all_parts())
    except Exception as e:  # noqa: BLE001 - one configuration failing still reports the other
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"   failed: {out['error']} | {server.tail(5)}", flush=True)
    finally:
        server.stop()
    out["seconds"] = time.monotonic() - t0
    return out


# ---------------------------------------------------------------------------------------------
# the report


def _f(x, spec: str = ".0f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def verdict(value, target: float | None = None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "not measured"
    if isinstance(value, bool):
        return "met" if value else "missed"
    return "met" if value >= target else "missed"


def summary(doc: dict) -> dict:
    """The ratios and the targets' verdicts."""
    res = doc["results"]
    cap = {n: r.get("capacity") for n, r in res.items() if "capacity" in r}
    s, p = cap.get("slots"), cap.get("paged")
    enough = bool(s and p) and min(s["held"]["samples"], p["held"]["samples"]) >= MIN_SAMPLES
    held = ratio(p["held"]["median"], s["held"]["median"]) if enough else math.nan
    held_max = ratio(p["held"]["max"], s["held"]["max"]) if enough else math.nan
    toks = ratio(p["output_tok_s"], s["output_tok_s"]) if s and p else math.nan
    client = (ratio(p["decoding_client_view"]["median"], s["decoding_client_view"]["median"])
              if s and p and "decoding_client_view" in s and "decoding_client_view" in p else math.nan)
    paged = res.get("paged", {})
    mt = (paged.get("multi_turn") or {}).get("met")
    px = paged.get("prefix") or {}
    hit_zero = None if px.get("hit_copy_bytes") is None or not px.get("hit_tokens") else px["hit_copy_bytes"] == 0
    return {"held_ratio_median": held, "held_ratio_max": held_max, "client_ratio_median": client, "tok_s_ratio": toks,
            "held_basis": "heartbeats" if not math.isnan(held) else "client view",
            "targets": {"concurrent sequences >= 3x": verdict(held if not math.isnan(held) else client, TARGET_HELD),
                        "output tok/s >= 1.5x": verdict(toks, TARGET_TOKS),
                        "multi-turn moves only the new turn's KV": verdict(mt),
                        "a prefix hit copies nothing": verdict(hit_zero)}}


def report(doc: dict) -> str:
    a, res, sm = doc["args"], doc["results"], doc["summary"]
    per_token = doc["kv_bytes_per_token"]
    rows = []
    for name, r in res.items():
        if r.get("skipped") or "error" in r:
            rows.append([name, "not run (below)" if r.get("skipped") else f"failed: {r['error']}"] + [None] * 12)
            continue
        c = r["capacity"]
        rows.append([name, r.get("flags", " ".join(r["args"])),
                     f"{r['kv_bytes'] / 2**20:.1f}", r["rows"], _f(r.get("ready_s"), ".0f"), _f(c["held"]["max"]), _f(c["held"]["median"], ".1f"),
                     f"{_f(c['occupied']['max'])} / {_f(c['occupied']['median'], '.1f')}",
                     f"{_f(c['decoding_client_view']['max'])} / {_f(c['decoding_client_view']['median'], '.1f')}",
                     _f(c["output_tok_s"], ".1f"), f"{_f(c['ttft_ms']['p50'])} / {_f(c['ttft_ms']['p90'])}",
                     f"{_f(c['tpot_ms']['p50'], '.1f')} / {_f(c['tpot_ms']['p90'], '.1f')}",
                     _f(c.get("ready_empty_fraction", math.nan) * 100, ".0f"), c["errors"]])
    rows.append(["paged / slots", None, None, None, None, _f(sm["held_ratio_max"], ".2f"), _f(sm["held_ratio_median"], ".2f"),
                 None, _f(sm["client_ratio_median"], ".2f"), _f(sm["tok_s_ratio"], ".2f"), None, None, None, None])
    turn_tables = []
    for name, r in res.items():
        mt = r.get("multi_turn")
        if not mt:
            continue
        trows = [[i + 1, t["prompt_tokens"], t["new_tokens"], t["needed_bytes"], t["pulled_bytes"],
                  t["whole_prompt_bytes"], _f(t["pulled_over_needed"], ".1f")] for i, t in enumerate(mt["turns"])]
        turn_tables += [f"\n**{name}** (errors {mt['errors']}):\n",
                        markdown_table(["turn", "prompt tokens", "new tokens", "bytes they need", "KV bytes pulled",
                                        "whole prompt's bytes", "pulled / needed"], trows)]
    prows = []
    for name, r in res.items():
        px = r.get("prefix")
        if px:
            prows.append([name, px["requests"], px["hit_tokens"], px["hit_copy_bytes"],
                          _f(px["bytes_per_hit"], ",.0f"), _f(px["bytes_per_hit_token"], ",.0f"), px["errors"]])
    cmd = " ".join(["python bench/kv_capacity.py", *doc["argv"]])
    lines = [
        "## KV capacity, throughput and KV bytes moved: fixed slots vs paged KV (issue 30)", "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine_line(doc['machine'])}  ",
        f"Code: {doc['code']}; client: {CLIENT_NAME}, at {doc.get('client', 'the normal policy')}  ",
        f"`tandem local --prefill {a.get('prefill_pods', 1)} --decode 1`, built-in model, max_len {a['max_len']}, KV "
        f"{per_token} bytes per position (layers x 2 x kv_heads x head_dim x 4 bytes float32). Same KV "
        f"memory on both sides: {a['slots']} slots x {a['max_len']} positions = {a['slots'] * a['max_len']} positions "
        f"= {paged_blocks(a['slots'], a['max_len'], a['block_size'])} blocks of {a['block_size']}.", "",
        f"Workload: {a['requests']} requests from {a['clients']} closed-loop clients (saturation), lengths from "
        f"`chat_pairs` (seed {a['seed']}): log-normal shaped like ShareGPT's (vLLM paper: mean prompt "
        f"{PROMPT_MEAN:.0f}, mean output {OUTPUT_MEAN:.0f} tokens at a {REF_CONTEXT} context; sigma "
        f"{PROMPT_SIGMA}/{OUTPUT_SIGMA}), scaled by {a['max_len']}/{REF_CONTEXT}, clipped to "
        f"{PROMPT_RANGE[0]}-{PROMPT_RANGE[1]} / {OUTPUT_RANGE[0]}-{OUTPUT_RANGE[1]} and prompt + output <= "
        f"{a['max_len']}: prompt mean {doc['workload']['prompt_mean']:.0f} (p50 {doc['workload']['prompt_p50']:.0f}, "
        f"p90 {doc['workload']['prompt_p90']:.0f}), output mean {doc['workload']['output_mean']:.0f} "
        f"(p50 {doc['workload']['output_p50']:.0f}, p90 {doc['workload']['output_p90']:.0f}). Greedy, `ignore_eos`. "
        "`held`: sequences the decode pod runs (heartbeat `requests.running`, /admin/cluster sampled every "
        "0.25 s, heartbeats every 1 s) over the steady part (15% of the last send .. the last send); `rows "
        "taken`: slots - free_slots (requests being pulled or waiting for their insert too); `decoding, client "
        "view`: requests between their second token and their last, every 50 ms of the window (no heartbeat "
        "lag); tok/s: tokens the client received in that window; `ready queue empty %`: of the samples in the "
        "window, those with no prefilled request waiting for the decode pod (high: the prefill side, not the "
        "decode pod's KV, limited the run; `--prefill-pods N` adds prefill pods); `ready s`: `tandem local` start "
        "to serving (the pods' warm-up compiles; JAX's persistent compilation cache shortens a repeat). Ratios: "
        "paged / slots.", "",
        markdown_table(["config", "tandem local flags", "KV MiB", "rows", "ready s", "held max", "held median",
                        "rows taken max / median", "decoding, client view, max / median", "output tok/s", "TTFT p50 / p90 ms", "TPOT p50 / p90 ms",
                        "ready queue empty %", "errors"], rows),
        "",
        f"Multi-turn: one conversation of {a['turns']} turns on the one decode pod (64-token system prompt; each "
        f"turn adds a synthetic 48-token assistant reply and a 24-48-token user message; {a['turn_output']} output "
        "tokens). `KV bytes pulled`: the decode pod's `pulled_kv_bytes` delta over the turn (the prefill "
        "bucket's padded KV); `bytes they need`: the tokens not in the previous turn's prompt x "
        f"{per_token}.",
        *turn_tables, "",
        f"Prefix hits: {a['prefix_requests']} requests one after another sharing a {a['system_len']}-token system "
        "prompt never sent before (8 output tokens): the bytes the pods' prefix caches copied for hits "
        "(`prefix_cache.hit_copy_bytes`: cached blocks assembled into the prompt's buffer, then host -> device), "
        "per request that hit (all but the first) and per hit token.", "",
        markdown_table(["config", "requests", "hit tokens", "bytes copied", "per hit request", "per hit token",
                        "errors"], prows),
        "",
        "Targets (paged side): " + "; ".join(f"{k}: **{v}**" for k, v in sm["targets"].items())
        + f" (sequences held compared by their medians in the {sm.get('held_basis', 'heartbeats')}"
        + ("; too few heartbeat samples in a window" if sm.get("held_basis") == "client view" else "") + ").",
    ]
    skipped = [f"{n}: {r['skipped']}" for n, r in res.items() if r.get("skipped")]
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(lines)


def workload_stats(pairs: list[tuple[int, int]]) -> dict:
    p = [x for x, _ in pairs]
    o = [y for _, y in pairs]
    return {"prompt_mean": float(np.mean(p)), "prompt_p50": percentile(p, 50), "prompt_p90": percentile(p, 90),
            "output_mean": float(np.mean(o)), "output_p50": percentile(o, 50), "output_p90": percentile(o, 90)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 slots, 25 requests per slot, 4 turns, 4 prefix requests")
    p.add_argument("--model", default="builtin")
    p.add_argument("--slots", type=int, default=8, help="the slots side's decode slots (S)")
    p.add_argument("--max-len", type=int, default=1024, help="positions per slot (M; the built-in model's context)")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block on the paged side (B)")
    p.add_argument("--paged-rows", type=int, default=0, help="the paged side's rows (default 4 S)")
    p.add_argument("--clients", type=int, default=0, help="closed-loop clients (default 5 S: past what either holds)")
    p.add_argument("--requests", type=int, default=0, help="capacity requests (default 50 S; --quick 25 S)")
    p.add_argument("--turns", type=int, default=0, help="multi-turn conversation turns (default 8; --quick 4)")
    p.add_argument("--turn-output", type=int, default=32)
    p.add_argument("--prefix-requests", type=int, default=0, help="default 8; --quick 4")
    p.add_argument("--system-len", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-pods", type=int, default=1, help="prefill pods on both sides (one decode pod)")
    p.add_argument("--configs", default="slots,paged")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="`tandem local --ready-timeout`: seconds each cluster may take to warm up")
    p.add_argument("--tandem-args", default="", metavar="ARGS",
                   help="the paged side's `tandem local` flags (default: --slots 4S "
                        "--kv-blocks S*ceil(M/B) --kv-block-size B)")
    p.add_argument("--no-write", action="store_true", help="print only: leave RESULTS.md and summary.json alone")
    p.add_argument("--out", type=Path, default=OUT, help="where kv_capacity.json and the clusters' logs go")
    add_client_policy(p)
    a = p.parse_args(argv)
    client = client_policy(a.normal_client)
    if a.quick and "--slots" not in argv:
        a.slots = 4
    a.paged_rows = a.paged_rows or 4 * a.slots
    a.clients = a.clients or 5 * a.slots
    a.requests = a.requests or (25 if a.quick else 50) * a.slots
    a.turns = a.turns or (4 if a.quick else 8)
    a.prefix_requests = a.prefix_requests or (4 if a.quick else 8)
    a.configs = [c for c in a.configs.split(",") if c]

    from tandem_core.models import resolve_model

    info = resolve_model(a.model)
    per_token = kv_bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, 4)
    t0 = time.perf_counter()
    doc: dict = {"args": vars(a), "argv": argv, "machine": machine_info(), "code": code_version(), "client": client,
                 "kv_bytes_per_token": per_token, "workload": workload_stats(chat_pairs(a.seed, a.requests, a.max_len)),
                 "results": {}}
    for c in configs(a):
        print(f"== {c.name}: {flags(c, a)}", flush=True)
        if c.skipped:
            print(f"   {c.skipped}", flush=True)
            doc["results"][c.name] = {"skipped": c.skipped, "args": c.args}
            continue
        doc["results"][c.name] = run_config(c, a, info.vocab_size, per_token)
        print(f"   ({doc['results'][c.name]['seconds']:.0f}s)", flush=True)
    doc["summary"] = summary(doc)
    doc["seconds"] = time.perf_counter() - t0
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "kv_capacity.json").write_text(json.dumps(doc, indent=1, default=str))
    md = report(doc)
    print(md, flush=True)
    if not a.no_write:
        write_section(SECTION, md)
        sm = doc["summary"]
        merge_summary({"kv_capacity_held_ratio": sm["held_ratio_median"], "kv_capacity_tok_s_ratio": sm["tok_s_ratio"]})
    return 0 if all("error" not in r for r in doc["results"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
