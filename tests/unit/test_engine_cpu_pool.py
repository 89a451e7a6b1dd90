"""`engine.cpu_threads`: XLA's CPU pool gets that many threads, and the process keeps all its CPUs
(run in a fresh interpreter: a JAX backend starts once per process).

The canary for tandem_engine/cpu_pool.py, which uses behaviour JAX does not promise (the CPU
client sizing its pool from the affinity mask at creation; `jax._src.xla_bridge`). If a JAX
upgrade fails these tests, `engine.cpu_threads` no longer does what it says: find the new way (or
drop the setting), then move the jax pin in pyproject.toml."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, os, sys
from tandem_engine.cpu_pool import limit_cpu_threads
took = limit_cpu_threads(int(sys.argv[1]))
import jax.numpy as jnp
(jnp.ones((512, 512)) @ jnp.ones((512, 512))).block_until_ready()
print(json.dumps({"took": took, "threads": len(os.listdir("/proc/self/task")),
                  "cpus": sorted(os.sched_getaffinity(0)), "again": limit_cpu_threads(1)}))
"""
UPGRADE = ("tandem_engine/cpu_pool.py no longer sizes XLA's CPU thread pool on this JAX ({version}): "
           "{what}. Check limit_cpu_threads against this JAX, then move the jax pin in pyproject.toml.")


def _run(n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(n)], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_private_hook_is_there():
    import jax
    from jax._src import xla_bridge

    assert callable(getattr(xla_bridge, "backends_are_initialized", None)), UPGRADE.format(
        version=jax.__version__, what="jax._src.xla_bridge.backends_are_initialized is gone")


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _p: [])(0)) < 2, reason="needs 2 CPUs")
def test_fewer_threads_and_every_cpu_kept():
    import jax

    default, one = _run(0), _run(1)
    assert not default["took"] and one["took"]
    # Counted by the process's threads, not by XLA's thread names: the behaviour, not its internals.
    assert one["threads"] < default["threads"], UPGRADE.format(
        version=jax.__version__, what=f"{one['threads']} threads with cpu_threads=1, {default['threads']} without")
    assert one["cpus"] == sorted(os.sched_getaffinity(0))  # the narrow mask was only for the start
    assert one["again"] is False  # a running backend cannot be resized: refused, not pretended
