"""A canary for the redis-py internals tandem_core/redis_client.py depends on, where redis-py has no
supported API for what it needs. pyproject.toml pins redis-py below the first version not checked;
on an upgrade, this file says which assumption broke (run it, then the cluster and Sentinel
integration tests, before raising the pin):

- `_NodesManager` replaces the class of the cluster client's `nodes_manager` (redis-py builds it
  inside RedisCluster.__init__ and offers no way to pass one): the subclass adds no slots, every
  refresh of the slot map goes through `NodesManager.initialize`, and a node that refuses CLUSTER
  SLOTS is reported as a bare RedisClusterException raised while handling its ResponseError.
- `_BoundedCluster` bounds the cluster client's connections by gating `execute_command` and
  `ClusterPipeline.execute` (public methods), relying on each node's pool raising rather than
  growing past `max_connections`, and on pipelines being built as `ClusterPipeline(client, transaction)`.
- `_BlockingSentinelPool` mixes SentinelConnectionPool with BlockingConnectionPool.
No Redis is needed: construction only, no command is sent.
"""
from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, NodesManager, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import MaxConnectionsError

from tandem_core import redis_client
from tandem_core.settings import RedisConfig

ROOT = Path(__file__).resolve().parents[2]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def test_the_installed_redis_py_is_inside_the_pin():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"redis\b", d) and not d.startswith("redis-"))
    upper = re.search(r"<\s*([\d.]+)", spec)
    assert upper, f"pyproject.toml's {spec!r} has no upper bound: redis_client.py relies on redis-py internals"
    assert _version(redis.__version__) < _version(upper.group(1)), (
        f"redis-py {redis.__version__} is past the pin {spec!r}: run this file and the cluster/Sentinel "
        "integration tests, then raise the pin")


def test_the_cluster_client_gets_the_slot_map_manager_and_the_gate():
    r = redis_client.connect(RedisConfig(url="redis://127.0.0.1:1", cluster=True, max_connections=5,
                                         socket_timeout_s=1, connect_timeout_s=0.2))
    assert isinstance(r, RedisCluster) and type(r).__name__ == "_BoundedCluster"
    assert type(r.nodes_manager) is redis_client._NodesManager, "the slot-map manager's class swap did not take"
    assert r.max_in_flight == 4  # the bound less one for the slot map's own connection
    assert isinstance(r.pipeline(transaction=False), ClusterPipeline)
    # every slot-map refresh goes through the manager's initialize (commands, pipelines, MULTI/EXEC)
    assert "nodes_manager.initialize(" in inspect.getsource(RedisCluster.initialize)
    assert list(inspect.signature(NodesManager.initialize).parameters)[:1] == ["self"]
    assert list(inspect.signature(ClusterPipeline.__init__).parameters)[1:3] == ["client", "transaction"]


def test_a_full_node_pool_raises_instead_of_growing():
    node = ClusterNode("127.0.0.1", 1, max_connections=2)
    node.acquire_connection(), node.acquire_connection()
    try:
        node.acquire_connection()
    except MaxConnectionsError:
        pass
    else:
        raise AssertionError("ClusterNode's pool grew past max_connections: redis_client._BoundedCluster's "
                             "gate assumes it raises (and MaxConnectionsError must stay a ConnectionError)")
    assert issubclass(MaxConnectionsError, redis.ConnectionError)


def test_a_refused_cluster_slots_is_a_bare_cluster_exception_over_a_response_error():
    src = inspect.getsource(NodesManager.initialize)
    assert re.search(r"except ResponseError:\s*raise RedisClusterException\(", src), (
        "NodesManager.initialize no longer reports a node refusing CLUSTER SLOTS as a RedisClusterException "
        "raised while handling its ResponseError: redis_client._NodesManager's check of a plain Redis "
        "(RedisConfigError) must follow")


def test_the_sentinel_pool_blocks():
    mro = redis_client._BlockingSentinelPool.__mro__
    assert mro.index(SentinelConnectionPool) < mro.index(BlockingConnectionPool)
    assert "get_connection" not in vars(SentinelConnectionPool), (
        "SentinelConnectionPool now has its own get_connection, which would bypass the blocking wait")
