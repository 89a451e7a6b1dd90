"""bench/prefix.py's pure parts: the plan, Prometheus counter parsing, per-system summaries, the
targets of issue 14 and the RESULTS.md section. No sockets, no processes."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from bench.common import BENCH_DIR, fmt, machine_line, markdown_table
from bench.loadgen import CLIENT_NAME, RequestResult, pcts
from bench.peer_report import TOKENS_PER_EVENT_MAX, stream_stats

SECTION = "prefix"
OUT = BENCH_DIR / "out"
RAW = OUT / "prefix"
SYSTEMS = ("tandem-cache", "tandem-nocache", "vllm")
BUCKETS = (16, 32, 64, 128, 256, 512)
MAX_PROMPT = 512  # the largest prefill bucket: every prompt must stay below it
EXTRA = {"stream_options": {"include_usage": True}}
# (a decode pod's prefix reuse is its KV pool's block cache: kv_reuse)
NOCACHE_ENV = {"TANDEM_PREFILL_PREFIX_CACHE__ENABLED": "false", "TANDEM_DECODE_ENGINE__KV_REUSE": "false"}
HITS, QUERIES, COMPUTED = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "tandem_prefill_tokens_computed"
COUNTERS = (HITS, QUERIES, COMPUTED)


@dataclass
class Plan:
    model: str = "builtin"
    conversations: int = 32
    turns: int = 4
    system_len: int = 300
    user_len: tuple[int, int] = (20, 28)  # inclusive range of a user turn's length
    assistant_len: int = 24
    output_len: int = 24
    concurrency: int = 8
    max_len: int = 1024
    seed: int = 0
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))


# ---------------------------------------------------------------------------------------------
# Prometheus text (pure)

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_counters(text: str, names=COUNTERS) -> dict[str, float | None]:
    """{base name: value summed over label sets} of counters exposed as NAME or NAME_total (NAME_total
    wins when both are there; NAME_created is ignored); None when the counter is not exposed."""
    seen: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        seen.setdefault(m.group(1), {})
        seen[m.group(1)][m.group(2) or ""] = value
    out: dict[str, float | None] = {}
    for n in names:
        got = seen.get(n + "_total", seen.get(n))
        out[n] = sum(got.values()) if got is not None else None
    return out


def counter_delta(before: dict, after: dict) -> dict[str, float | None]:
    return {n: (after[n] - before[n]) if before.get(n) is not None and after.get(n) is not None else None
            for n in after}


# ---------------------------------------------------------------------------------------------
# summaries, ratios, report (pure)


def summarize_system(results: list[RequestResult], turns: list[int], wall_s: float, delta: dict,
                     kind: str) -> dict:
    """Latencies (all turns and per turn), prompt tokens sent, prefix-cache counters and health."""
    ok = [r for r in results if r.ok]
    ms = lambda xs: {k: v * 1e3 for k, v in pcts(xs, (50, 90)).items()}  # noqa: E731
    per_turn = {str(t): ms([r.ttft_s for r, k in zip(results, turns) if k == t and r.ok])
                for t in sorted(set(turns))}
    sent = sum(r.prompt_len for r in results)
    hits, queries, computed = delta.get(HITS), delta.get(QUERIES), delta.get(COMPUTED)
    if kind == "vllm" and computed is None and hits is not None:
        computed = sent - hits
    st = stream_stats(results)
    reasons = [f"{len(results) - len(ok)} requests failed"] if len(ok) < len(results) else []
    if st["usage_missing"]:
        reasons.append(f"{st['usage_missing']} streams had no usage chunk")
    elif st["tokens_per_event"] is None or not 1 - 1e-9 <= st["tokens_per_event"] <= TOKENS_PER_EVENT_MAX:
        tpe = "-" if st["tokens_per_event"] is None else f"{st['tokens_per_event']:.4f}"
        reasons.append(f"{tpe} tokens per SSE event (want <= {TOKENS_PER_EVENT_MAX:g})")
    return {"status": "ok", "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall_s,
            "ttft_ms": ms([r.ttft_s for r in ok]), "ttft_ms_by_turn": per_turn,
            "e2e_ms": ms([r.e2e_s for r in ok]), "prompt_tokens": sent, "counters": delta,
            "hits": hits, "queries": queries, "prefill_computed": computed,
            "hit_rate": hits / sent if hits is not None and sent else None,
            "hits_per_query": hits / queries if hits is not None and queries else None,
            "health": {"healthy": not reasons, "reasons": reasons, "tokens_per_event": st["tokens_per_event"],
                       "short_streams": st["short_streams"]}}


def _p50(s: dict | None):
    return ((s or {}).get("ttft_ms") or {}).get("p50") if (s or {}).get("status") == "ok" else None


def _blocker(s: dict | None, name: str) -> str:
    if not s or s.get("status") != "ok":
        return f"{name} {(s or {}).get('status', 'not run')}"
    h = s.get("health") or {}
    return "" if h.get("healthy") else f"{name} unhealthy: {'; '.join(h.get('reasons', []))}"


def ratio_rows(systems: dict) -> list[dict]:
    """The three targets of issue 14, each with its value, target, verdict and (when "-") why."""
    c, n, v = (systems.get(k) for k in SYSTEMS)

    def row(name, a, b, target, higher, blockers):
        why = "; ".join(x for x in blockers if x)
        ok = not why and isinstance(a, (int, float)) and isinstance(b, (int, float)) and b and not (
            math.isnan(a) or math.isnan(b))
        x = a / b if ok else None
        verdict = "-" if x is None else ("met" if (x >= target if higher else x <= target) else "missed")
        return {"ratio": name, "value": x, "target": ("≥ " if higher else "≤ ") + fmt(target), "verdict": verdict,
                "why": why or ("" if x is not None else "n/a (not measured)")}

    hit = (c or {}).get("hits") if (c or {}).get("status") == "ok" else None
    return [
        row("TTFT p50 tandem-cache / tandem-nocache", _p50(c), _p50(n), 0.5, False,
            [_blocker(c, "tandem-cache"), _blocker(n, "tandem-nocache")]),
        row("tandem-cache hit rate (hits / prompt tokens)", hit, (c or {}).get("prompt_tokens"), 0.7, True,
            [_blocker(c, "tandem-cache")]),
        row("TTFT p50 tandem-cache / vllm", _p50(c), _p50(v), 1.0, False,
            [_blocker(c, "tandem-cache"), _blocker(v, "vllm")]),
    ]


def _na(x, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x * 100:.1f}%" if pct else fmt(x)


def system_table(systems: dict, order: list[str], turns: int) -> str:
    heads = ["system", "health", "TTFT p50 ms", "TTFT p90 ms"] + [f"turn {t} p50/p90 ms" for t in
                                                                  range(1, turns + 1)]
    heads += ["E2E p50 ms", "prompt tok", "cache hits", "hit rate", "hits/queries", "prefill computed"]
    rows = []
    for name in order:
        s = systems.get(name) or {}
        if s.get("status") != "ok":
            rows.append([name, f"{s.get('status', 'not run')}: {s.get('reason', '')}"[:80]] + ["-"] * (len(heads) - 2))
            continue
        by = s["ttft_ms_by_turn"]
        rows.append([name, "ok" if s["health"]["healthy"] else "UNHEALTHY", s["ttft_ms"]["p50"], s["ttft_ms"]["p90"]]
                    + [f"{fmt(by[str(t)]['p50'])} / {fmt(by[str(t)]['p90'])}" if str(t) in by else "-"
                       for t in range(1, turns + 1)]
                    + [s["e2e_ms"]["p50"], s["prompt_tokens"], _na(s["hits"]), _na(s["hit_rate"], True),
                       _na(s["hits_per_query"], True), _na(s["prefill_computed"])])
    return markdown_table(heads, rows)


def _missing(systems: dict, order: list[str]) -> list[str]:
    gone = [n for n in order if (systems[n].get("status") == "ok" and systems[n].get("hits") is None)]
    return [f"Not exposed on `/metrics` (so n/a): the prefix-cache counters of {', '.join(gone)}.", ""] if gone else []


def report(doc: dict) -> str:
    plan, systems = Plan(**doc["plan"]), doc["systems"]
    order = [n for n in SYSTEMS if n in systems]
    ratios = ratio_rows(systems)
    health = []
    for n in order:
        h = systems[n].get("health") or {}
        health.append(f"- {n}: " + ("healthy" if h.get("healthy") else
                                    "; ".join(h.get("reasons") or [str(systems[n].get("reason", ""))]))
                      + (f" ({h['tokens_per_event']:.4f} tokens per SSE event; {h['short_streams']} streams had "
                         "merged events)" if h.get("healthy") else ""))
    return "\n".join([
        "## Prefix caching (bench/prefix.py)", "",
        f"Command: `{' '.join(['python bench/prefix.py', *doc['argv']])}` ({doc['seconds']:.0f} s). "
        f"Machine: {machine_line(doc['machine'])}. Code: {doc.get('code') or '-'}.",
        f"Model `{plan.model}`. {plan.conversations} conversations x {plan.turns} turns, {plan.concurrency} "
        f"conversations at once (each a sequential chain); a shared {plan.system_len}-token system prompt, user "
        f"turns {plan.user_len[0]}-{plan.user_len[1]} tokens, synthetic assistant turns {plan.assistant_len} tokens "
        f"(the same prompt ids for every system), {plan.output_len} output tokens (greedy, ignore_eos); max len "
        f"{plan.max_len}; longest prompt {doc.get('longest_prompt', '-')} tokens. Client: {CLIENT_NAME}. No CPU "
        "pinning. tandem-cache: `tandem local --prefill 1 --decode 1` (prefix cache on); tandem-nocache: the same "
        "with `TANDEM_PREFILL_PREFIX_CACHE__ENABLED=false TANDEM_DECODE_ENGINE__KV_REUSE=false`; vllm: vLLM "
        f"CPU with `--enable-prefix-caching` (its log: {doc.get('vllm_prefix_caching') or 'not run'}).",
        "Warm-up (excluded): one request per prefill bucket, then conversations with another system prompt. "
        "Counters: delta of `/metrics` over the measured run; hit rate = hits / prompt tokens sent; "
        "`n/a` = the server does not expose the counter. vLLM's prefill computed = prompt tokens - hits.", "",
        system_table(systems, order, plan.turns), "", *_missing(systems, order),
        f"Health (no failed request, usage tokens / SSE token events <= {TOKENS_PER_EVENT_MAX:g}, as bench/peer.py):",
        "", *health, "",
        "Targets of issue 14:", "",
        markdown_table(["ratio", "value", "target", "verdict", "why"],
                       [[r["ratio"], r["value"], r["target"], r["verdict"], r["why"]] for r in ratios]),
    ])
