"""The systems bench/serve.py drives, each behind one shape: start, an OpenAI base URL, stop.

  * `TandemLocal`: `tandem local` as a subprocess, each child pinned with `--pin`; disaggregated
    (1 prefill + 1 decode pod) or colocated (decode pods that prefill between steps).
  * `vllm_cpu.VLLMServer`: vLLM CPU's OpenAI server from its own virtual environment.
  * the bare engine is not a server: bench/bare.py runs it in a pinned subprocess.
`warm_up` sends one request per prefill bucket the workload will use plus one full batch, so
compilation never lands inside a measured run. Nothing here measures.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.loadgen import RequestSpec, run_load
from tandem.redis_proc import free_port

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = (16, 32, 64, 128, 256, 512)


def _compiling(worker: dict) -> bool:
    """A prefill pod (an /admin/cluster worker) whose batched prefill shapes are still compiling."""
    b = (worker.get("extra") or {}).get("batch_compiles") or {}
    return worker.get("role") == "prefill" and b.get("done", 0) < b.get("total", 0)


class TandemLocal:
    """`tandem local` in a subprocess; `env` is added to its environment (TANDEM_* settings); `pin`
    is its own per-role `--pin`, `cpus` a taskset of the whole cluster. `ready_timeout`: `tandem
    local --ready-timeout` (seconds it waits for every pod's warm-up; None: its default, 180), and
    `start` waits that long plus a minute."""

    def __init__(self, name: str, model: str, *, colocated: bool, slots: int, max_len: int, pin: str,
                 env: dict[str, str], log_path: Path, cpus: str = "", root: Path = ROOT,
                 ready_timeout: float | None = None, extra_args: list[str] | None = None) -> None:
        self.name, self.model, self.colocated, self.slots = name, model, colocated, slots
        self.root = Path(root)  # the checkout whose code runs (bench/burst.py --old-root: another commit's)
        self.max_len, self.pin, self.env, self.log_path = max_len, pin, env, log_path
        self.cpus = cpus  # taskset -c on the launcher (and so every child), when given
        self.ready_timeout = ready_timeout
        self.extra_args = list(extra_args or [])  # `tandem local` flags after the ones this class gives
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.compile_wait_s = 0.0  # how long `start` waited for the prefill pods' batched compiles

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "tandem.cli", "local", "--model", self.model, "--port", str(self.port),
               "--grpc-port", str(free_port()), "--slots", str(self.slots), "--max-len", str(self.max_len),
               "--log-level", "WARNING"]
        if self.ready_timeout is not None:
            cmd += ["--ready-timeout", f"{self.ready_timeout:g}"]
        if self.pin:
            cmd += ["--pin", self.pin]
        cmd += ["--colocated"] if self.colocated else ["--prefill", "1", "--decode", "1"]
        cmd += self.extra_args
        return ["taskset", "-c", self.cpus, *cmd] if self.cpus else cmd

    def start(self, timeout_s: float | None = None, settle: bool = True) -> None:
        """Start and wait for "Tandem is serving"; with `settle` (every steady-state benchmark)
        also for the prefill pods' batched compiles (`wait_for_batch_compiles`, within the same
        deadline; the wait in `compile_wait_s`). bench/cold_start.py, which times start to
        serving, passes False."""
        timeout_s = max(300.0, (self.ready_timeout or 0.0) + 60.0) if timeout_s is None else timeout_s
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(self.command(), cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "Tandem is serving" in self.log_path.read_text():
                if settle:
                    self.compile_wait_s = self.wait_for_batch_compiles(max(1.0, deadline - time.monotonic()))
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem local exited with code {self.proc.returncode}: {self.tail()}")
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"tandem local did not come up within {timeout_s:.0f}s: {self.tail()}")

    def wait_for_batch_compiles(self, timeout_s: float) -> float:
        """Seconds waited until every prefill pod has compiled its batched prefill shapes (its
        heartbeat's `batch_compiles` in /admin/cluster, done == total): a prefill pod reports ready
        before them and compiles them on a thread beside serving, so a run started sooner measures
        those compiles (with an empty compilation cache, after any change to the engine's code:
        seen 2026-12-06 as a prefill pod's CPU per token 6-9x its steady value in three runs). A
        colocated cluster has none: 0. TimeoutError past `timeout_s`."""
        t0 = time.monotonic()
        while True:
            with urllib.request.urlopen(self.base_url + "/admin/cluster", timeout=10) as r:
                workers = json.load(r)["workers"]
            pending = [w["id"] for w in workers if _compiling(w)]
            if not pending:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"prefill pods {pending} had not compiled their batched prefills in {timeout_s:.0f}s")
            time.sleep(0.5)

    def tail(self, n: int = 10) -> str:
        return " | ".join(self.log_path.read_text().strip().splitlines()[-n:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class External:
    """An OpenAI-compatible server someone else runs (`bench/serve.py --url`)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def start(self) -> None:
        model_id(self.base_url)  # fails fast when nothing answers

    def stop(self) -> None:
        pass

    def tail(self) -> str:
        return ""


def model_id(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


async def warm_up(base_url: str, model: str, specs: list[RequestSpec], slots: int, extra: dict) -> None:
    """One request per prompt bucket the workload uses, then `slots` at once (fills the batch)."""
    longest: dict[int, RequestSpec] = {}  # bucket -> the longest prompt of the workload in it
    for s in specs:
        b = next((b for b in BUCKETS if b >= s.prompt_len), 0)
        if s.prompt_len > longest.get(b, s).prompt_len or b not in longest:
            longest[b] = s
    warm = [RequestSpec(0.0, s.prompt_len, 4, "warm", s.prompt) for _, s in sorted(longest.items())]
    prompt = specs[0].prompt
    await run_load(base_url, model, warm, concurrency=1, extra=extra)
    batch = [RequestSpec(0.0, len(prompt), 8, "warm", prompt) for _ in range(slots)]
    await run_load(base_url, model, batch, concurrency=slots, extra=extra)


def run_bare(model: str, slots: int, max_len: int, specs: list[RequestSpec], cpus: str | None,
             timeout_s: float = 600.0) -> dict:
    """bench/bare.py on the same requests in a subprocess (pinned to `cpus` when given)."""
    with tempfile.TemporaryDirectory() as d:
        spec_file, out_file = Path(d) / "specs.json", Path(d) / "out.json"
        spec_file.write_text(json.dumps([[s.prompt, s.output_len] for s in specs]))
        cmd = [sys.executable, str(ROOT / "bench" / "bare.py"), "--model", model, "--slots", str(slots),
               "--max-len", str(max_len), "--specs", str(spec_file), "--out", str(out_file)]
        if cpus:
            cmd = ["taskset", "-c", cpus, *cmd]
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
        return json.loads(out_file.read_text())
