"""A Redis Cluster on loopback, as real processes, for the tests and benchmarks that run the
services against one (tests/conftest.py's `redis_cluster`, tests/e2e/test_redis_cluster.py,
bench/token_plane.py's key placement).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import tempfile
import time

from tandem.redis_proc import RedisProcess, is_alive, node_info, wait_until


class RedisClusterProcess:
    """A Redis Cluster as real processes on loopback: `masters` masters sharing the 16384 hash
    slots evenly, each with `replicas_per_master` replicas; every node is a `redis-server
    --cluster-enabled yes` with its own nodes.conf in `dir`. The cluster is built from Python
    with the commands `redis-cli --cluster create` sends (ADDSLOTS, SET-CONFIG-EPOCH, MEET,
    REPLICATE), so no redis-cli is needed and start-up waits on exactly what tests rely on.

    `start()` returns once every node says cluster_state:ok, every node sees every other one
    with the same roles, and every replica has synced (a failover needs the masters to know the
    replica they vote for). Timeouts are low for tests: a SIGKILLed master (`kill_master`) is
    replaced by its replica within a few seconds (`wait_failover`); `heal()` restarts what was
    killed, and it rejoins as a replica. `stop()` SIGKILLs every node by PID and removes `dir`.
    """

    SLOTS = 16384

    def __init__(self, masters: int = 3, replicas_per_master: int = 1, node_timeout_ms: int = 2000,
                 dir: str | None = None) -> None:
        if masters < 1 or replicas_per_master < 0:
            raise ValueError(f"a cluster needs >= 1 master and >= 0 replicas each (got {masters}, {replicas_per_master})")
        self.n_masters, self.replicas_per_master = masters, replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        self.dir = dir or tempfile.mkdtemp(prefix="tandem-cluster-")
        self.nodes = [self._node() for _ in range(masters * (1 + replicas_per_master))]

    def _node(self) -> RedisProcess:
        port = _cluster_port()
        path = os.path.join(self.dir, str(port))
        os.makedirs(path, exist_ok=True)
        return RedisProcess(port=port, dir=path, maxmemory="256mb", extra_args=[
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",  # a replica may always take over (tests kill at will)
            "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",  # replicas sync at once
            "--loglevel", "notice", "--logfile", os.path.join(path, "redis.log")])

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT of the first live node, a master at start (any node serves to
        discover the cluster)."""
        node = next((n for n in self.nodes if is_alive(n)), self.nodes[0])
        return f"redis://127.0.0.1:{node.port}"

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes if is_alive(n)]

    def role(self, node: RedisProcess) -> str | None:
        """"master" or "slave" as the node itself says; None when it does not answer."""
        return node_info(node.port, "replication").get("role") if is_alive(node) else None

    def masters(self) -> list[RedisProcess]:
        """The live masters that own slots, in the order of their first slot (index 0 holds slot 0)."""
        firsts: dict[int, int] = {}
        for view in (self._view(n.port) for n in self.nodes if is_alive(n)):
            for entry in view.values():
                if entry["slots"] and entry["port"] not in firsts and "fail" not in entry["flags"]:
                    firsts[entry["port"]] = min(entry["slots"])
            if firsts:
                break
        live = {n.port: n for n in self.nodes if is_alive(n)}
        return [live[p] for p in sorted(firsts, key=firsts.get) if p in live]

    def start(self, timeout_s: float = 60.0) -> "RedisClusterProcess":
        try:
            for node in self.nodes:
                node.start()
            masters, replicas = self.nodes[:self.n_masters], self.nodes[self.n_masters:]
            for i, node in enumerate(masters):
                lo, hi = i * self.SLOTS // len(masters), (i + 1) * self.SLOTS // len(masters)
                _call(node.port, "CLUSTER", "ADDSLOTS", *range(lo, hi))
            for epoch, node in enumerate(self.nodes, 1):  # distinct epochs: no collision rounds
                _call(node.port, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
            for node in self.nodes[1:]:
                _call(node.port, "CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
            deadline = time.monotonic() + timeout_s
            everyone = {n.port for n in self.nodes}
            wait_until(lambda: all(self._connected(n.port) == everyone for n in self.nodes), deadline,
                                "the cluster nodes did not all meet")
            for j, node in enumerate(replicas):
                master_id = _call(masters[j % len(masters)].port, "CLUSTER", "MYID").decode()
                _call(node.port, "CLUSTER", "REPLICATE", master_id)
            self.wait_healthy(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until every node is up and says cluster_state:ok, all views agree on the roles, every
        master has its replicas and every replica has synced."""
        want = (self.n_masters, self.n_masters * self.replicas_per_master)
        wait_until(lambda: self._healthy(want), time.monotonic() + timeout_s,
                            f"the cluster in {self.dir} did not become healthy ({want[0]} masters, {want[1]} "
                            "synced replicas, cluster_state:ok everywhere): see the nodes' redis.log")

    def _healthy(self, want: tuple[int, int]) -> bool:
        if not all(is_alive(n) for n in self.nodes):
            return False
        views = [self._view(n.port) for n in self.nodes]
        roles = {(e["port"], e["master"]) for e in views[0].values()}
        if any({(e["port"], e["master"]) for e in v.values()} != roles for v in views[1:]):
            return False
        if any(e["flags"] & {"fail", "fail?", "handshake", "noaddr"} for v in views for e in v.values()):
            return False
        n_masters = sum(1 for e in views[0].values() if e["slots"])
        n_replicas = sum(1 for e in views[0].values() if e["master"])
        if (n_masters, n_replicas) != want or len(views[0]) != len(self.nodes):
            return False
        for node in self.nodes:
            info = node_info(node.port, "replication")
            if _cluster_state(node.port) != "ok" or info.get("role") == "slave" and (
                    info.get("master_link_status") != "up" or info.get("master_sync_in_progress")):
                return False
        return True

    def kill_master(self, i: int = 0) -> RedisProcess:
        """SIGKILL the live master holding the i-th slot range (no shutdown, nothing flushed);
        returns its node. Its replica takes over after `node_timeout_ms` (see `wait_failover`)."""
        node = self.masters()[i]
        os.kill(node.pid, signal.SIGKILL)
        node.proc.wait()
        return node

    def wait_failover(self, timeout_s: float = 30.0) -> list[RedisProcess]:
        """Until every live node says cluster_state:ok and every slot is owned by a live master
        (a replica promoted in place of each killed one); returns the masters."""
        def done() -> bool:
            live = {n.port for n in self.nodes if is_alive(n)}
            for port in live:
                view = self._view(port)
                owners = {e["port"] for e in view.values() if e["slots"]}
                covered = sum(len(e["slots"]) for e in view.values() if e["port"] in live)
                if not owners <= live or covered != self.SLOTS or _cluster_state(port) != "ok":
                    return False
            return True

        wait_until(done, time.monotonic() + timeout_s,
                            f"no replica took over the killed master's slots within {timeout_s}s")
        return self.masters()

    def heal(self, timeout_s: float = 60.0) -> None:
        """Restart every killed node on its port with its nodes.conf: it rejoins and, its slots
        now served by the promoted replica, becomes that node's replica. Returns once healthy."""
        for node in self.nodes:
            if not is_alive(node):
                node.start()
        self.wait_healthy(timeout_s)

    def flushall(self) -> None:
        """Empty every master (replicas follow): a clean cluster for the next test."""
        for node in self.masters():
            _call(node.port, "FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            if is_alive(node):
                os.kill(node.pid, signal.SIGKILL)
                node.proc.wait()
            node.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def _view(self, port: int) -> dict[str, dict]:
        """CLUSTER NODES as one node sees it: id -> port, flags, master id ("" for a master), slots."""
        try:
            text = _call(port, "CLUSTER", "NODES").decode()
        except Exception:  # noqa: BLE001 - down or busy: no view
            return {}
        out = {}
        for line in text.splitlines():
            f = line.split()
            slots: set[int] = set()
            for part in f[8:]:
                if not part.startswith("["):  # "[slot->-id]" = a migration in progress
                    lo, _, hi = part.partition("-")
                    slots.update(range(int(lo), int(hi or lo) + 1))
            out[f[0]] = {"port": int(f[1].split("@")[0].rpartition(":")[2]), "flags": set(f[2].split(",")),
                         "master": "" if f[3] == "-" else f[3], "slots": slots}
        return out

    def _connected(self, port: int) -> set[int]:
        """Ports of the nodes this one has met (past the handshake)."""
        return {e["port"] for e in self._view(port).values() if "handshake" not in e["flags"]}


_taken_ports: set[int] = set()


def _cluster_port() -> int:
    """A free port P with P+10000 (its cluster bus) free too, both below the ephemeral range
    (32768+), so an outgoing connection cannot take one between this check and the bind."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, 22768)
        if port in _taken_ports:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        _taken_ports.add(port)
        return port
    raise RuntimeError("no free port pair (P, P+10000) for a cluster node between 10000 and 32767")


def _cluster_state(port: int) -> str | None:
    """cluster_state from CLUSTER INFO ("ok" or "fail"); None when the node does not answer."""
    try:
        text = _call(port, "CLUSTER", "INFO").decode()
    except Exception:  # noqa: BLE001
        return None
    return dict(line.split(":", 1) for line in text.split()).get("cluster_state")


def _call(port: int, *args):
    import redis

    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=2) as r:
        return r.execute_command(*args)
