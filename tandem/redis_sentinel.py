"""Redis Sentinel on loopback, as real processes: one shard (a primary and its replicas) watched by
sentinels, for the tests and benchmarks of failover (tests/integration/test_sentinel.py,
tests/e2e/test_sentinel_failover.py). `tandem local --redis-sentinel` is pointed at one.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time

from tandem.redis_proc import RedisProcess, node_info, redis_binary, wait_until


class SentinelGroup:
    """One Redis shard under Redis Sentinel, as real processes on loopback: a primary, `replicas`
    replicas (`--replicaof`) and `sentinels` sentinels (`redis-server <conf> --sentinel`, one
    config file each, which they rewrite as they learn the topology). Detection is fast for
    tests (`down_after_ms`), so a SIGKILLed primary is replaced within a few seconds.

    `start()` returns once every sentinel sees the primary, every replica and every other
    sentinel (a failover needs the quorum to agree, and a leader elected among known peers).
    `stop()` ends every process it started, by PID. Logs are in `dir`.
    """

    def __init__(self, master_name: str = "tandem", replicas: int = 1, sentinels: int = 3, quorum: int = 2,
                 down_after_ms: int = 1000, failover_timeout_ms: int = 3000, dir: str | None = None) -> None:
        self.master_name = master_name
        self.quorum, self.down_after_ms, self.failover_timeout_ms = quorum, down_after_ms, failover_timeout_ms
        self.dir = dir or tempfile.mkdtemp(prefix="tandem-sentinel-")
        self.primary = self._node("primary", [])
        self.replicas = [self._node(f"replica-{i}", ["--replicaof", "127.0.0.1", str(self.primary.port)])
                         for i in range(replicas)]
        self.sentinel_procs = [RedisProcess(dir=self.dir) for _ in range(sentinels)]
        self.last_kill: dict = {}

    def _node(self, name: str, args: list[str]) -> RedisProcess:
        log = os.path.join(self.dir, f"{name}.log")
        return RedisProcess(dir=self._subdir(name), extra_args=[*args, "--loglevel", "notice", "--logfile", log])

    def _subdir(self, name: str) -> str:
        path = os.path.join(self.dir, name)
        os.makedirs(path, exist_ok=True)
        return path

    @property
    def hosts(self) -> list[str]:
        """The sentinels' addresses, as `redis.sentinel.hosts` wants them."""
        return [f"127.0.0.1:{s.port}" for s in self.sentinel_procs]

    @property
    def nodes(self) -> list[RedisProcess]:
        return [self.primary, *self.replicas]

    def start(self, timeout_s: float = 30.0) -> "SentinelGroup":
        try:
            for node in self.nodes:
                node.start()
            deadline = time.monotonic() + timeout_s
            for r in self.replicas:  # sentinels learn replicas from the primary's INFO: link them first
                wait_until(lambda r=r: node_info(r.port, "replication").get("master_link_status") == "up",
                           deadline, f"replica {r.port} did not sync with the primary")
            for s in self.sentinel_procs:
                self._start_sentinel(s)
            want = (self.primary.port, len(self.replicas), len(self.sentinel_procs) - 1)
            for s in self.sentinel_procs:
                wait_until(lambda s=s: self._sentinel_view(s.port) == want, deadline,
                           f"sentinel {s.port} did not see the primary, {want[1]} replicas and {want[2]} peers")
        except BaseException:
            self.stop()
            raise
        return self

    def add_sentinel(self, extra_conf: str = "", timeout_s: float = 10.0) -> RedisProcess:
        """One more sentinel of this primary, with extra config lines (e.g. `requirepass x`);
        returned once it listens, stopped with the group."""
        s = RedisProcess(dir=self.dir)
        self.sentinel_procs.append(s)
        self._start_sentinel(s, extra_conf)
        deadline = time.monotonic() + timeout_s
        wait_until(lambda: _listening(s.port), deadline, f"sentinel {s.port} did not listen")
        return s

    def _start_sentinel(self, s: RedisProcess, extra_conf: str = "") -> None:
        conf = os.path.join(self.dir, f"sentinel-{s.port}.conf")
        with open(conf, "w") as f:
            f.write(f"port {s.port}\nbind 127.0.0.1\ndaemonize no\ndir {self.dir}\n"
                    f"logfile {os.path.join(self.dir, f'sentinel-{s.port}.log')}\n"
                    f"sentinel monitor {self.master_name} 127.0.0.1 {self.primary.port} {self.quorum}\n"
                    f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
                    f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}\n"
                    f"sentinel parallel-syncs {self.master_name} 1\n{extra_conf}")
        s.proc = subprocess.Popen([redis_binary(), conf, "--sentinel"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)

    def _sentinel_view(self, port: int) -> tuple[int, int, int] | None:
        """(primary port, replicas, other sentinels) as one sentinel sees them."""
        m = _sentinel_master(port, self.master_name)
        if not _healthy(m):
            return None
        return int(m["port"]), int(m["num-slaves"]), int(m["num-other-sentinels"])

    def master_port(self) -> int | None:
        """The primary's port as the sentinels' majority reports it (None: no majority yet)."""
        votes: dict[int, int] = {}
        for s in self.sentinel_procs:
            m = _sentinel_master(s.port, self.master_name)
            if _healthy(m):
                votes[int(m["port"])] = votes.get(int(m["port"]), 0) + 1
        best = max(votes.items(), key=lambda kv: kv[1], default=(None, 0))
        return best[0] if best[1] >= self.quorum else None

    def kill_primary(self) -> int:
        """SIGKILL the current primary (no shutdown, no last flush); returns its port.

        `last_kill` keeps the evidence of what replication had carried: the primary's replication
        offset just before the kill and each replica's just after (bytes of the write stream; a
        replica behind by N bytes at most lost N bytes of writes, those that came in between)."""
        port = self.master_port() or self.primary.port
        node = next(n for n in self.nodes if n.port == port)
        before = node_info(port, "replication").get("master_repl_offset")
        os.kill(node.pid, signal.SIGKILL)
        node.proc.wait()
        after = {n.port: node_info(n.port, "replication").get("slave_repl_offset") for n in self.nodes if n is not node}
        self.last_kill = {"primary": port, "primary_offset_before": before, "replica_offsets_after": after}
        return port

    def wait_promoted(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Block until the sentinels report a primary other than `old_port`, and it answers as one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self.master_port()
            if port not in (None, old_port) and node_info(port, "replication").get("role") == "master":
                return port
            time.sleep(0.05)
        raise TimeoutError(f"no replica was promoted within {timeout_s}s of losing primary {old_port}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in [*self.nodes, *self.sentinel_procs] if p.proc and p.proc.poll() is None]

    def stop(self) -> None:
        for p in [*self.sentinel_procs, *self.nodes]:
            p.stop()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _sentinel_master(port: int, name: str) -> dict | None:
    import redis

    try:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1) as r:
            return r.sentinel_master(name)
    except (redis.RedisError, OSError):
        return None


def _healthy(m: dict | None) -> bool:
    """A sentinel's view of its master: a master, and not (subjectively or objectively) down."""
    return bool(m) and m["is_master"] and not (m["is_sdown"] or m["is_odown"])
