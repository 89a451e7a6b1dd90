"""Process supervision for `tandem local`, the way the kubelet treats a pod's containers:
a child that exits is restarted (same name, same environment, so the same worker id) after an
exponential back-off; one that keeps crashing stops the cluster with its exit code in the log.
A child that exits with EXIT_CONFIG (78: it cannot start with its configuration, see
tandem_core/exits.py) is not restarted: the cluster stops at once with the line it wrote to its
termination log (`TANDEM_TERMINATION_LOG`, a file per child in the supervisor's folder)."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from tandem_core.exits import EXIT_CONFIG, TERMINATION_LOG_ENV

log = logging.getLogger("tandem.local")


class ConfigExit(RuntimeError):
    """A child stopped on its configuration: restarting it would fail the same way."""


@dataclass
class Child:
    name: str
    module: str
    env: dict[str, str]
    preexec: Callable[[], None] | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    crashes: list[float] = field(default_factory=list)  # exit times within the crash window
    restart_at: float = 0.0
    retiring: bool = False  # asked to drain and leave (a scale-down): not restarted when it exits

    def start(self) -> None:
        # Own session: the terminal's Ctrl-C reaches only the launcher, which stops the children
        # in order. The preexec hook still takes a child down if the launcher is killed.
        self.proc = subprocess.Popen([sys.executable, "-m", self.module], env=self.env, start_new_session=True,
                                     preexec_fn=self.preexec)
        log.info("started %s pid=%d", self.name, self.proc.pid)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, max_crashes: int = 5, window_s: float = 60.0, backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0) -> None:
        self.children: list[Child] = []
        self.max_crashes, self.window_s = max_crashes, window_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s

        self._logs: str | None = None  # the children's termination logs (a folder made on the first add)

    def add(self, child: Child) -> None:
        if self._logs is None:
            self._logs = tempfile.mkdtemp(prefix="tandem-exit-")
        child.env = {**child.env, TERMINATION_LOG_ENV: os.path.join(self._logs, child.name)}
        self.children.append(child)
        child.start()

    def _why(self, c: Child) -> str:
        try:
            with open(c.env[TERMINATION_LOG_ENV], encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return "(it wrote no termination message; see its log above)"

    def tick(self, restart_redis: Callable[[], None] | None = None, redis_alive: bool = True) -> None:
        """Restart what has exited; raise RuntimeError on a crash loop."""
        now = time.monotonic()
        if not redis_alive and restart_redis:
            log.warning("redis exited; restarting it on the same port with its data")
            restart_redis()
        for c in list(self.children):
            if c.proc is None:
                if now >= c.restart_at:
                    c.start()
                continue
            code = c.proc.poll()
            if code is None:
                continue
            if c.retiring:
                log.info("%s (pid %d) drained and exited with code %s", c.name, c.proc.pid, code)
                self.children.remove(c)
                continue
            if code == EXIT_CONFIG:
                raise ConfigExit(f"{c.name} (pid {c.proc.pid}) stopped on its configuration (exit code {code}), "
                                 f"so it is not restarted: {self._why(c)}")
            c.crashes = [t for t in c.crashes if now - t < self.window_s] + [now]
            if len(c.crashes) > self.max_crashes:
                raise RuntimeError(f"{c.name} exited {len(c.crashes)} times within {self.window_s:.0f}s "
                                   f"(last exit code {code}); giving up")
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (len(c.crashes) - 1))
            log.warning("%s (pid %d) exited with code %s; restarting in %.1fs", c.name, c.proc.pid, code, delay)
            c.proc, c.restarts, c.restart_at = None, c.restarts + 1, now + delay

    def retire(self, name: str) -> None:
        """Scale-down: SIGTERM the child (it drains: a prefill pod keeps its held KV until pulled,
        a decode pod finishes its requests) and let it go when it exits."""
        for c in self.children:
            if c.name == name and not c.retiring:
                c.retiring = True
                if c.running():
                    c.proc.send_signal(signal.SIGTERM)
                    log.info("retiring %s (pid %d): draining", c.name, c.proc.pid)
                else:
                    self.children.remove(c)
                return

    def active(self, prefix: str) -> list[Child]:
        """Children named `prefix-N` that are not retiring, in start order."""
        return [c for c in self.children if c.name.startswith(prefix + "-") and not c.retiring]

    def stop(self, grace_s: float) -> None:
        """SIGTERM the gateway first, then the rest in reverse start order; wait; SIGKILL stragglers."""
        order = sorted(reversed(self.children), key=lambda c: c.name != "gateway")
        for c in order:
            if c.running():
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs: killing", c.name, grace_s)
                c.proc.kill()
                c.proc.wait()
        if self._logs is not None:
            shutil.rmtree(self._logs, ignore_errors=True)
            self._logs = None
