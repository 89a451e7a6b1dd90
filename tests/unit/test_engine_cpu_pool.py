"""`engine.cpu_threads`: XLA's CPU pool gets that many threads, and the process keeps all its CPUs
(run in a fresh interpreter: a JAX backend starts once per process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, os
from tandem_engine.cpu_pool import limit_cpu_threads
took = limit_cpu_threads(1)
import jax.numpy as jnp
(jnp.ones((256, 256)) @ jnp.ones((256, 256))).block_until_ready()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps({"took": took, "pool": names.count("tf_XLAEigen"), "cpus": sorted(os.sched_getaffinity(0)),
                  "again": limit_cpu_threads(1)}))
"""


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _p: [])(0)) < 2, reason="needs 2 CPUs")
def test_one_pool_thread_and_every_cpu_kept():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["took"] and got["pool"] == 1
    assert got["cpus"] == sorted(os.sched_getaffinity(0))  # the narrow mask was only for the start
    assert got["again"] is False  # a running backend cannot be resized: refused, not pretended
