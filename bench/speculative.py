"""Speculative decoding on and off, back to back, on the whole system as a user runs it
(`tandem local`, a real HTTP client; issue 45).

    python bench/speculative.py [--quick] [--no-write] [--paths colocated,disagg] [--concurrency 1,8,32]
                                [--k 4] [--rounds N] [--method ngram|draft] [--draft-model builtin-draft]
                                [--grammar] [--greedy-draft]

Two workloads of the built-in model, `--requests` requests each (128 output tokens, ignore_eos):
  * repeat: a document to quote from. The built-in model (3.95M parameters) does not learn to
    copy: a prompt holding a function twice, then its first line again, gave 1.3 tokens per
    verify call in a probe (its output wanders off). So each prompt is built so that the model's
    own text is in it: P (the opening ~300 tokens of a function from this Python's standard
    library), G (the model's greedy continuation of P, 160 tokens), two newlines, P again; the
    request then continues P again, greedy. What a model that copies does when it rewrites a
    document is in this prompt as the model's own text. (The model's context differs the second
    time, so it does not reproduce G token for token: the acceptance below is measured, not set.)
  * open: open generation: the opening of other functions, sampled at temperature 0.8 (seeded),
    nothing in the prompt to copy from but what the n-gram lookup finds by chance.
The prompts are built once in a child process with the engine (`--build`) into
bench/out/speculative/workload.json. For each path (colocated: one worker; disagg: a prefill and
a decode pod) and each round, speculation off and on (`--speculative ngram --speculative-k K`;
with `--method draft`, `--speculative draft --draft-model M`: the built-in model's distilled
one-layer draft by default; it samples at a sampled request's parameters, and with `--greedy-draft`
proposes its argmax instead)
run one after the other, each on a fresh cluster warmed with both workloads; then each
concurrency c runs its requests closed loop with c in flight, repeat then open.
Reported per cell: output tok/s (all tokens over the wall time), TTFT p50, TPOT p50 (per request:
time after the first token over the tokens after it), ITL p90 between token events, and with
speculation on the decode pods' counts over the cell (/admin/cluster's `speculative`): acceptance
rate (tokens kept over tokens proposed) and mean accepted length (tokens a checked row emitted
per call, the bonus token included). Ratios on / off of the median of the rounds. Timings on a
shared 2-core machine are noisy: they are reported, never asserted.
With `--grammar` every request of both workloads carries a grammar that the model's text keeps
to (vLLM's `guided_regex`, GRAMMAR: printable ASCII, tabs and newlines), without ignore_eos (refused
with a grammar): each step is masked, and with speculation each proposal is cut where the grammar
rejects it and every query of the verify call masked (decode_svc/constrained.py); outputs may end
early at EOS (the same tokens on and off for the greedy repeat workload).
Writes bench/out/speculative/result.json and, unless --no-write, the `speculative` section of
bench/RESULTS.md (`speculative-draft` with --method draft; `-grammar` appended with --grammar).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_line, markdown_table, merge_summary, write_section
from bench.loadgen import RequestSpec, add_client_policy, client_policy, percentile, run_load
from bench.systems import ROOT, TandemLocal, model_id

OUT = ROOT / "bench" / "out" / "speculative"
SECTION = "speculative"
MAX_LEN = 1024
OUTPUT = 128
SOURCES = ("textwrap", "shlex", "fnmatch", "glob", "string", "calendar", "csv", "difflib", "ftplib", "gettext",
           "heapq", "bisect", "base64", "quopri", "sched", "tabnanny", "inspect", "argparse", "pathlib", "typing",
           "dataclasses", "shutil", "tarfile", "zipfile", "pydoc", "ast", "dis", "tokenize", "pprint", "subprocess",
           "os", "posixpath", "random", "statistics", "fractions", "functools", "tempfile", "traceback", "warnings")


# ---------------------------------------------------------------------------------------------
# the workloads (built in a child process with the engine)


def _functions(n: int) -> list[str]:
    """The openings of n top-level functions of this Python's standard library, in a fixed order."""
    import importlib

    out: list[str] = []
    for name in SOURCES:
        text = Path(importlib.import_module(name).__file__).read_text()
        out += ["def " + part for part in text.split("\ndef ")[1:] if len(part) > 600]
        if len(out) >= n:
            return out[:n]
    raise RuntimeError(f"the standard library modules in SOURCES hold {len(out)} functions; {n} are needed")


def build(n: int, path: Path) -> None:
    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np

    from tandem_core.tokenizer import load_tokenizer
    from tandem_core.types import SamplingParams
    from tandem_engine import load_engine

    engine = load_engine("builtin", slots=32, max_len=MAX_LEN, prefill_buckets=(64, 128, 256, 512, 1024))
    tok = load_tokenizer(engine.info)
    greedy = SamplingParams()
    funcs = _functions(2 * n)
    heads = [tok.encode(f)[:300] for f in funcs[:n]]
    conts: list[list[int]] = [[] for _ in heads]
    for at in range(0, n, engine.slots):  # each head's greedy continuation, 32 rows at a time
        group = list(range(at, min(n, at + engine.slots)))
        state = engine.init_state()
        for slot, i in enumerate(group):
            prefix = engine.prefill(heads[i], greedy)
            state = engine.insert(prefix, state, slot, greedy)
            conts[i].append(prefix.first_token)
        for _ in range(159):
            state, tokens = engine.generate(state, len(group))
            host = np.asarray(tokens)
            for slot, i in enumerate(group):
                conts[i].append(int(host[slot]))
        for slot in range(len(group)):
            state = engine.free(state, slot)
    gap = tok.encode("\n\n")
    repeat = [h + c + gap + h for h, c in zip(heads, conts)]
    opened = [tok.encode(f)[:200] for f in funcs[n:2 * n]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"n": n, "repeat": repeat, "open": opened}))


def workloads(n: int) -> dict[str, list[list[int]]]:
    path = OUT / "workload.json"
    if not path.exists() or json.loads(path.read_text()).get("n") != n:
        subprocess.run([sys.executable, __file__, "--build", str(n)], check=True, cwd=ROOT)
    got = json.loads(path.read_text())
    return {"repeat": got["repeat"], "open": got["open"]}


EXTRA = {"repeat": {"temperature": 0.0}, "open": {"temperature": 0.8}}
GRAMMAR = r"[ -~\t\n]*"  # --grammar: printable ASCII, tabs and newlines (what the built-in model's Python is)


def constrain() -> None:
    """--grammar: every request carries GRAMMAR (no ignore_eos: a grammar refuses it)."""
    for extra in EXTRA.values():
        extra.update({"ignore_eos": False, "guided_regex": GRAMMAR})


def specs(prompts: list[list[int]], kind: str) -> list[RequestSpec]:
    return [RequestSpec(0.0, len(p), OUTPUT, kind, p) for p in prompts]


# ---------------------------------------------------------------------------------------------
# one cluster


def spec_counts(base_url: str) -> dict[str, int]:
    """The decode pods' speculative counts summed (zeros when off)."""
    with urllib.request.urlopen(base_url + "/admin/cluster", timeout=10) as r:
        workers = json.load(r)["workers"]
    tot = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    for w in workers:
        s = (w.get("extra") or {}).get("speculative") or {}
        for f in tot:
            tot[f] += int(s.get(f) or 0)
    return tot


def late_compiles_done(base_url: str, timeout_s: float = 600.0) -> float:
    """Seconds until every decode pod has compiled the step variants its warm-up left to idle time
    (the grammar-masked steps; with speculation the verify call's shapes, before which it does not
    speculate): its heartbeat's `late_compiles` done == total."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with urllib.request.urlopen(base_url + "/admin/cluster", timeout=10) as r:
            workers = json.load(r)["workers"]
        late = [(w.get("extra") or {}).get("late_compiles") or {} for w in workers if w.get("role") == "decode"]
        if late and all(x.get("done") == x.get("total") for x in late):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(f"the decode pods' idle-time compiles were not done in {timeout_s:.0f}s")


def _delta(before: dict, after: dict) -> dict:
    return {f: after[f] - before[f] for f in before}


async def _cell(base_url: str, model: str, prompts: list[list[int]], kind: str, c: int, seed: int) -> dict:
    extra = dict(EXTRA[kind])
    reqs = specs(prompts, kind)
    if extra["temperature"] > 0:
        extra["seed"] = seed
    time.sleep(1.2)  # (heartbeats: the last cell's counts are in)
    before = spec_counts(base_url)
    results, wall = await run_load(base_url, model, reqs, concurrency=c, extra=extra, timeout_s=300)
    time.sleep(1.2)  # one heartbeat at least after the last token
    counts = _delta(before, spec_counts(base_url))
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens_out for r in ok)
    itl = [x for r in ok for x in r.itl_s]
    return {"kind": kind, "c": c, "requests": len(reqs), "errors": len(reqs) - len(ok), "tokens": tokens,
            "wall_s": wall, "tok_s": tokens / wall if wall else math.nan,
            "ttft_p50_ms": 1e3 * percentile([r.ttft_s for r in ok], 50),
            "tpot_p50_ms": 1e3 * percentile([r.tpot_s for r in ok], 50),
            "itl_p90_ms": 1e3 * percentile(itl, 90) if itl else math.nan,
            "acceptance": counts["accepted_tokens"] / counts["draft_tokens"] if counts["draft_tokens"] else None,
            "mean_accepted_length": 1 + counts["accepted_tokens"] / counts["drafts"] if counts["drafts"] else None,
            **counts}


def run_system(path: str, on: bool, k: int, concurrency: list[int], work: dict, n: int, log: Path,
               method: str = "ngram", draft_model: str = "", greedy_draft: bool = False) -> list[dict]:
    args = ["--speculative", method, "--speculative-k", str(k)] if on else []
    if on and method == "draft":
        args += ["--draft-model", draft_model] + (["--greedy-draft"] if greedy_draft else [])
    sysm = TandemLocal(f"{path}-{'on' if on else 'off'}", "builtin", colocated=path == "colocated", slots=32,
                   max_len=MAX_LEN, pin="", env={}, log_path=log, extra_args=args)
    sysm.start()
    try:
        waited = late_compiles_done(sysm.base_url)
        print(f"   {path} spec {'on ' if on else 'off'}: the decode pods' idle-time compiles done after {waited:.1f}s",
              flush=True)
        model = model_id(sysm.base_url)
        # warm: both workloads at the widest concurrency (the verify call's variants compile here)
        for kind in ("repeat", "open"):
            asyncio.run(run_load(sysm.base_url, model, specs(work[kind][:32], kind), concurrency=32,
                                 extra={**EXTRA[kind], "max_tokens": 24}))
        cells = []
        for c in concurrency:
            for kind in ("repeat", "open"):
                prompts = work[kind][: max(n, 2 * c)] if c > 1 else work[kind][:max(4, n // 4)]
                cells.append(asyncio.run(_cell(sysm.base_url, model, prompts, kind, c, seed=c)))
                cell = cells[-1]
                print(f"   {path} spec {'on ' if on else 'off'} {kind:6s} c={c:2d}: {cell['tok_s']:7.0f} tok/s, "
                      f"TTFT p50 {cell['ttft_p50_ms']:.0f} ms, TPOT p50 {cell['tpot_p50_ms']:.2f} ms, "
                      f"accept {cell['acceptance'] if cell['acceptance'] is None else round(cell['acceptance'], 3)}"
                      f", errors {cell['errors']}", flush=True)
        return cells
    finally:
        sysm.stop()


# ---------------------------------------------------------------------------------------------
# the report


def _median(cells: list[dict], field: str):
    vals = [c[field] for c in cells if c.get(field) is not None and not (isinstance(c[field], float)
                                                                           and math.isnan(c[field]))]
    return statistics.median(vals) if vals else None


def report(runs: dict, args: argparse.Namespace, command: str) -> str:
    rows = []
    for path in args.paths:
        for c in args.concurrency:
            for kind in ("repeat", "open"):
                off = [x for r in runs[path]["off"] for x in r if x["c"] == c and x["kind"] == kind]
                on = [x for r in runs[path]["on"] for x in r if x["c"] == c and x["kind"] == kind]
                t_off, t_on = _median(off, "tok_s"), _median(on, "tok_s")
                ratio = t_on / t_off if t_off and t_on else None
                acc, mal = _median(on, "acceptance"), _median(on, "mean_accepted_length")
                rows.append([path, kind, c, f"{t_off:.0f}", f"{t_on:.0f}", f"{ratio:.2f}" if ratio else "-",
                             f"{_median(off, 'ttft_p50_ms'):.0f} / {_median(on, 'ttft_p50_ms'):.0f}",
                             f"{_median(off, 'tpot_p50_ms'):.2f} / {_median(on, 'tpot_p50_ms'):.2f}",
                             f"{_median(off, 'itl_p90_ms'):.2f} / {_median(on, 'itl_p90_ms'):.2f}",
                             "-" if acc is None else f"{acc:.2f}", "-" if mal is None else f"{mal:.2f}",
                             sum(x["errors"] for x in off + on)])
    table = markdown_table(["path", "workload", "c", "off tok/s", "on tok/s", "on / off", "TTFT p50 ms off / on",
                            "TPOT p50 ms off / on", "ITL p90 ms off / on", "acceptance", "mean accepted length",
                            "errors"], rows)
    title = "n-gram prompt lookup" if args.method == "ngram" else \
        f"draft model {args.draft_model}{', greedy' if args.greedy_draft else ', sampling'}"
    if args.grammar:
        title += f", every request under the grammar guided_regex {GRAMMAR!r}, no ignore_eos"
    return (f"## Speculative decoding ({title}): on against off\n\n"
            f"Command: `{command}`  \nMachine: {machine_line()}; the client at "
            f"{getattr(args, 'client_sched', 'the normal policy')}  \n"
            f"Built-in model, 32 slots, max_len {MAX_LEN}, k = {args.k}, {OUTPUT} output tokens a request "
            f"({'at most: EOS may end it' if args.grammar else 'ignore_eos'}); per path and round, speculation off then on (each a fresh `tandem local`, warmed), "
            f"medians of {args.rounds} round(s). repeat: a prompt holding the model's own continuation of a "
            f"function's opening, then that opening again (greedy); open: other functions' openings, sampled "
            f"at temperature 0.8 (bench/speculative.py says how they are built and why).\n\n{table}\n\n"
            f"acceptance: proposed tokens kept / proposed; mean accepted length: tokens a proposing row emitted "
            f"per verify call (the bonus token included). TPOT: per request, time after the first token over the "
            f"tokens after it. Targets (issue 45): on / off >= 2 for repeat at c=1, >= 0.95 for open at c=32.\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="16 requests a cell, one round")
    p.add_argument("--paths", default="colocated,disagg")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    p.add_argument("--draft-model", default="builtin-draft")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--grammar", action="store_true", help="every request under a grammar (GRAMMAR), no ignore_eos")
    p.add_argument("--greedy-draft", action="store_true", help="with --method draft: greedy proposals for sampled "
                   "requests too (by default the draft samples at their parameters)")
    p.add_argument("--no-write", action="store_true")
    add_client_policy(p)
    p.add_argument("--build", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.build:
        build(a.build, OUT / "workload.json")
        return
    if a.grammar:
        constrain()
    a.client_sched = client_policy(a.normal_client)
    a.paths = [x for x in a.paths.split(",") if x]
    a.concurrency = [int(x) for x in a.concurrency.split(",") if x]
    if a.quick:
        a.rounds, a.requests = 1, 16
    n = max(a.requests, 2 * max(a.concurrency))
    work = workloads(n)
    runs: dict = {path: {"off": [], "on": []} for path in a.paths}
    for r in range(a.rounds):
        for path in a.paths:
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                print(f"== round {r + 1}: {path}, speculation {'on' if on else 'off'}", flush=True)
                cells = run_system(path, on, a.k, a.concurrency, work, a.requests,
                                   OUT / f"{path}-{'on' if on else 'off'}.log", a.method, a.draft_model,
                                   a.greedy_draft)
                runs[path]["on" if on else "off"].append(cells)
    command = "python bench/speculative.py " + " ".join(sys.argv[1:])
    body = report(runs, a, command)
    print(body)
    (OUT / "result.json").write_text(json.dumps(runs, indent=1))
    if not a.no_write:
        write_section((SECTION if a.method == "ngram" else SECTION + "-draft") + ("-greedy" if a.greedy_draft else "")
                      + ("-grammar" if a.grammar else ""), body)
    if not a.no_write and not a.grammar and not a.greedy_draft:
        merge_summary({"speculative" if a.method == "ngram" else "speculative_draft": {path: {kind: {str(c): {
            "off": _median([x for rr in runs[path]["off"] for x in rr if x["c"] == c and x["kind"] == kind], "tok_s"),
            "on": _median([x for rr in runs[path]["on"] for x in rr if x["c"] == c and x["kind"] == kind], "tok_s")}
            for c in a.concurrency} for kind in ("repeat", "open")} for path in a.paths}})


if __name__ == "__main__":
    main()
