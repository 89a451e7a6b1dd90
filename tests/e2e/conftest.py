"""The whole cluster as processes: `tandem local` started in a subprocess, stopped by PID."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tandem.redis_proc import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LocalCluster:
    proc: subprocess.Popen
    port: int
    grpc_port: int
    model: str
    max_len: int
    log: list[str]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_local(model: str = "builtin", *, prefill: int = 1, decode: int = 1, slots: int = 4,
                max_len: int = 512, extra: list[str] | None = None, timeout_s: float = 240,
                env: dict[str, str] | None = None) -> LocalCluster:
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "local", "--model", model, "--port", str(port),
           "--grpc-port", str(grpc_port), "--prefill", str(prefill), "--decode", str(decode),
           "--slots", str(slots), "--max-len", str(max_len), *(extra or [])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            encoding="utf-8", errors="replace")
    log: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:  # keep draining so the children never block on a full pipe
            log.append(line)
            if "Tandem is serving" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_local(proc)
            raise RuntimeError("tandem local did not come up:\n" + "".join(log[-40:]))
    return LocalCluster(proc, port, grpc_port, model, max_len, log)


def stop_local(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def local_cluster():
    """`tandem local` with the built-in model (1 prefill pod, 1 decode pod of 4 slots), shared by the
    session: a LocalCluster (base_url, model, max_len, log). Not a Redis Cluster: that is
    tests/conftest.py's `redis_cluster`."""
    c = start_local()
    try:
        yield c
    finally:
        stop_local(c.proc)
        assert c.proc.returncode == 0, "tandem local did not stop cleanly:\n" + "".join(c.log[-30:])


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def both_paths(request):
    """Each test twice: on the session's disaggregated cluster (the built-in model; a long prompt
    goes through the prefill pod, a short one is prefilled by the decode pod), then on a colocated
    cluster of this module's own."""
    if request.param == "disaggregated":
        yield request.getfixturevalue("local_cluster")
        return
    c = start_local(slots=4, extra=["--colocated"])
    try:
        yield c
    finally:
        stop_local(c.proc)


def until_quiet(base: str, timeout_s: float = 30) -> dict:
    """The decode pod's counters once the whole cluster is idle and stays so: every pod's slots
    free, no KV held, nothing queued, and the decode and prefill counters unchanged over more
    than two heartbeats of fresh reports. (Free decode slots alone are no witness: a prompt still inside
    the prefill pod reaches the decode pod later, and a cancel of an earlier test's request would
    then land in this test's counters.)"""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        snap = httpx.get(base + "/admin/cluster", timeout=10).json()
        workers = snap["workers"]
        dec = [w for w in workers if w["role"] == "decode"]
        idle = (len(dec) == 1 and all(w["free_slots"] == w["slots"] for w in workers)
                and all(w.get("held_kv_bytes", 0) == 0 for w in workers)
                and all(w["heartbeat_age_s"] < 1.5 for w in workers)
                and not any(dec[0]["extra"].get("requests", {}).values())  # none claimed or pulling
                and snap["queues"]["admission_backlog"] == 0 and snap["queues"]["ready"] == 0)
        counters = (dec[0]["extra"]["cancelled"], dec[0]["extra"]["tokens"],
                    [w["extra"].get("prefilled") for w in workers if w["role"] == "prefill"]) if idle else None
        now = time.monotonic()
        if counters is None or counters != last:
            last, since = counters, now
        elif now - since > 2.5:
            return {**dec[0]["extra"], "free": True}
        assert now < deadline, f"the cluster did not settle: {json.dumps(snap)[:800]}"
        time.sleep(0.2)
