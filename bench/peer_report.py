"""The pure half of bench/peer.py: the `--pin` layout, stream statistics, the peer health verdict,
the ratios against the targets of issue 11, the tables and the markdown section. Functions of
recorded values only (no sockets, no clocks, no /proc), unit-tested in tests/unit/test_bench_peer.py.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from bench.common import fmt, markdown_table
from bench.loadgen import RequestResult

HEALTH_FACTOR = 2.0  # c=1 TTFT / TPOT p50 within this factor of the system's best single request
BACK_TO_BACK_S = 0.0002  # two token events closer than this arrived as one burst
# Tokens per SSE event allowed at any level. A server whose API process falls behind its engine
# merges queued steps into one event (vLLM's output collector does); a rare merge (a descheduled
# process on a shared machine) leaves throughput and TTFT meaningful, streaming in bundles does not.
TOKENS_PER_EVENT_MAX = 1.05
# Throughput across the concurrency levels. A server that batches gains from 8 streams over 1 (the
# healthy runs here: vLLM 3.7-4.9x, Tandem 2.4-3.3x); one that gains less than BATCH_GAIN_MIN is
# starved or not batching, and one whose tokens/s fall by more than SCALING_FLOOR as concurrency
# rises is starved (a whole run of a server can be slow at every level, which the c=1 checks
# against its own best single request cannot see).
BATCH_GAIN_MIN = 1.5
SCALING_FLOOR = 0.9


# ---------------------------------------------------------------------------------------------
# --pin LAYOUT


def parse_cpus(text: str) -> list[int]:
    """`0`, `0-1`, `0+2`, `0-1+3` -> sorted CPU ids ('+' joins parts; ',' separates layout items)."""
    got: set[int] = set()
    for part in filter(None, text.split("+")):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r}")
        got |= set(range(a, b + 1))
    if not got:
        raise ValueError(f"no CPUs in {text!r}")
    return sorted(got)


def parse_pin(spec: str) -> dict[str, list[int]]:
    """`--pin server=CPUS[,client=CPUS]` -> {"server": [...], "client": [...]}; "" or "none" -> {}.
    `server` is required: every system's whole process tree runs on it."""
    if spec.strip().lower() in ("", "none"):
        return {}
    out: dict[str, list[int]] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, _, cpus = item.partition("=")
        if key not in ("server", "client") or not cpus:
            raise ValueError(f"--pin: bad item {item!r} (want server=CPUS[,client=CPUS], CPUS like 0, 0-1, 0+2)")
        out[key] = parse_cpus(cpus)
    if "server" not in out:
        raise ValueError("--pin: `server=CPUS` is required (pinning only the client would pin the servers "
                         "started from it too)")
    return out


def cpu_list(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (taskset -c and VLLM_CPU_OMP_THREADS_BIND syntax)."""
    parts, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


# ---------------------------------------------------------------------------------------------
# streams and health


def stream_stats(results: Sequence[RequestResult]) -> dict:
    """How tokens arrived: token events, usage-reported tokens, tokens per event, requests whose
    event count differs from the asked length, and the share of back-to-back gaps (< 0.2 ms)."""
    ok = [r for r in results if r.ok]
    events = sum(r.tokens_out for r in ok)
    known = [r for r in ok if r.usage_tokens is not None]
    usage = sum(r.usage_tokens for r in known) if known else None
    counted = sum(r.tokens_out for r in known)
    gaps = [g for r in ok for g in r.itl_s]
    return {
        "events": events,
        "usage_tokens": usage,
        "tokens_per_event": (usage / counted) if known and counted else None,
        "usage_missing": len(ok) - len(known),
        "short_streams": sum(1 for r in ok if r.tokens_out != r.output_len),
        "reads": sum(r.reads for r in ok),
        "back_to_back_gaps": (sum(1 for g in gaps if g < BACK_TO_BACK_S) / len(gaps)) if gaps else None,
    }


def best_single(results: Sequence[RequestResult]) -> dict:
    """The best TTFT and TPOT of single requests sent one at a time: the lowest TTFT, and the
    lowest (E2E - best TTFT) / (tokens - 1). TPOT is taken from E2E, not from the request's own
    TTFT, so a request whose tokens were held back and arrived in one burst (TTFT ~ E2E, its own
    TPOT ~ 0) cannot pass for the best decode rate."""
    ok = [r for r in results if r.ok and r.tokens_out > 1]
    if not ok:
        return {}
    ttft = min(r.ttft_s for r in ok)
    tpot = min((r.e2e_s - ttft) / (r.tokens_out - 1) for r in ok)
    return {"ttft_s": ttft, "tpot_s": tpot, "n": len(ok)}


CLIENT_STARVED = 0.5  # a client whose run queue wait is this share of the c=1 TTFT p50 was starved


def health(best: Mapping, c1: Mapping | None, streams: Mapping[str, Mapping],
           factor: float = HEALTH_FACTOR, tokens_per_s: Mapping[str, float] | None = None,
           client_wait_ms: float | None = None) -> dict:
    """Is the system serving as its authors intend? c1: the c=1 level's summary; streams: each
    level's stream_stats; tokens_per_s: each level's output tokens/s; client_wait_ms: how long the
    client process itself waited on the run queue per c=1 request (loadgen.runqueue_wait_ms; None:
    unknown). Healthy when its c=1 TTFT
    p50 and TPOT p50 are within `factor` of its own best single request, no request failed, tokens
    came one per SSE event (usage completion_tokens / events <= TOKENS_PER_EVENT_MAX at every
    level; the exact count is reported), and its throughput scales (`scaling_reasons`). Returns
    {"healthy", "reasons", "checks"}."""
    reasons: list[str] = []
    checks: dict = {}
    if not best:
        return {"healthy": False, "reasons": ["no successful single request"], "checks": checks}
    if not c1:
        return {"healthy": False, "reasons": ["no c=1 run"], "checks": checks}
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        got, ref = (c1.get(key) or {}).get("p50", math.nan), best[key]
        x = got / ref if ref and ref > 0 and not math.isnan(got) else math.nan
        checks[f"c1_{key}_p50_over_best"] = x
        if not x <= factor:  # NaN fails too
            reasons.append(f"c=1 {label} p50 {_ms(got)} is {fmt(x)}x its best single request "
                           f"({_ms(ref)}; limit {factor:g}x)")
    for level, st in streams.items():
        tpe = st.get("tokens_per_event")
        checks[f"c{level}_tokens_per_event"] = tpe
        if st.get("usage_missing"):
            reasons.append(f"c={level}: {st['usage_missing']} streams had no usage chunk (tokens per event unknown)")
        elif tpe is None or not 1.0 - 1e-9 <= tpe <= TOKENS_PER_EVENT_MAX:
            reasons.append(f"c={level}: {tpe_text(tpe)} tokens per SSE event (want 1, at most "
                           f"{TOKENS_PER_EVENT_MAX:g}; {st.get('short_streams')} streams had fewer events than tokens)")
    if c1.get("errors"):
        reasons.append(f"c=1: {c1['errors']} requests failed")
    checks["c1_client_wait_ms_per_req"] = client_wait_ms
    ttft = (c1.get("ttft_s") or {}).get("p50", math.nan) * 1e3
    if reasons and client_wait_ms is not None and client_wait_ms >= CLIENT_STARVED * ttft:
        reasons.append(f"the client itself waited {client_wait_ms:.0f} ms a c=1 request runnable but not run "
                       f"(/proc/self/schedstat), against a TTFT p50 of {ttft:.0f} ms: the machine starved the "
                       f"client, so the c=1 checks above say little about the server")
    reasons += scaling_reasons(tokens_per_s or {}, checks)
    return {"healthy": not reasons, "reasons": reasons, "checks": checks}


def scaling_reasons(tokens_per_s: Mapping[str, float], checks: dict) -> list[str]:
    """Why the throughput across levels says the server is starved or not batching (see
    BATCH_GAIN_MIN and SCALING_FLOOR); records the ratios in `checks`."""
    out: list[str] = []
    tps = {int(c): v for c, v in tokens_per_s.items() if v and not math.isnan(v)}
    if 1 in tps and 8 in tps:
        gain = checks["c8_over_c1_tokens_per_s"] = tps[8] / tps[1]
        if gain < BATCH_GAIN_MIN:
            out.append(f"c=8 gives {fmt(gain)}x the tokens/s of c=1 (a batching server gains at least "
                       f"{BATCH_GAIN_MIN:g}x: starved or not batching)")
    levels = sorted(tps)
    for lo, hi in zip(levels, levels[1:]):
        ratio = checks[f"c{hi}_over_c{lo}_tokens_per_s"] = tps[hi] / tps[lo]
        if ratio < SCALING_FLOOR:
            out.append(f"c={hi} gives {fmt(ratio)}x the tokens/s of c={lo} (throughput fell as "
                       f"concurrency rose: starved)")
    return out


def tpe_text(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _ms(s: float) -> str:
    return "-" if s is None or math.isnan(s) else f"{s * 1e3:.3g} ms"


# ---------------------------------------------------------------------------------------------
# ratios and targets


def _get(doc: Mapping, *path):
    for k in path:
        if not isinstance(doc, Mapping) or k not in doc:
            return None
        doc = doc[k]
    return doc


def _ratio(a, b):
    ok = all(isinstance(v, (int, float)) and not math.isnan(v) for v in (a, b)) and b
    return a / b if ok else None


def _verdict(x, target: float, higher: bool, moonshot: float | None = None) -> str:
    if x is None:
        return "-"
    if moonshot is not None and higher and x >= moonshot:
        return "met (moonshot too)"
    return "met" if (x >= target if higher else x <= target) else "missed"


def ratio_rows(systems: Mapping[str, Mapping], levels: Sequence[int]) -> list[dict]:
    """Every ratio of issue 11 with its target and verdict. Ratios against vLLM are withheld
    (value None, verdict "-", `why` says why) unless vLLM ran and passed its health check."""
    v = systems.get("vllm", {})
    why_v = _peer_blocker(v)
    rows = []

    def add(name, a, b, target, higher, moonshot=None, blocker=""):
        ours = name.split(" ", 1)[0]
        blocker = _blocker(systems.get(ours, {}), ours) or blocker
        x = None if blocker else _ratio(a, b)
        why = blocker or ("" if x is not None else "not measured")
        rows.append({"ratio": name, "value": x, "target": ("≥ " if higher else "≤ ") + fmt(target)
                     + (f" (moonshot {fmt(moonshot)})" if moonshot else ""),
                     "verdict": _verdict(x, target, higher, moonshot), "why": why})

    for t in ("disagg", "colocated"):
        for c in [c for c in levels if c >= 8]:
            add(f"{t} / vLLM out tok/s, c={c}", _get(systems, t, "levels", str(c), "output_tokens_per_s"),
                _get(v, "levels", str(c), "output_tokens_per_s"), 1.0, True, 1.5, why_v)
    for t in ("disagg", "colocated"):
        for c in levels:
            add(f"{t} / vLLM CPU per output token, c={c}", _get(systems, t, "levels", str(c), "cpu_ms_per_1k", "total"),
                _get(v, "levels", str(c), "cpu_ms_per_1k", "total"), 1.0, False, None, why_v)
    if 8 in levels:
        for t in ("disagg", "colocated"):
            add(f"{t} / vLLM TTFT p50, c=8", _get(systems, t, "levels", "8", "ttft_s", "p50"),
                _get(v, "levels", "8", "ttft_s", "p50"), 1.0, False, None, why_v)
    top = str(max(levels))
    bare = systems.get("bare", {})
    add(f"disagg / bare engine out tok/s, c={top}", _get(systems, "disagg", "levels", top, "output_tokens_per_s"),
        _get(bare, "output_tokens_per_s"), 0.85, True, None, _blocker(bare, "bare engine"))
    return rows


def _blocker(doc: Mapping, name: str) -> str:
    if not doc:
        return f"{name} was not run"
    if doc.get("status") != "ok":
        return f"{name} {doc.get('status')}: {doc.get('reason', '')}"[:200]
    return ""


def _peer_blocker(v: Mapping) -> str:
    b = _blocker(v, "vLLM")
    if b:
        return b
    h = v.get("health") or {}
    if not h.get("healthy"):
        return "vLLM unhealthy: " + "; ".join(h.get("reasons") or ["no health check"])
    return ""


def summary_keys(systems: Mapping[str, Mapping], rows: Sequence[Mapping]) -> dict:
    """Keys for bench/out/summary.json: every ratio (None when withheld), vLLM's health."""
    def key(name: str) -> str:
        s = name.lower().replace(" / ", "_over_").replace(",", "")
        return "peer_" + "_".join(s.replace("=", "").replace("/", "_").split())

    out = {key(r["ratio"]): r["value"] for r in rows}
    h = (systems.get("vllm") or {}).get("health") or {}
    out["peer_vllm_healthy"] = h.get("healthy") if h else None
    why = "; ".join(h.get("reasons") or []) or _blocker(systems.get("vllm", {}), "vLLM")
    out["peer_vllm_health_reason"] = why or None
    return out


# ---------------------------------------------------------------------------------------------
# tables


def _ms_of(level: Mapping, key: str, p: str = "p50"):
    x = _get(level, key, p)
    return x * 1e3 if isinstance(x, (int, float)) else None


def level_table(systems: Mapping[str, Mapping], order: Sequence[str], levels: Sequence[int]) -> str:
    rows = []
    for name in order:
        s = systems.get(name, {})
        if name == "bare":
            rows.append([name, max(levels), s.get("output_tokens_per_s")] + [None] * 7)
            continue
        for c in levels:
            lv = _get(s, "levels", str(c)) or {}
            st = lv.get("stream") or {}
            b2b = st.get("back_to_back_gaps")
            rows.append([name, c, lv.get("output_tokens_per_s"), _ms_of(lv, "ttft_s"), _ms_of(lv, "itl_s"),
                         _ms_of(lv, "itl_s", "p99"), _ms_of(lv, "tpot_s"), tpe_text(st.get("tokens_per_event")) if st else None,
                         b2b * 100 if b2b is not None else None, _get(lv, "cpu_ms_per_1k", "total")])
    return markdown_table(["system", "c", "out tok/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms", "TPOT p50 ms",
                           "tok/event", "b2b gaps %", "CPU ms/1k tok"], rows)


def cpu_table(systems: Mapping[str, Mapping], order: Sequence[str], levels: Sequence[int]) -> str:
    rows = []
    for name in order:
        for c in levels:
            lv = _get(systems, name, "levels", str(c)) or {}
            per = lv.get("cpu_ms_per_1k") or {}
            if per:
                rows.append([name, c, ", ".join(f"{r} {fmt(v)}" for r, v in per.items() if r != "total"),
                             per.get("total"), lv.get("client_ms_per_1k")])
    return markdown_table(["system", "c", "CPU ms per 1,000 output tokens, by role", "total", "client (apart)"],
                          rows)


def health_table(systems: Mapping[str, Mapping], order: Sequence[str]) -> str:
    rows = []
    for name in order:
        s = systems.get(name, {})
        if name == "bare":
            continue
        h = s.get("health") or {}
        best = s.get("best_single") or {}
        verdict = ("healthy" if h.get("healthy") else "UNHEALTHY") if h else s.get("status", "-")
        ck = h.get("checks") or {}
        tpe = [v for k, v in ck.items() if k.endswith("_tokens_per_event") and v is not None]
        rows.append([name, verdict, _ms(best.get("ttft_s", math.nan)) if best else "-",
                     _ms(best.get("tpot_s", math.nan)) if best else "-", ck.get("c1_ttft_s_p50_over_best"),
                     ck.get("c1_tpot_s_p50_over_best"), tpe_text(max(tpe)) if tpe else "-", s.get("goodput_rps"),
                     " → ".join(fmt(x) for x in s.get("load_1m") or []) or "-",
                     "; ".join(h.get("reasons") or []) or s.get("reason", "") or "-"])
    return markdown_table(["system", "health", "best single TTFT", "best single TPOT", "c=1 TTFT / best",
                           "c=1 TPOT / best", "max tok/event", "goodput req/s", "load 1m", "why"], rows)


def ratio_table(rows: Sequence[Mapping]) -> str:
    return markdown_table(["ratio", "value", "target", "verdict", "why not measured"],
                          [[r["ratio"], r["value"], r["target"], r["verdict"], r["why"] or ""] for r in rows])
