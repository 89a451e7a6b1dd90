"""CPU time per role of a served system, read from /proc (Linux): utime + stime of every process
(and, where a role is a thread, every thread) before and after a measured load.

Pure parts (parsing a stat line, walking a parent table, naming a role from a command line or a
thread name, the before/after arithmetic) are plain functions over values, unit-tested in
tests/unit/test_bench_peer.py; `snapshot` is the only reader of /proc.

Roles:
  * Tandem (`tandem local`'s children, found by walking /proc parents from the launcher's pid):
    `gateway` (`python -m gateway`), `prefill` (`-m prefill_svc`), `decode` (`-m decode_svc`),
    `redis` (`redis-server`), `launcher` (`tandem.cli local` itself).
  * vLLM CPU 0.32 (V1 engine, multiprocess executor): `api_server` (the process started as
    `python -m vllm.entrypoints.openai.api_server`), `engine_core` (a child that renames itself
    `VLLM::EngineCore`: the scheduler loop), `worker` (its child `VLLM::Worker`: the model runner),
    `helper` (multiprocessing's resource tracker and anything else).
  * the bare engine: one process, `engine`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

PROC = Path("/proc")
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Stat:
    pid: int
    comm: str
    ppid: int
    ticks: int  # utime + stime, in clock ticks


def parse_stat(text: str) -> Stat:
    """One /proc/PID/stat (or /proc/PID/task/TID/stat) line. `comm` sits in parentheses and may hold
    spaces and parentheses itself, so the fields after it are split from the last ')'."""
    pid_s, rest = text.split(" (", 1)
    comm, _, tail = rest.rpartition(") ")
    f = tail.split()
    # after comm: state(0) ppid(1) pgrp(2) session(3) tty(4) tpgid(5) flags(6) minflt(7) cminflt(8)
    # majflt(9) cmajflt(10) utime(11) stime(12)
    return Stat(int(pid_s), comm, int(f[1]), int(f[11]) + int(f[12]))


def descendants(root: int, parents: Mapping[int, int]) -> list[int]:
    """`root` and every pid below it in the {pid: ppid} table, root first, then breadth first."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [root], [root]
    while todo:
        nxt = []
        for p in todo:
            for c in sorted(children.get(p, [])):
                if c not in out:
                    out.append(c)
                    nxt.append(c)
        todo = nxt
    return out


def tandem_role(cmdline: str) -> str:
    """The role of one process of `tandem local`, from its command line (NULs as spaces)."""
    argv = cmdline.split()
    if any(os.path.basename(a).startswith("redis-server") for a in argv[:1]) or "redis-server" in cmdline:
        return "redis"
    if "-m" in argv:
        mod = argv[argv.index("-m") + 1] if argv.index("-m") + 1 < len(argv) else ""
        if mod in ("gateway", "prefill_svc", "decode_svc"):
            return {"gateway": "gateway", "prefill_svc": "prefill", "decode_svc": "decode"}[mod]
        if mod == "tandem.cli" or mod == "tandem":
            return "launcher"
    if argv and os.path.basename(argv[0]) == "tandem" and "local" in argv:
        return "launcher"
    return "other"


def vllm_role(cmdline: str) -> str:
    """The role of one process of vLLM CPU's OpenAI server, from its (possibly retitled) cmdline."""
    c = cmdline.strip()
    if c.startswith("VLLM::EngineCore") or "EngineCore" in c.split(" ")[0]:
        return "engine_core"
    if c.startswith("VLLM::Worker") or "Worker" in c.split(" ")[0]:
        return "worker"
    if "vllm.entrypoints" in c or "vllm serve" in c:
        return "api_server"
    return "helper"


def bare_role(_cmdline: str) -> str:
    return "engine"


CLASSIFIERS: dict[str, Callable[[str], str]] = {"tandem": tandem_role, "vllm": vllm_role, "bare": bare_role}


def role_ticks(stats: Iterable[tuple[Stat, str]], classify: Callable[[str], str]) -> dict[str, int]:
    """Sum of ticks per role over (stat, cmdline) pairs."""
    out: dict[str, int] = {}
    for st, cmd in stats:
        role = classify(cmd)
        out[role] = out.get(role, 0) + st.ticks
    return out


def cpu_ms_delta(before: Mapping[int, tuple[str, int]], after: Mapping[int, tuple[str, int]],
                 tck: int = CLK_TCK) -> dict[str, float]:
    """CPU milliseconds per role spent between two snapshots {pid: (role, ticks)}. A process that
    appeared in between counts from zero; one that vanished counts nothing past its last reading
    (its CPU after `before` is lost, so a restarted child shows as less, never more)."""
    out: dict[str, float] = {}
    for pid, (role, t1) in after.items():
        t0 = before.get(pid, (role, 0))[1]
        out[role] = out.get(role, 0.0) + max(0, t1 - t0) * 1000.0 / tck
    for pid, (role, _) in before.items():
        out.setdefault(role, 0.0)
    return out


def per_1k_tokens(ms: Mapping[str, float], tokens: int) -> dict[str, float]:
    """CPU ms per 1,000 output tokens per role, plus `total`."""
    if tokens <= 0:
        return {}
    out = {r: v * 1000.0 / tokens for r, v in sorted(ms.items())}
    out["total"] = sum(ms.values()) * 1000.0 / tokens
    return out


# ---------------------------------------------------------------------------------------------
# /proc readers


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def process_table() -> dict[int, int]:
    """{pid: ppid} of every process readable now."""
    out = {}
    for d in PROC.iterdir():
        if d.name.isdigit():
            t = _read(d / "stat")
            if t:
                st = parse_stat(t)
                out[st.pid] = st.ppid
    return out


def cmdline(pid: int) -> str:
    return _read(PROC / str(pid) / "cmdline").replace("\0", " ").strip()


def snapshot(root: int, kind: str) -> dict[int, tuple[str, int]]:
    """{pid: (role, utime+stime ticks)} of `root` and all its descendants. A process's own stat
    counts all its threads (live ones; threads that ended are folded in by the kernel)."""
    classify = CLASSIFIERS[kind]
    out = {}
    for pid in descendants(root, process_table()):
        t = _read(PROC / str(pid) / "stat")
        if t:
            out[pid] = (classify(cmdline(pid)), parse_stat(t).ticks)
    return out


def thread_ticks(pid: int) -> dict[str, int]:
    """{thread name: ticks} of one process's live threads (threads of one name summed)."""
    out: dict[str, int] = {}
    task = PROC / str(pid) / "task"
    try:
        tids = list(task.iterdir())
    except OSError:
        return out
    for d in tids:
        t = _read(d / "stat")
        if t:
            st = parse_stat(t)
            out[st.comm] = out.get(st.comm, 0) + st.ticks
    return out
