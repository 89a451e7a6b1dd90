"""Cache-aware routing to decode pods (issue 30): KV moved per conversation turn with two paged
decode pods, the gateway steering each turn to the pod that decoded the last one, against the
same cluster with steering off, back to back in one run.

    python bench/decode_affinity.py [--quick] [--no-write] [--conversations C] [--turns T]

Both sides: `tandem local --prefill 1 --decode 2 --slots R --max-len M` (the
built-in model), block reuse on (the default); "off" sets TANDEM_GATEWAY_DECODE_ROUTING=false on
the gateway, so any decode pod claims any ready notice (the shared stream), as before this change.
C conversations (bench/kv_capacity.py's `conversation`: a system prompt, then per turn a synthetic
reply and a new user message; every conversation its own system prompt), run in rounds: round k
sends turn k of every conversation at once (streaming, greedy, `ignore_eos`), then waits for the
pods' heartbeats to settle. Per round: the KV bytes the decode pods pulled (their heartbeats'
`pulled_kv_bytes`, summed) over what the round's new tokens need (tokens not in the previous turn's
prompt x per-token KV bytes), the prompt positions the pods held already (`kv_reuse.reused_tokens`),
and the client's gap between a turn's first and second token (the pull and insert are in it: the
prefill pod streams the first token itself). The gateway's `tandem_decode_route_total` by reason
says how each turn was routed. Writes bench/out/decode_affinity.json and, unless --no-write, the
`decode_affinity` section of bench/RESULTS.md. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import code_version, machine_line, markdown_table, merge_summary, write_section
from bench.kv_capacity import EXTRA, conversation, extra_sum, kv_bytes_per_token, new_tokens, settled
from bench.loadgen import RequestSpec, percentile, run_load
from bench.systems import ROOT, TandemLocal, model_id

OUT = ROOT / "bench" / "out" / "decode_affinity"
SECTION = "decode_affinity"
SIDES = (("on", {}), ("off", {"TANDEM_GATEWAY_DECODE_ROUTING": "false"}))


def routes(base_url: str) -> dict[str, float]:
    """The gateway's decode routing decisions so far, by reason."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^tandem_decode_route_total\{reason="([a-z_]+)"\} ([0-9.e+]+)$', text, re.M)}


async def rounds(url: str, model: str, a, per_token: int, vocab: int) -> dict:
    convs = [conversation(a.seed + 31 * i, a.turns, vocab) for i in range(a.conversations)]
    c = await settled(url)
    pulled0, reused0 = extra_sum(c, "pulled_kv_bytes", "decode") or 0, extra_sum(c, "reused_tokens", "decode", "kv_reuse") or 0
    pulls = extra_sum(c, "pulled", "decode") or 0
    r0 = routes(url)
    out = []
    for k in range(a.turns):
        specs = [RequestSpec(0.0, len(p[k]), a.turn_output, "turn", p[k]) for p in convs]
        res, wall = await run_load(url, model, specs, concurrency=len(specs), extra=EXTRA, timeout_s=600)
        pulls += len(specs)
        c = await settled(url, ok=lambda c, want=pulls: (extra_sum(c, "pulled", "decode") or 0) >= want)
        pulled = extra_sum(c, "pulled_kv_bytes", "decode") or 0
        reused = extra_sum(c, "reused_tokens", "decode", "kv_reuse") or 0
        need = sum(new_tokens(p)[k] for p in convs) * per_token
        gaps = [r.token_s[1] - r.token_s[0] for r in res if r.ok and len(r.token_s) > 1]
        row = {"turn": k + 1, "prompt_tokens": sum(len(p[k]) for p in convs), "needed_bytes": need,
               "pulled_bytes": pulled - pulled0, "pulled_over_needed": (pulled - pulled0) / need if need else math.nan,
               "reused_tokens": reused - reused0, "errors": sum(1 for r in res if not r.ok), "wall_s": wall,
               "second_token_gap_ms": {f"p{q}": 1e3 * percentile(gaps, q) for q in (50, 90)} if gaps else {}}
        print(f"   turn {k + 1}: pulled/needed {row['pulled_over_needed']:.2f}, reused {row['reused_tokens']} positions, "
              f"2nd-token gap p50 {row['second_token_gap_ms'].get('p50', math.nan):.1f} ms, errors {row['errors']}",
              flush=True)
        out.append(row)
        pulled0, reused0 = pulled, reused
    r1 = routes(url)
    later = out[1:]
    total_need = sum(r["needed_bytes"] for r in later)
    gaps_p50 = [r["second_token_gap_ms"].get("p50", math.nan) for r in later]
    return {"rounds": out, "routes": {k: r1.get(k, 0) - r0.get(k, 0) for k in r1},
            "later_pulled_over_needed": sum(r["pulled_bytes"] for r in later) / total_need if total_need else math.nan,
            "later_reused_tokens": sum(r["reused_tokens"] for r in later),
            "later_prompt_tokens": sum(r["prompt_tokens"] for r in later),
            "later_gap_p50_ms_median": sorted(gaps_p50)[len(gaps_p50) // 2] if gaps_p50 else math.nan,
            "errors": sum(r["errors"] for r in out)}


def run_side(name: str, env: dict[str, str], a, per_token: int, vocab: int) -> dict:
    args = ["--decode", "2"]
    server = TandemLocal(name, a.model, colocated=False, slots=a.slots, max_len=a.max_len, pin="", env=env,
                     log_path=a.out / f"{name}.log", extra_args=args, ready_timeout=a.ready_timeout)
    t0 = time.monotonic()
    try:
        server.start()
        print(f"   steering {name}: cluster ready in {time.monotonic() - t0:.0f}s", flush=True)
        url = server.base_url
        return {"env": env, "args": args, **asyncio.run(rounds(url, model_id(url), a, per_token, vocab))}
    except Exception as e:  # noqa: BLE001 - one side failing still reports the other
        print(f"   steering {name} failed: {type(e).__name__}: {e}", flush=True)
        return {"env": env, "args": args, "error": f"{type(e).__name__}: {e}"}
    finally:
        server.stop()


def report(doc: dict) -> str:
    a = doc["plan"]
    lines = [f"Command: `{doc['command']}`. {doc['machine']}. Code {doc['code']}.", "",
             f"`tandem local --prefill 1 --decode 2 --slots {a['slots']} --max-len {a['max_len']}`, "
             f"the built-in model; {a['conversations']} conversations x {a['turns']} turns, each round one turn of every "
             f"conversation at once, {a['turn_output']} output tokens a turn. \"off\": the same cluster with "
             "TANDEM_GATEWAY_DECODE_ROUTING=false (any decode pod claims any ready notice). Turns after the first:", ""]
    rows = []
    for name, _env in SIDES:
        s = doc["sides"].get(name, {})
        if "error" in s:
            rows.append([name, s["error"], "", "", "", ""])
            continue
        rows.append([name, f"{s['later_pulled_over_needed']:.2f}",
                     f"{s['later_reused_tokens']} / {s['later_prompt_tokens']}",
                     f"{s['later_gap_p50_ms_median']:.1f}",
                     ", ".join(f"{k} {v:.0f}" for k, v in sorted(s["routes"].items()) if v), str(s["errors"])])
    lines.append(markdown_table(["steering", "KV pulled / new tokens' KV", "prompt positions held / sent",
                                 "2nd-token gap p50 (ms, median of rounds)", "gateway decode routes", "errors"], rows))
    lines += ["", "KV pulled over what each round's new tokens need, per round (round 1: whole prompts):", ""]
    per = []
    for name, _env in SIDES:
        s = doc["sides"].get(name, {})
        if "rounds" in s:
            per.append([name] + [f"{r['pulled_over_needed']:.2f}" for r in s["rounds"]])
    if per:
        lines.append(markdown_table(["steering"] + [f"turn {i + 1}" for i in range(len(per[0]) - 1)], per))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 conversations x 4 turns")
    p.add_argument("--model", default="builtin")
    p.add_argument("--slots", type=int, default=8, help="rows of each decode pod")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--conversations", type=int, default=0, help="default 8; --quick 4")
    p.add_argument("--turns", type=int, default=0, help="default 6; --quick 4")
    p.add_argument("--turn-output", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    a.conversations = a.conversations or (4 if a.quick else 8)
    a.turns = a.turns or (4 if a.quick else 6)
    from tandem_core.models import resolve_model

    info = resolve_model(a.model)
    per_token = kv_bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, 4)  # float32 KV on CPU
    vocab = info.vocab_size
    a.out.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python bench/decode_affinity.py" + (" --quick" if a.quick else ""), "machine": machine_line(),
           "code": code_version(), "plan": {k: getattr(a, k) for k in ("slots", "max_len", "conversations", "turns",
                                                                        "turn_output")},
           "per_token_bytes": per_token, "sides": {}}
    for name, env in SIDES:
        doc["sides"][name] = run_side(name, env, a, per_token, vocab)
    (a.out.parent / "decode_affinity.json").write_text(json.dumps(doc, indent=2, default=str))
    text = report(doc)
    print(text)
    if not a.no_write:
        write_section(SECTION, text)
        on, off = doc["sides"].get("on", {}), doc["sides"].get("off", {})
        merge_summary({"decode_affinity_pulled_over_needed_on": on.get("later_pulled_over_needed"),
                       "decode_affinity_pulled_over_needed_off": off.get("later_pulled_over_needed")})
    return 0 if all("error" not in s for s in doc["sides"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
