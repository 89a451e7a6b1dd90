"""A burst of long prompts at once (the first turns of 16 chats): TTFT on both Tandem paths and
vLLM CPU's (issue 29: the prefill pod batches one bucket's prompts, the colocated pod chunks them).

Each system: started, warmed with one untimed burst of the same shape (so the batched prefill's
compiles are done), then `--rounds` bursts of `--n` prompts of `--prompt-len` tokens sent at once
(`--output-len` tokens each, greedy, ignore_eos), one round after the other finished. Reported:
TTFT p50 / p90 / max per round and the median of the rounds' p90, and the CPU time each process
spent per prompt over the timed rounds (Tandem's by role: prefill pod, decode pod, gateway, Redis;
on a shared machine less noisy than the wall clock). `--old-root DIR` also runs the Tandem systems
from another checkout (e.g. `git archive <commit> | tar -x -C DIR`), back to back with this one's;
`--tandem-args` adds `tandem local` flags to this checkout's systems (e.g. "--cpu-threads 1"). vLLM runs when bench/.venv-vllm is installed (`--no-vllm` skips it). The numbers
are wall-clock on whatever machine this runs on: on a shared machine they are noisy.

    python bench/burst.py [--quick] [--old-root /tmp/old] [--systems disagg,colocated,vllm] [--tandem-args ARGS]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import vllm_cpu
from bench.common import machine_info, machine_line, markdown_table, write_section
from bench.loadgen import RequestSpec, add_client_policy, client_policy, percentile, run_load
from bench.systems import ROOT, TandemLocal, model_id

OUT = ROOT / "bench" / "out" / "burst"
SECTION = "burst"
EXTRA = {"ignore_eos": True, "temperature": 0.0}


def burst(n: int, prompt_len: int, output_len: int, seed: int, vocab: int = 2048) -> list[RequestSpec]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [RequestSpec(0.0, prompt_len, output_len, "long", rng.integers(3, vocab, prompt_len).tolist())
            for _ in range(n)]


ROLES = (("prefill_svc", "prefill"), ("decode_svc", "decode"), ("gateway", "gateway"), ("redis-server", "redis"))


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of process `pid` and its children, by role: a Tandem
    child by its module (prefill, decode, gateway, redis), anything else (vLLM, the launcher) as
    "server". Processes that end meanwhile are left out."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            t = p.cpu_times()
        except psutil.Error:
            continue
        role = next((r for key, r in ROLES if key in cmd), "server")
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def cpu_per_prompt(before: dict[str, float], after: dict[str, float], prompts: int) -> dict[str, float]:
    """ms of CPU per prompt by role between two `cpu_by_role` readings (roles in both)."""
    return {r: 1e3 * (after[r] - before[r]) / max(1, prompts) for r in after if r in before}


def cpu_cell(cpu: dict[str, float] | None) -> str | None:
    """"61: prefill 30, decode 25, gateway 5, redis 1": the total, then each role, largest first
    (a server of one role, vLLM's: the total only)."""
    if not cpu:
        return None
    total = f"{sum(cpu.values()):.0f}"
    if set(cpu) == {"server"}:
        return total
    return total + ": " + ", ".join(f"{r} {v:.0f}" for r, v in sorted(cpu.items(), key=lambda x: -x[1]))


def make(name: str, a, root: Path):
    tag = f"{name}-old" if root != ROOT else name
    if name == "vllm":
        from tandem.redis_proc import free_port
        from tandem_core.models import BUILTIN_DIR
        model_dir = vllm_cpu.prepare_model_dir(BUILTIN_DIR, OUT / "vllm-model")
        return tag, vllm_cpu.VLLMServer(model_dir, free_port(), a.max_len, None, OUT / "vllm.log",
                                        max_num_seqs=a.slots)
    env = dict(kv.split("=", 1) for kv in a.env)
    extra = shlex.split(a.tandem_args) if root == ROOT else []  # another checkout may not know a new flag
    return tag, TandemLocal(tag, "builtin", colocated=(name == "colocated"), slots=a.slots, max_len=a.max_len,
                        pin="", env=env, log_path=OUT / f"{tag}.log", root=root, extra_args=extra)


def timeline(ttft: list[float]) -> tuple[float, float]:
    """Where a burst's time goes, from its sorted first-token times: (the first one in ms, the
    mean gap between the first and the last in ms). A server that prefills one prompt per call
    answers at about first + i x cadence; one that batches them all answers all at once."""
    if not ttft:
        return math.nan, math.nan
    xs = sorted(ttft)
    return 1e3 * xs[0], (1e3 * (xs[-1] - xs[0]) / (len(xs) - 1) if len(xs) > 1 else 0.0)


async def measure(url: str, a, pid: int | None = None) -> dict:
    """The rounds' TTFTs; with `pid` (the server's process), also the CPU its processes spent per
    prompt over the timed rounds (the pauses between rounds included), by role."""
    model = model_id(url)
    await run_load(url, model, burst(a.n, a.prompt_len, 4, seed=1), extra=EXTRA)  # untimed: compiles
    rounds = []
    cpu0 = cpu_by_role(pid) if pid else {}
    for i in range(a.rounds):
        res, wall = await run_load(url, model, burst(a.n, a.prompt_len, a.output_len, seed=10 + i), extra=EXTRA)
        bad = [r.error for r in res if not r.ok]
        ttft = [r.ttft_s for r in res if r.ok]
        first, cadence = timeline(ttft)
        rounds.append({"p50_ms": 1e3 * percentile(ttft, 50), "p90_ms": 1e3 * percentile(ttft, 90),
                       "max_ms": 1e3 * max(ttft), "wall_s": wall, "errors": len(bad),
                       "ttft_sorted_ms": [round(1e3 * x, 1) for x in sorted(ttft)],
                       "first_ms": first, "cadence_ms": cadence})
        print(f"   round {i}: TTFT p50 {rounds[-1]['p50_ms']:.0f} ms, p90 {rounds[-1]['p90_ms']:.0f} ms, "
              f"max {rounds[-1]['max_ms']:.0f} ms, errors {len(bad)}; first token after {first:.0f} ms, then one "
              f"every {cadence:.1f} ms", flush=True)
        await asyncio.sleep(1.0)
    out = {"rounds": rounds, "p90_ms_median": statistics.median(r["p90_ms"] for r in rounds)}
    if pid:
        out["cpu_ms_per_prompt"] = cpu_per_prompt(cpu0, cpu_by_role(pid), a.n * a.rounds)
        print(f"   CPU ms per prompt: {cpu_cell(out['cpu_ms_per_prompt'])}", flush=True)
    return out


def section(results: dict, a, argv) -> str:
    """The burst section of RESULTS.md: each system's TTFT p90 (median of its rounds), and each
    Tandem system's p90 over vLLM's when vLLM ran and served every request."""
    peer = results.get("vllm", {})
    healthy = "error" not in peer and peer and all(r["errors"] == 0 for r in peer.get("rounds", []))
    rows = []
    for tag, r in results.items():
        if "error" in r:
            rows.append([tag, f"failed: {r['error']}", None, None, None, None, None, None])
            continue
        errors = sum(x["errors"] for x in r["rounds"])
        ratio = r["p90_ms_median"] / peer["p90_ms_median"] if healthy and tag != "vllm" else None
        first = statistics.median(x.get("first_ms", math.nan) for x in r["rounds"])
        cadence = statistics.median(x.get("cadence_ms", math.nan) for x in r["rounds"])
        rows.append([tag, r["p90_ms_median"], ", ".join(f"{x['p90_ms']:.0f}" for x in r["rounds"]), first, cadence,
                     errors, ratio, cpu_cell(r.get("cpu_ms_per_prompt"))])
    cmd = " ".join(["python bench/burst.py", *(argv if argv is not None else sys.argv[1:])])
    return "\n".join([
        "## A burst of long prompts: TTFT against vLLM CPU", "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine_line(machine_info())}  ",
        f"{a.n} prompts of {a.prompt_len} tokens sent at once ({a.output_len} output tokens each, greedy, "
        f"`ignore_eos`), {a.rounds} rounds after an untimed one; built-in model, {a.slots} slots, max_len "
        f"{a.max_len} on every system; unpinned; the client at {getattr(a, 'client_sched', 'the normal policy')}. `-old` rows: the `--old-root` checkout, run just before."
        + (f" This checkout's Tandem rows ran with `{a.tandem_args}`." if getattr(a, "tandem_args", "") else ""), "",
        markdown_table(["system", "TTFT p90 ms (median of rounds)", "each round's p90 ms", "first TTFT ms",
                        "then one every ms", "errors", "p90 / vLLM's (target <= 1)",
                        "CPU ms per prompt: all, by process"], rows),
        "\n`first TTFT` is the burst's earliest first token and `then one every` the mean gap from it to the "
        "last (medians of the rounds): the fixed path in front of the first prefill, and the prefill's own "
        "cadence when prompts are answered one call after another. `CPU ms per prompt`: user + system CPU of "
        "the server's processes over the timed rounds over the prompts sent (Tandem by role; vLLM's server "
        "and its engine process together).",
        "" if healthy else "\nvLLM did not run or did not serve every request: no ratio is quoted.",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rounds")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--systems", default="disagg,colocated,vllm")
    p.add_argument("--old-root", default="", help="also run the Tandem systems from this checkout")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    add_client_policy(p)
    p.add_argument("--tandem-args", default="", metavar="ARGS",
                   help="more `tandem local` flags for this checkout's Tandem systems, e.g. \"--cpu-threads 1\"")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="a Tandem setting for its pods, e.g. TANDEM_PREFILL_PREFILL_BATCH_TOKENS=1024")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds = 2
    names = [s for s in a.systems.split(",") if s and not (s == "vllm" and a.no_vllm)]
    if "vllm" in names and not vllm_cpu.installed():
        print("vLLM CPU is not installed (bench/.venv-vllm): skipping it", flush=True)
        names.remove("vllm")
    plan = []
    for name in names:
        if a.old_root and name != "vllm":
            plan.append((name, Path(a.old_root)))
        plan.append((name, ROOT))
    # (bench/loadgen.py: a starved client reads a burst late)
    a.client_sched = client_policy(a.normal_client)
    results = {}
    for name, root in plan:
        tag, server = make(name, a, root)
        print(f"== {tag} ({a.n} x {a.prompt_len} tokens at once, {a.rounds} rounds)", flush=True)
        t0 = time.monotonic()
        try:
            server.start()
            results[tag] = asyncio.run(measure(server.base_url, a, server.proc.pid if server.proc else None))
        except Exception as e:  # noqa: BLE001 - one system failing still reports the others
            results[tag] = {"error": f"{type(e).__name__}: {e}"}
            print(f"   failed: {results[tag]['error']}", flush=True)
        finally:
            server.stop()
        print(f"   ({time.monotonic() - t0:.0f}s)", flush=True)
    text = section(results, a, argv)
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "burst.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    if not a.no_write:
        write_section(SECTION, text)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
