"""Fault injection into a running `tandem local`: find the process to strike (the busiest decode
pod, a prefill pod holding claimed prompts, the gateway, the embedded Redis) and strike it
(SIGKILL, SIGSTOP then SIGCONT, a Redis restart that loses its last writes by cutting its
append-only file), reading the cluster's state from /admin/cluster, its log and Redis.

Used by tests/e2e/faults.py (the scenarios), tests/e2e/test_soak.py (the launcher's children)
and, through the scenarios, bench/faults.py. Knows nothing of the requests sent meanwhile
(tests/e2e/fault_load.py) nor of which fault a scenario injects.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx

# The fault cluster's workers (tests/e2e/faults.py starts it); a struck pod is looked for among them.
WANT = {"prefill": 2, "decode": 2}  # two prefill pods: a paused or dead one's prompts are reclaimed by the other


async def cluster_view(c: httpx.AsyncClient, timeout_s: float = 60) -> dict:
    """/admin/cluster, waiting through a gateway or Redis restart."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = await c.get("/admin/cluster")
            if resp.status_code == 200:
                return resp.json()
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("/admin/cluster did not answer")
        await asyncio.sleep(0.2)


def launcher_children(ppid: int) -> dict[int, str]:
    """pid -> module (`python -m MODULE`) of the launcher's children, from /proc."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        if int(stat[1]) == ppid and "-m" in cmd:
            out[int(pid)] = cmd[cmd.index("-m") + 1]
    return out


def redis_pid(log_lines: list[str]) -> int:
    pids = [int(m.group(1)) for line in log_lines if (m := re.search(r"redis pid=(\d+)", line))]
    return pids[-1]


def redis_url(log_lines: list[str]) -> str:
    """The embedded Redis's URL, as the launcher last logged it (it restarts on the same port)."""
    return [m.group(1) for line in log_lines if (m := re.search(r"redis pid=\d+ url=(\S+)", line))][-1]


def redis_aof(log_lines: list[str]) -> Path:
    """The embedded Redis's append-only file (asked of the server itself)."""
    import redis

    c = redis.Redis.from_url(redis_url(log_lines))
    try:
        return Path(c.config_get("dir")["dir"]) / c.config_get("appendfilename")["appendfilename"]
    finally:
        c.close()


async def restart_redis_without_last_writes(cluster, lose_s: float) -> float:
    """What a machine crash under `appendfsync everysec` (or a failover to a trailing replica)
    leaves: Redis comes back with the state of `lose_s` seconds before it died. The AOF's size is
    noted, writes go on for `lose_s`, then Redis is SIGKILLed, its AOF cut back to that size (Redis
    loads a command cut in half as the end: aof-load-truncated) and the launcher restarts it."""
    aof = redis_aof(cluster.log)
    size = aof.stat().st_size
    await asyncio.sleep(lose_s)
    os.kill(cluster.proc.pid, signal.SIGSTOP)  # no restart before the cut
    try:
        os.kill(redis_pid(cluster.log), signal.SIGKILL)
        struck = time.monotonic()
        await asyncio.sleep(0.1)
        lost = aof.stat().st_size - size
        os.truncate(aof, size)
    finally:
        os.kill(cluster.proc.pid, signal.SIGCONT)
    print(f"  cut {lost} bytes ({lose_s:g}s of writes) off the AOF", file=sys.stderr)
    return struck


async def wait_healthy(base: str, want: dict[str, int], timeout_s: float = 120) -> list[dict]:
    """Until every expected worker is registered by a live process (a restarted pod compiles
    for a while before it registers; its predecessor's entry lingers until its TTL)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base, timeout=10) as c:
        while True:
            workers = (await cluster_view(c))["workers"]
            live = [w for w in workers if _alive(w["pid"]) and w["heartbeat_age_s"] < 2]
            if all(sum(w["role"] == r for w in live) >= n for r, n in want.items()):
                return live
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not healthy: {workers}")
            await asyncio.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


async def busiest_pid(cluster, role: str, healthy: list[dict] | None = None) -> int:
    """The busiest live worker of `role` (a stale registry entry has a dead pid): the decode pod
    running the most requests now; the prefill pod with the most prompts in its own admission
    stream (claimed and not yet published, or waiting), then the most KV held. `healthy`: the
    workers as `wait_healthy` found them just before (a stream here lasts a fraction of a second:
    there is no time to ask again)."""
    base = cluster.base_url
    if healthy and not all(_alive(w["pid"]) for w in healthy if w["role"] == role):
        healthy = None  # a pod restarted since (its registry entry was a beat old): ask again
    if role != "prefill" and healthy:
        return await _most_running(cluster, [w for w in healthy if w["role"] == role])
    live = [w for w in await wait_healthy(base, WANT) if w["role"] == role]
    if role != "prefill":
        return await _most_running(cluster, live)
    async with httpx.AsyncClient(base_url=base, timeout=10) as c:
        pods = (await cluster_view(c))["queues"].get("pod_admission") or {}
    return max(live, key=lambda w: (sum(pods.get(w["id"], {}).values()), w["held_kv_bytes"]))["pid"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _most_running(cluster, live: list[dict], timeout_s: float = 5.0) -> int:
    """The pid of the decode pod with the most requests in its running hash, read from Redis at
    the moment of the fault (a heartbeat's free slots are up to a beat old, and a stream of the
    tiny model lasts about a second); waits up to `timeout_s` for one that runs something."""
    import redis.asyncio as aioredis

    from tandem_core import keys

    r = aioredis.Redis.from_url(redis_url(cluster.log))
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            pipe = r.pipeline(transaction=False)
            for w in live:
                pipe.hlen(keys.KeySpace(1).running_key(w["id"], 0))  # tandem local: one shard
            counts = await pipe.execute()
            if max(counts) > 0 or time.monotonic() > deadline:
                pick = live[counts.index(max(counts))]
                print(f"  the decode pod running the most: {pick['id']} ({max(counts)} of {sum(counts)} running)",
                      file=sys.stderr)
                return pick["pid"]
            await asyncio.sleep(0.005)
    finally:
        await r.aclose()


async def stop_prefill_holding_work(cluster, timeout_s: float = 10.0) -> int:
    """SIGSTOP a prefill pod at a moment it holds claimed prompts it has not published (admission
    entries pending to it); returns its pid. A prefill of the tiny model takes milliseconds, so a
    stop at a random moment mostly finds a pod with nothing in hand: each pod in turn is stopped,
    its pending entries are counted, and it is let go again if it has none. After `timeout_s`
    (the prompts all published) the busiest one is stopped anyway."""
    import redis.asyncio as aioredis

    from tandem_core import keys

    live = [w for w in await wait_healthy(cluster.base_url, WANT) if w["role"] == "prefill"]
    pool = os.environ.get("TANDEM_PREFILL_POOL", "default")
    ks = keys.KeySpace(1)  # tandem local: one key shard
    names = [ks.admission_stream(pool, p, 0) for p in keys.PRIORITIES]
    names += [ks.pod_admission_stream(pool, p, w["id"], 0) for w in live for p in keys.PRIORITIES]
    r = aioredis.Redis.from_url(redis_url(cluster.log))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for w in live:
                os.kill(w["pid"], signal.SIGSTOP)
                held = 0
                try:
                    held = await _pending_to(r, names, w["id"])
                finally:
                    if not held:  # never leave a pod stopped by a failed look
                        os.kill(w["pid"], signal.SIGCONT)
                if held:
                    return w["pid"]
            await asyncio.sleep(0.002)
    finally:
        await r.aclose()
    pid = await busiest_pid(cluster, "prefill")
    os.kill(pid, signal.SIGSTOP)
    return pid


async def _pending_to(r, names: list[str], consumer: str) -> int:
    """Entries of the streams `names` (group `prefill`) pending to `consumer`."""
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.xpending(name, "prefill")
    total = 0
    for summary in await pipe.execute(raise_on_error=False):  # a stream not there yet: an error, skipped
        if isinstance(summary, dict):
            total += sum(int(c["pending"]) for c in summary.get("consumers") or []
                         if (c["name"].decode() if isinstance(c["name"], bytes) else c["name"]) == consumer)
    return total
