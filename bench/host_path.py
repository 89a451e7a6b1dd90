"""Host path benchmark (issue 29): host CPU per output token of every role, Python threads apart
from the native runtime, and what the decode pod's host could sustain on an accelerator.

    python bench/host_path.py [--quick] [--baseline REF] [--profile] [--slots-big 256]

Two measurements on the real path (`tandem local --prefill 1 --decode 1`, the built-in model,
bench/loadgen.py's streaming client, greedy, `ignore_eos`):
  * c=32: 32 slots, closed loop at concurrency 32, 128 prompt / 64 output tokens (bench/peer.py's
    shape). Per role (gateway, prefill, decode): CPU µs per output token of its Python threads
    (those `py-spy dump` lists: the event loop, the engine thread, executors) and of the rest
    (XLA's and gRPC's native threads), from /proc/PID/task/TID/stat before and after.
  * the 256-slot projection: the decode pod with `--slots-big` slots (256 by default, or the
    most that fit), that many requests at once (32 prompt / 64 output tokens). The decode pod's
    Python-thread CPU per step (steps counted by the pod itself, read from its registry entry)
    gives the steps per second its host could sustain if the device took no time: 1 / (host
    CPU per step), since the Python threads share one GIL. A device step slower than that host
    time per step is the limit; a faster one waits on Python.
CPU time, not wall time, is what is compared: the machine may be shared, and CPU time per token is
steadier than tokens per second. `--baseline REF` runs the same measurements first on the code of
git REF (exported with `git archive` under bench/out/host_path/), back to back with this tree.
`--profile` adds a separate run at c=32 with `py-spy record --native --gil` of the decode pod
(its own run: py-spy's sampling costs CPU that must not land in the numbers), and prints the
top frames. Writes bench/out/host_path.json, the `host_path` section of bench/RESULTS.md and
`host_path_*` keys of bench/out/summary.json. Timings are reported, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import proc_cpu
from bench.common import (
    BENCH_DIR,
    fmt,
    machine_line,
    markdown_table,
    merge_summary,
    write_section,
)
from bench.loadgen import RequestSpec, add_client_policy, client_policy, run_load
from bench.systems import TandemLocal, model_id, warm_up
from bench.token_plane_procs import top_frames

SECTION = "host_path"
OUT = BENCH_DIR / "out"
RAW = OUT / "host_path"
EXTRA = {"stream_options": {"include_usage": True}}
ROLES = ("gateway", "prefill", "decode")
PY_SPY = Path(sys.executable).with_name("py-spy")


@dataclass
class Plan:
    slots: int = 32
    requests: int = 128
    prompt_len: int = 128
    output_len: int = 64
    slots_big: int = 256
    prompt_big: int = 32
    output_big: int = 256  # long enough that most steps run with every slot full
    max_len: int = 1024

    @classmethod
    def quick(cls) -> Plan:
        return cls(requests=64, output_len=32, slots_big=128, output_big=64)


# ---------------------------------------------------------------------------------------------
# pure parts (tests/unit/test_bench_host_path.py)


def python_tids(dump: str) -> dict[int, str]:
    """{OS thread id: thread name} of the threads `py-spy dump` lists (`Thread 12345 (idle):
    "MainThread"`): the threads running Python. Executor threads are named by their pool
    (`ThreadPoolExecutor-0_3` -> `ThreadPoolExecutor-0`). py-spy prints hex ids (0x...) only where
    it cannot read the OS id; those are left out."""
    return {int(m.group(1)): re.sub(r"_\d+$", "", m.group(2))
            for m in re.finditer(r'^Thread (\d+) [^:]*: "([^"]*)"', dump, re.MULTILINE)}


def by_name(before: dict[int, int], after: dict[int, int], python: dict[int, str], tck: int = proc_cpu.CLK_TCK
            ) -> dict[str, float]:
    """CPU ms per Python thread name between two {tid: ticks} readings."""
    out: dict[str, float] = {}
    for tid, name in python.items():
        if tid in after:
            out[name] = out.get(name, 0.0) + max(0, after[tid] - before.get(tid, 0)) * 1000.0 / tck
    return out


def split_ms(before: dict[int, int], after: dict[int, int], python: dict[int, str] | set[int], tck: int = proc_cpu.CLK_TCK
             ) -> tuple[float, float]:
    """(Python threads' CPU ms, the other threads' CPU ms) between two {tid: ticks} readings of one
    process. A thread that appeared in between counts from zero."""
    py = native = 0
    for tid, t1 in after.items():
        d = max(0, t1 - before.get(tid, 0))
        if tid in python:
            py += d
        else:
            native += d
    return py * 1000.0 / tck, native * 1000.0 / tck


def per_token_us(ms: float, tokens: int) -> float:
    return ms * 1000.0 / tokens if tokens else float("nan")


def projection(py_ms: float, steps: int, tokens: int) -> dict:
    """Host CPU per step and the steps/s (and tokens/s) the host could sustain if the device took
    no time: one GIL, so the Python threads' CPU per step is the host's floor on a step."""
    per_step_us = py_ms * 1000.0 / steps if steps else float("nan")
    rows = tokens / steps if steps else float("nan")
    sps = 1e6 / per_step_us if per_step_us > 0 else float("nan")
    return {"steps": steps, "tokens": tokens, "rows_per_step": rows, "host_us_per_step": per_step_us,
            "host_us_per_token": per_token_us(py_ms, tokens), "host_steps_per_s": sps,
            "host_tokens_per_s": sps * rows}


# ---------------------------------------------------------------------------------------------
# /proc and py-spy readers


def tids(pid: int) -> dict[int, int]:
    """{tid: utime+stime ticks} of one process's live threads."""
    out = {}
    task = proc_cpu.PROC / str(pid) / "task"
    try:
        entries = list(task.iterdir())
    except OSError:
        return out
    for d in entries:
        try:
            out[int(d.name)] = proc_cpu.parse_stat((d / "stat").read_text()).ticks
        except (OSError, ValueError):
            pass
    return out


def dump_tids(pid: int) -> dict[int, str]:
    if not PY_SPY.exists():
        raise SystemExit(f"py-spy is not installed next to {sys.executable}: pip install py-spy")
    r = subprocess.run([str(PY_SPY), "dump", "-p", str(pid), "--nonblocking"], capture_output=True, text=True,
                       timeout=60, check=False)  # a thread list or nothing: an empty dump lists no thread
    return python_tids(r.stdout)


def role_pids(root: int) -> dict[str, int]:
    out = {}
    for pid, (role, _) in proc_cpu.snapshot(root, "tandem").items():
        if role in ROLES or role == "redis":
            out.setdefault(role, pid)
    return out


def redis_url(pid: int) -> str:
    """redis-server retitles itself `redis-server HOST:PORT`; started with `--port N` before that."""
    cmd = proc_cpu.cmdline(pid)
    m = re.search(r"(\d+\.\d+\.\d+\.\d+):(\d+)", cmd) or re.search(r"--port (\d+)", cmd)
    if not m:
        raise RuntimeError(f"no port in the redis-server command line {cmd!r}")
    return f"redis://127.0.0.1:{m.group(m.lastindex)}"


def decode_counts(url: str) -> tuple[int, int]:
    """(steps, tokens) the decode pod reported in its last heartbeat (its registry entry)."""
    import redis

    from tandem_core import keys

    with redis.Redis.from_url(url) as r:
        for wid in r.zrange(keys.WORKERS, 0, -1):
            h = r.hgetall(keys.worker_key(wid.decode()))
            if h.get(b"role") == b"decode":
                extra = json.loads(h[b"extra"])
                return int(extra["steps"]), int(extra["tokens"])
    raise RuntimeError(f"no decode pod in the registry of {url}")


def redis_calls(url: str) -> dict[str, int]:
    """Calls per command so far (INFO commandstats): every role's commands together, the round
    trips behind the CPU a role spends in its socket writes and reads."""
    import redis

    with redis.Redis.from_url(url) as r:
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


# ---------------------------------------------------------------------------------------------
# one cluster


class CodeAt(TandemLocal):
    """`tandem local` running the code of another directory (a baseline exported by git archive)."""

    def __init__(self, *args, code_dir: Path | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.code_dir = code_dir

    def command(self) -> list[str]:
        cmd = super().command()
        if self.code_dir is None:
            return cmd
        return ["env", f"--chdir={self.code_dir}", f"PYTHONPATH={self.code_dir}", *cmd]


def specs(n: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> list[RequestSpec]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [RequestSpec(0.0, prompt_len, output_len, "short", rng.integers(3, vocab, prompt_len).tolist())
            for _ in range(n)]


async def measured(url: str, model: str, load: list[RequestSpec], c: int, pids: dict[str, int], redis: str) -> dict:
    """One closed-loop run at concurrency c: per role, Python-thread and native CPU ms."""
    py = {r: dump_tids(p) for r, p in pids.items() if r in ROLES}
    await asyncio.sleep(1.5)  # a heartbeat after the warm-up: the step count below starts here
    s0 = decode_counts(redis)
    before = {r: tids(p) for r, p in pids.items() if r in ROLES}
    cmd0 = redis_calls(redis)
    res, wall = await run_load(url, model, load, concurrency=c, extra=EXTRA)
    after = {r: tids(p) for r, p in pids.items() if r in ROLES}
    cmd1 = redis_calls(redis)
    for r, p in pids.items():  # executor threads started during the run
        if r in ROLES:
            py[r].update(dump_tids(p))
    await asyncio.sleep(2.5)  # the decode pod's next heartbeats carry the run's last steps
    s1 = decode_counts(redis)
    tokens = sum(x.tokens_out for x in res)
    errors = [x.error for x in res if x.error]
    roles = {}
    for r in ROLES:
        pm, nm = split_ms(before[r], after[r], py[r])
        roles[r] = {"python_ms": pm, "native_ms": nm, "python_us_per_token": per_token_us(pm, tokens),
                    "native_us_per_token": per_token_us(nm, tokens), "python_threads": len(py[r]),
                    "python_us_per_token_by_thread": {k: per_token_us(v, tokens) for k, v in
                                                      by_name(before[r], after[r], py[r]).items()}}
    calls = {k: v - cmd0.get(k, 0) for k, v in cmd1.items() if v > cmd0.get(k, 0)}
    return {"tokens": tokens, "wall_s": wall, "errors": len(errors), "first_error": errors[0] if errors else None,
            "roles": roles, "redis_calls_per_token": {k: round(v / tokens, 3) for k, v in
                                                      sorted(calls.items(), key=lambda kv: -kv[1]) if tokens}, "decode": projection(roles["decode"]["python_ms"], s1[0] - s0[0], s1[1] - s0[1])}


def run_cluster(label: str, slots: int, c: int, load: list[RequestSpec], plan: Plan, code_dir: Path | None,
                profile_s: float = 0.0) -> dict:
    server = CodeAt(label, "builtin", colocated=False, slots=slots, max_len=plan.max_len, pin="", env={},
                    log_path=RAW / f"{label}.log", code_dir=code_dir)
    try:
        server.start()
        url, pids = server.base_url, role_pids(server.proc.pid)
        redis = redis_url(pids["redis"])
        model = model_id(url)
        asyncio.run(warm_up(url, model, load, slots, EXTRA))
        asyncio.run(run_load(url, model, load[:slots], concurrency=c, extra=EXTRA))
        if profile_s:
            return profiled(url, model, load, c, pids["decode"], label, profile_s)
        return asyncio.run(measured(url, model, load, c, pids, redis))
    except Exception as e:  # noqa: BLE001 - one run failing must not lose the others
        return {"status": "failed", "reason": f"{type(e).__name__}: {e} {server.tail()}"[:600]}
    finally:
        server.stop()


def profiled(url: str, model: str, load: list[RequestSpec], c: int, pid: int, label: str, seconds: float) -> dict:
    """py-spy record --native --gil of the decode pod during a run at concurrency c."""
    path = RAW / f"{label}.pyspy.txt"
    prof = subprocess.Popen([str(PY_SPY), "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "100",
                             "--native", "--gil", "--threads", "-f", "raw", "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end and prof.poll() is None:  # keep the pod busy for the whole recording
        asyncio.run(run_load(url, model, load, concurrency=c, extra=EXTRA))
    try:
        prof.wait(seconds + 60)
    except subprocess.TimeoutExpired:
        prof.kill()
        prof.wait()
    if not path.exists():
        return {"error": (prof.stderr.read() or b"").decode()[-300:]}
    lines = path.read_text().splitlines()
    out = top_frames(lines, 15)
    out["by_thread"] = thread_shares(lines)
    return out


def thread_shares(lines: list[str]) -> dict[str, float]:
    """Share of samples per thread of py-spy raw lines recorded with --threads (the first frame
    names the thread: `thread (0x7f..)` or `process 123:"..."`, then the thread)."""
    got: dict[str, int] = {}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            first = stack.split(";", 1)[0]
            got[first] = got.get(first, 0) + int(count)
    total = sum(got.values()) or 1
    return {k: v / total for k, v in sorted(got.items(), key=lambda kv: -kv[1])}


def export(ref: str) -> Path:
    """The tree of git `ref` under bench/out/host_path/code-REF (once)."""
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    dest = RAW / f"code-{sha}"
    if not (dest / "decode_svc").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        arch = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    return dest


# ---------------------------------------------------------------------------------------------
# report


def report(doc: dict) -> str:
    lines = [(f"Host path (issue 29): {doc['machine']}; built-in model, `tandem local --prefill 1 --decode 1`, "
              "bench/loadgen.py's client. CPU µs per output token from /proc/PID/task; Python threads are those "
              "`py-spy dump` lists, native the rest (XLA, gRPC)."), ""]
    rows = []
    for code, run in doc["runs"].items():
        m = run.get("c32", {})
        if "roles" not in m:
            rows.append([code, m.get("status", "failed"), m.get("reason", "")[:80], "", "", "", "", ""])
            continue
        r = m["roles"]
        rows.append([code] + [fmt(r[x][k], 3) for x in ROLES for k in ("python_us_per_token", "native_us_per_token")]
                    + [fmt(m["decode"]["host_us_per_step"], 3)])
    lines.append(f"**c={doc['plan']['slots']}** ({doc['plan']['requests']} requests, {doc['plan']['prompt_len']} "
                 f"prompt / {doc['plan']['output_len']} output tokens):")
    lines.append("")
    lines.append(markdown_table(["code", "gateway py µs/tok", "gateway native", "prefill py", "prefill native",
                                 "decode py µs/tok", "decode native", "decode py µs/step"], rows))
    rows = []
    for code, run in doc["runs"].items():
        m = run.get("big", {})
        if "decode" not in m:
            rows.append([code, m.get("status", "failed"), m.get("reason", "")[:80], "", "", ""])
            continue
        d = m["decode"]
        rows.append([code, fmt(d["rows_per_step"], 3), fmt(d["host_us_per_token"], 3), fmt(d["host_us_per_step"], 3),
                     fmt(d["host_steps_per_s"], 3), fmt(d["host_tokens_per_s"], 3)])
    lines += ["", (f"**Projection: the decode pod with {doc['plan']['slots_big']} slots** ({doc['plan']['slots_big']} "
                   f"requests at once, {doc['plan']['prompt_big']} prompt / {doc['plan']['output_big']} output tokens). "
                   "Host steps/s: what the decode pod's Python threads could sustain if the device step took no "
                   "time; a device step longer than 1/that is the limit, a shorter one waits on the host."), ""]
    lines.append(markdown_table(["code", "rows/step", "decode py µs/tok", "py µs/step", "host steps/s",
                                 "host tok/s"], rows))
    for code, run in doc["runs"].items():
        if run.get("profile"):
            top = run["profile"]
            lines += ["", (f"py-spy --native --gil of the decode pod at c={doc['plan']['slots']} ({code}), "
                           f"{top.get('samples', 0)} samples, top by self:"), ""]
            lines += [f"- {share:.1%} {f}" for f, share in top.get("self", [])[:10]]
            lines += ["", "by thread: " + ", ".join(f"{k} {v:.0%}" for k, v in list(top.get("by_thread", {}).items())[:6])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--baseline", default="", help="git ref whose code is measured first, back to back")
    p.add_argument("--profile", action="store_true", help="add a py-spy --native --gil run of the decode pod")
    p.add_argument("--slots-big", type=int, default=0, help="slots of the projection run (default 256)")
    p.add_argument("--parts", default="c32,big", help="which runs: c32, big (default both)")
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md and summary.json")
    add_client_policy(p)
    args = p.parse_args(argv)
    client = client_policy(args.normal_client)
    plan = Plan.quick() if args.quick else Plan()
    if args.slots_big:
        plan.slots_big = args.slots_big
    from tandem_core.models import resolve_model

    vocab = resolve_model("builtin").vocab_size
    load = specs(plan.requests, plan.prompt_len, plan.output_len, vocab, 1)
    big = specs(plan.slots_big, plan.prompt_big, plan.output_big, vocab, 2)
    codes: dict[str, Path | None] = {}
    if args.baseline:
        codes[f"baseline {args.baseline}"] = export(args.baseline)
    codes["this tree"] = None
    runs: dict = {}
    for code, where in codes.items():
        tag = "base" if where is not None else "tree"
        print(f"==> {code}: c={plan.slots}", flush=True)
        run: dict = {"c32": {"status": "skipped"}, "big": {"status": "skipped"}}
        if "c32" in args.parts:
            run["c32"] = run_cluster(f"{tag}-c32", plan.slots, plan.slots, load, plan, where)
            print(f"    {json.dumps(run['c32'].get('roles', run['c32']))[:1200]}", flush=True)
            print(f"    Redis calls per token: {json.dumps(run['c32'].get('redis_calls_per_token', {}))[:600]}",
                  flush=True)
        if "big" in args.parts:
            print(f"==> {code}: {plan.slots_big} slots", flush=True)
            run["big"] = run_cluster(f"{tag}-big", plan.slots_big, plan.slots_big, big, plan, where)
            print(f"    {json.dumps(run['big'].get('decode', run['big']))[:400]}", flush=True)
        if args.profile:
            run["profile"] = run_cluster(f"{tag}-prof", plan.slots, plan.slots, load, plan, where, profile_s=20)
            print(f"    profile: {json.dumps(run['profile'])[:3000]}", flush=True)
        runs[code] = run
    doc = {"machine": f"{machine_line()}; the client at {client}", "plan": plan.__dict__, "runs": runs, "time": time.strftime("%Y-%m-%d %H:%M")}
    RAW.mkdir(parents=True, exist_ok=True)
    (OUT / "host_path.json").write_text(json.dumps(doc, indent=1, default=str))
    text = report(doc)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
        tree = runs["this tree"]
        summary = {}
        if "roles" in tree["c32"]:
            summary |= {f"host_path_{r}_py_us_per_token": tree["c32"]["roles"][r]["python_us_per_token"] for r in ROLES}
        if "decode" in tree["big"]:
            summary["host_path_big_host_steps_per_s"] = tree["big"]["decode"]["host_steps_per_s"]
            summary["host_path_big_py_us_per_token"] = tree["big"]["decode"]["host_us_per_token"]
        merge_summary(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
