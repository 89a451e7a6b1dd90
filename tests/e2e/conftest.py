"""The whole cluster as processes: `tandem local` started in a subprocess, stopped by PID."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

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
