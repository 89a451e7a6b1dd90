"""How many threads XLA's CPU backend computes with.

XLA's CPU client sizes its intra-op thread pool from the CPUs the process may run on, once, when
the backend starts; this JAX has no option for it (`--xla_cpu_multi_thread_eigen=false` does not
shrink it). On a machine whose few cores are shared by several workers, a pool per worker of
every core spins idle threads against the others. Measured on 2 cores, 32 slots, the built-in
model (bench notes in bench/RESULTS.md): with one thread the decode pod spent 37% less CPU per
token at 8 concurrent streams and served 1.3x the tokens/s; at 32 it was within noise (measured
with the pod pinned to one CPU, which gives the same one-thread pool).

`limit_cpu_threads(n)` starts the CPU backend while the process is restricted to n of its CPUs,
then gives every thread (the pool's included) all of them back: the pool keeps n threads, the
scheduler may run them anywhere. It must run before anything else starts a JAX backend.

No supported API exists for either half (the pool's size, or whether a backend has started), so
this leans on two behaviours of the installed JAX: the CPU client sizes its pool from the affinity
mask when it is created, and `jax._src.xla_bridge.backends_are_initialized()`. pyproject.toml pins
jax below the next minor release, and tests/unit/test_engine_cpu_pool.py is the canary: it fails
with what to check when an upgrade changes either.
"""
from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)


def limit_cpu_threads(n: int) -> bool:
    """Start the CPU backend with an intra-op pool of `n` threads (0: XLA's default). Returns
    whether the limit took effect (False when a backend already started, or off Linux)."""
    if n <= 0 or not hasattr(os, "sched_setaffinity"):
        return False
    from jax._src import xla_bridge  # no public "has a backend started?" (see the module docstring)

    if xla_bridge.backends_are_initialized():
        log.warning("cpu_threads=%d ignored: a JAX backend is already running", n)
        return False
    allowed = os.sched_getaffinity(0)
    if n >= len(allowed):
        return False
    os.sched_setaffinity(0, set(sorted(allowed)[:n]))
    try:
        jax.devices("cpu")  # creates the CPU client and its pool under the narrow mask
    finally:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), allowed)
            except OSError:  # a thread that ended meanwhile
                pass
    return True
