"""Shared fixtures: a real Redis (a container of the Redis image built here, docker/redis.Dockerfile,
when a Docker engine is reachable and holds it; else a real `redis-server` binary on a free
loopback port) and a real Redis Cluster (redis-server processes in cluster mode), killed by PID in
teardown."""
from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


CACHE_MAX_BYTES = 2 << 30  # a cache folder grown past this (old code's entries) is emptied at the start


def _use_compile_cache() -> None:
    """JAX's persistent compilation cache for the test session, on by default.

    `_free_compiled_code` below drops every compiled executable after each module, and most engine
    modules build the same few shapes (the `tiny` and `builtin` presets at a handful of sizes), so
    without a cache the suite compiled the same steps again module after module; the subprocess
    tests (tp 2 and 4 on host devices) and the clusters of tests/e2e compiled theirs in every child.
    With it, a module, a child process or a later run loads what was compiled before: the same
    executable, so the same numbers (the cache key is the lowered program, the compile options, the
    device and the jax version). Set through the environment so that children inherit it.

    TANDEM_TEST_COMPILE_CACHE: the folder (default: $XDG_CACHE_HOME or ~/.cache, then
    tandem/jax-tests; kept across runs, so a second run of a module compiles almost nothing);
    "" turns the cache off (a cold run, e.g. to time the compiles themselves)."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem", "jax-tests")
    path = os.environ.get("TANDEM_TEST_COMPILE_CACHE", default)
    if not path:
        return
    settings = {"JAX_COMPILATION_CACHE_DIR": path,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # every compile: most take under a second
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    try:
        os.makedirs(path, exist_ok=True)
        entries = list(os.scandir(path))
        if sum(e.stat().st_size for e in entries if e.is_file()) > CACHE_MAX_BYTES:
            for e in entries:  # jax's own bound rescans the folder on every write; start afresh instead
                if e.is_file():
                    os.unlink(e.path)
    except OSError:  # a read-only home: compile every time
        return
    for key, value in settings.items():
        os.environ.setdefault(key, value)
    if "jax" in sys.modules:  # a plugin imported it first: its config already read the environment
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
        jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                          int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


_use_compile_cache()

# testcontainers' reaper (Ryuk) is an image on Docker Hub; nothing here pulls: each fixture
# removes its own containers.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from tandem.redis_cluster import RedisClusterProcess
from tandem.redis_proc import RedisProcess, docker_reachable


def _pings(url: str) -> bool:
    import redis

    try:
        with redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1) as r:
            return bool(r.ping())
    except redis.RedisError:
        return False


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """After each test module, drop JAX's compiled executables (and the engines the module let go).

    Every XLA:CPU executable maps its code into this process (a model's step: hundreds of maps), and
    JAX keeps each one for the life of the process. Over the whole suite in one pytest process they
    reached the kernel's `vm.max_map_count` (65,530 here): mmap then fails inside XLA or malloc and
    the process dies with a segmentation fault (CI, 2026-12-04: the core held 65,532 maps).
    If a module still leaves most of the limit mapped, fail here, naming it, rather than crash later."""
    yield
    if "jax" not in sys.modules:
        return
    import jax

    jax.clear_caches()
    gc.collect()
    maps, limit = _memory_maps(), _max_map_count()
    if limit and maps > 0.75 * limit:
        pytest.fail(f"this pytest process holds {maps:,} memory maps of the kernel's vm.max_map_count "
                    f"{limit:,} after its module's compiled code was dropped: something keeps engines or "
                    "compiled functions alive across modules (a module global, a cache); the next "
                    "compiles would crash the process", pytrace=False)


def local_redis_image() -> str | None:
    """The Redis image built here (docker/redis.Dockerfile: Debian's redis-server on the Tandem
    base image, `make images`) when a Docker engine answers and holds it; None otherwise. Only a
    local image: nothing in the suite pulls (there may be no registry to pull from)."""
    if os.environ.get("TANDEM_TEST_NO_DOCKER") or not docker_reachable():
        return None
    import docker

    from tests.containers.stack import IMAGES

    client = docker.from_env(timeout=5)
    try:
        client.images.get(IMAGES["redis"])
        return IMAGES["redis"]
    except docker.errors.ImageNotFound:
        return None
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis: a container of the locally built Redis image when there is one (see
    local_redis_image), else a redis-server process on a free loopback port."""
    image = local_redis_image()
    if image:
        from testcontainers.core.container import DockerContainer

        from tandem.redis_proc import wait_until

        c = DockerContainer(image).with_exposed_ports(6379)
        c.start()
        try:
            # The container's own address on Docker's bridge when this host reaches it (Linux, a
            # local engine): no userland proxy between the tests and Redis; else the published port.
            w = c.get_wrapped_container()
            w.reload()
            ip = w.attrs["NetworkSettings"]["IPAddress"]
            urls = ([f"redis://{ip}:6379/0"] if ip else []) + [
                f"redis://{c.get_container_host_ip()}:{c.get_exposed_port(6379)}/0"]
            wait_until(lambda: any(map(_pings, urls)), time.monotonic() + 30, f"{image} did not answer PING")
            yield next(u for u in urls if _pings(u))
        finally:
            c.stop()
        return
    proc = RedisProcess().start()
    try:
        yield proc.url
    finally:
        proc.close()


@pytest.fixture(scope="session")
def redis_cluster():
    """A Redis Cluster of 3 masters and 3 replicas on loopback (tandem.redis_cluster.RedisClusterProcess),
    SIGKILLed by PID at the end of the session. Shared: use keys of your own or call `flushall()`,
    and a test that kills a node calls `heal()` in its teardown, so the next one finds the cluster whole."""
    cluster = RedisClusterProcess(masters=3, replicas_per_master=1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(redis_cluster) -> str:
    """redis://127.0.0.1:PORT of one node (a master at start): what `redis.url` gets with `redis.cluster`."""
    return redis_cluster.url


@pytest.fixture
async def redis_client(redis_url):
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    await r.flushdb()
    try:
        yield r
    finally:
        await r.aclose()


@pytest.fixture(params=["redis", "redis-cluster"])
async def any_redis(request):
    """A test twice: on the plain Redis (one key shard), then on the Redis Cluster (16 key
    shards, every script and transaction single-slot or CROSSSLOT), each client built by
    `conn.connect` as the services build theirs, every key deleted first."""
    from tandem_core.bus import conn
    from tandem_core.settings import RedisConfig

    if request.param == "redis":
        cfg = RedisConfig(url=request.getfixturevalue("redis_url"))
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        cfg = RedisConfig(url=cluster.url, cluster=True)
    r = conn.connect(cfg)
    await r.ping()  # before concurrent use, as the services do (redis-py's cluster client: gateway/app.py)
    if request.param == "redis":
        await r.flushdb()
    try:
        yield r
    finally:
        await r.aclose()


@pytest.fixture
def any_keys(any_redis):
    """The key space of `any_redis`, as its services would build it from their settings
    (`KeySpace(redis.shard_count())`): one shard on the plain Redis, 16 on the Redis Cluster."""
    from redis.asyncio.cluster import RedisCluster

    from tandem_core.keys import KeySpace

    return KeySpace(16 if isinstance(any_redis, RedisCluster) else 1)
