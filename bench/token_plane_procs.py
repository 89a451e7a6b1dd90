"""bench/token_plane.py's processes: the Redis it measures, the role processes and their shared
Control, snapshots (Redis INFO, each process's CPU seconds), which cores each process ran on, and
py-spy profiles of a role process."""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.token_plane_roles import DRAIN, STOP, Control, PlaneConfig, gateway_main, publisher_main


def start_redis(cpus: list[int] | None = None):
    from tandem.redis_proc import RedisProcess

    redis = RedisProcess(maxmemory="4gb")
    if cpus:
        redis.preexec = lambda: os.sched_setaffinity(0, set(cpus))
    return redis.start()


class Roles:
    """The publisher and gateway processes of one run, and their shared Control."""

    def __init__(self, cfg: PlaneConfig, pin: dict) -> None:
        self.cfg, self.pin = cfg, pin
        self.ctx = mp.get_context("spawn")
        self.ctl = Control(self.ctx, cfg.publishers, cfg.gateways)
        self.procs: dict[str, mp.Process] = {}

    def start(self, subscribed: int, timeout_s: float = 120.0, on_wait=None) -> "Roles":
        cfg_json = self.cfg.to_json()
        for g in range(self.cfg.gateways):
            self.procs[f"gateway{g}"] = self.ctx.Process(
                target=gateway_main, args=(cfg_json, g, self.ctl, self.pin.get("gateways")), daemon=True)
        for p in range(self.cfg.publishers):
            self.procs[f"publisher{p}"] = self.ctx.Process(
                target=publisher_main, args=(cfg_json, p, self.ctl, self.pin.get("publishers")), daemon=True)
        for proc in self.procs.values():
            proc.start()
        deadline = time.monotonic() + timeout_s
        while sum(v.value for v in self.ctl.subscribed) < subscribed:
            self._check_alive()
            if on_wait is not None:
                on_wait(self)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateways subscribed {sum(v.value for v in self.ctl.subscribed)} "
                                   f"of {subscribed} streams in {timeout_s:.0f}s")
            time.sleep(0.05)
        return self

    def _check_alive(self) -> None:
        dead = [n for n, p in self.procs.items() if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited with {[self.procs[n].exitcode for n in dead]}")

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def counter(self, name: str) -> int:
        return sum(v.value for v in getattr(self.ctl, name))

    def lag(self) -> np.ndarray:
        return np.sum([np.frombuffer(a, dtype=np.int64) for a in self.ctl.lag], axis=0)

    def finish(self, timeout_s: float = 60.0) -> tuple[list[dict], list[dict]]:
        """Drain (no new requests; running ones write to their finish), wait until the gateways
        have seen every finish written (or the timeout), stop, and load every role's results."""
        self.ctl.phase.value = DRAIN
        deadline = time.monotonic() + timeout_s
        while not all(v.value for v in self.ctl.done) and time.monotonic() < deadline:
            self._check_alive()
            time.sleep(0.05)
        while self.counter("completed") < self.counter("finished") and time.monotonic() < deadline:
            self._check_alive()
            time.sleep(0.05)
        self.ctl.phase.value = STOP
        for p in self.procs.values():
            p.join(30)
            if p.exitcode is None:
                p.kill()
        self._check_alive()
        load = lambda name: dict(np.load(Path(self.cfg.out_dir) / f"{name}.npz"))  # noqa: E731
        return ([load(f"publisher{i}") for i in range(self.cfg.publishers)],
                [load(f"gateway{i}") for i in range(self.cfg.gateways)])

    def kill(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()


def snapshot(r, pids: dict[str, int]) -> dict:
    import psutil

    cpu = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            cpu[name] = t.user + t.system
        except psutil.Error:
            cpu[name] = float("nan")
    info = r.info("all")
    return {"t": time.monotonic(), "info": info, "cpu": cpu, "load_avg_1m": os.getloadavg()[0]}


class CoreSampler(threading.Thread):
    """Which core each process last ran on, sampled every `every_s` (psutil cpu_num), and each
    process's allowed cores (its affinity)."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        import psutil

        self.procs = {n: psutil.Process(p) for n, p in pids.items()}
        self.every_s = every_s
        self.counts: dict[str, dict[int, int]] = {n: {} for n in pids}
        self.affinity = {n: sorted(p.cpu_affinity()) for n, p in self.procs.items()}
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.every_s):
            for n, p in self.procs.items():
                try:
                    c = p.cpu_num()
                except Exception:  # noqa: BLE001 - gone
                    continue
                self.counts[n][c] = self.counts[n].get(c, 0) + 1

    def stop(self) -> dict:
        self._stop.set()
        return {"affinity": self.affinity, "last_cpu_samples": {n: {str(k): v for k, v in sorted(c.items())}
                                                                 for n, c in self.counts.items()}}


def _role(name: str) -> str:
    return name.rstrip("0123456789")


def cpu_by_role(s0: dict, s1: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, c1 in s1["cpu"].items():
        out[_role(name)] = out.get(_role(name), 0.0) + c1 - s0["cpu"].get(name, c1)
    return out


class Profiler:
    """py-spy (the venv's, when installed) sampling one process for `seconds`; `top()` reads its
    raw (collapsed) stacks: the functions holding most samples, by self time and in total."""

    def __init__(self, pid: int, seconds: float, path: Path, rate: int = 100) -> None:
        exe = Path(sys.executable).with_name("py-spy")
        self.path = path
        self.proc = None
        if exe.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            self.proc = subprocess.Popen([str(exe), "record", "-p", str(pid), "-d", str(max(1, int(seconds))),
                                          "-r", str(rate), "-f", "raw", "-o", str(path), "--nonblocking"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def top(self, n: int = 12, timeout_s: float = 60.0) -> dict | None:
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if not self.path.exists():
            return {"error": (self.proc.stderr.read() or b"").decode()[-300:]}
        return top_frames(self.path.read_text().splitlines(), n)


def top_frames(lines: list[str], n: int = 12) -> dict:
    """From py-spy raw lines (`frame;frame;... count`): the share of samples whose leaf is each
    function (self) and that hold it anywhere on the stack (total)."""
    own, total, samples = Counter(), Counter(), 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        samples += c
        frames = [_frame(f) for f in stack.split(";")]
        own[frames[-1]] += c
        for f in set(frames):
            total[f] += c
    share = lambda cnt: [(f, v / max(samples, 1)) for f, v in cnt.most_common(n)]  # noqa: E731
    # frames under which everything runs (the process's and the event loop's) say nothing in total time
    inner = Counter({f: v for f, v in total.items() if v < 0.8 * samples and f.split(" (")[0] not in _OUTER})
    # uvloop runs the loop in C: samples whose Python leaf is Runner.run are the loop's own work
    own = Counter({("event loop in C (uvloop)" if f.startswith("Runner.run ") else f): v for f, v in own.items()})
    return {"samples": samples, "self": share(own), "total": share(inner)}


_OUTER = {"<module>", "_main", "spawn_main", "BaseProcess._bootstrap", "BaseProcess.run", "gateway_main",
          "publisher_main", "Runner.run", "run_until_complete", "run_forever", "_run_once", "Handle._run"}


def _frame(f: str) -> str:
    """`func (path/to/file.py:12)` -> `func (file.py)`."""
    name, _, where = f.partition(" (")
    return f"{name} ({os.path.basename(where.rsplit(':', 1)[0])})" if where else name
