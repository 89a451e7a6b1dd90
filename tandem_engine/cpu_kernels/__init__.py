"""Tandem's own kernels for XLA's CPU backend, called through JAX's FFI (`jax.ffi.ffi_call`).

One kernel today: paged decode attention read where the pool's blocks lie
(`paged_attention.cc`; paged.py calls it for a CPU compile of the paged step). XLA's own ops
cannot read a block table in place on a CPU: a gather copies every block it reads before the dots
read it again (what attention.paged_attention does, and still does where this kernel is not there).

The source ships with the package and is compiled on first use with the machine's C++ compiler
(`CXX`, else `c++`/`g++`) against the FFI headers jaxlib ships (`jax.ffi.include_dir()`), into
`TANDEM_KERNEL_CACHE` (default: ~/.cache/tandem/kernels, else the temp directory). The library's
name carries a hash of the source, the flags, jaxlib's version and the CPU's feature flags
(`-march=native`), so a cache on a volume shared by other machines or versions never loads a
library built for another. `TANDEM_KERNEL_MARCH=x86-64-v3` (or -v2, -v4) builds for a named level
instead, the same library on every machine (the CPU worker image ships one built so, in its
`TANDEM_KERNEL_CACHE`), used only where the CPU has that level's features. Processes starting together (`tandem local`) may both compile; each
writes its own file and renames it into place. `TANDEM_CPU_KERNELS=0` turns the kernels off.
Where no compiler is found or the build fails, `paged_attention_kernel()` returns None, once
logged as a warning with the reason, and the engine keeps the XLA path (slower, same results).

No I/O at import; the build happens on the first call that asks for a kernel.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cc")
TARGET = "tandem_paged_attention"
# Compiled, then linked in a second command. -fopenmp-simd: the dot products' reductions vectorize
# (no OpenMP runtime, no threads); -ffast-math: expf vectorizes too (glibc's vector math; the source
# keeps every value finite, as it then must). Never -ffast-math at link time: GCC then links
# crtfastmath.o, whose constructor turns on flush-to-zero and denormals-are-zero for the whole
# process when the library loads (every thread's numpy and XLA arithmetic after it; hypothesis's
# float strategies refused to run in the gateway's fuzz tests because of it).
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-ffast-math", "-fopenmp-simd")
LINK_FLAGS = ("-shared",)
# TANDEM_KERNEL_MARCH: a named x86-64 level instead of this machine's own (-march=native), for a
# library built once and shipped (docker/worker-cpu.Dockerfile: x86-64-v3); such a library is used
# only on a CPU with the features the level needs (else: the gather path, logged).
LEVEL_FEATURES = {"x86-64-v2": ("sse4_2", "popcnt", "ssse3"),
                  "x86-64-v3": ("avx2", "fma", "bmi2", "movbe", "f16c"),
                  "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")}


def _march() -> str:
    return os.environ.get("TANDEM_KERNEL_MARCH") or "native"


def _flags() -> tuple[str, ...]:
    return (*FLAGS, f"-march={_march()}")
BUILD_TIMEOUT_S = 300.0

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    env = os.environ.get("TANDEM_KERNEL_CACHE")
    if env:
        return Path(env)
    home = Path.home() / ".cache" / "tandem" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "tandem-kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def library_path() -> Path:
    """Where the compiled library for this source, jaxlib, flags and CPU is (built or not)."""
    import jaxlib

    key = hashlib.sha256()
    march = _march()  # a named level builds the same library on any machine: the CPU is not in the key
    for part in (SOURCE.read_bytes(), " ".join((*_flags(), *LINK_FLAGS)).encode(), jaxlib.__version__.encode(),
                 (_cpu_flags() if march == "native" else march).encode()):
        key.update(part)
    return _cache_dir() / f"tandem_cpu_kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernels (if not already built) and return the library's path; RuntimeError
    with the compiler's message when that fails."""
    out = library_path()
    march = _march()
    missing = [f for f in LEVEL_FEATURES.get(march, ()) if f not in _cpu_flags().split()]
    if missing:
        raise RuntimeError(f"the kernels are built for {march} (TANDEM_KERNEL_MARCH) and this CPU lacks "
                           f"{', '.join(missing)}")
    if out.exists():
        return out
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    obj = tmp[:-len(".so")] + ".o"
    steps = ([cxx, *_flags(), f"-I{jax.ffi.include_dir()}", "-c", str(SOURCE), "-o", obj],
             [cxx, *LINK_FLAGS, obj, "-o", tmp])  # linked without -ffast-math: no crtfastmath.o
    try:
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp made it 0600: readable by every user (an image's runtime uid too)
        os.replace(tmp, out)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    log.info("built Tandem's CPU kernels: %s", out)
    return out


def _load() -> bool:
    """Build, load and register the kernels once per process; False (logged once) where they are
    off or cannot be built."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
            log.info("Tandem's CPU kernels are off (TANDEM_CPU_KERNELS=0): paged attention gathers on XLA")
        else:
            try:
                lib = ctypes.cdll.LoadLibrary(str(build()))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.TandemPagedAttention), platform="cpu")
                _state["lib"] = lib  # keep the library loaded
                ok = True
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                log.warning("Tandem's CPU paged-attention kernel is not available, the paged step gathers on XLA "
                            "instead (slower, same results): %s", e)
        _state["ok"] = ok
        return ok


def paged_attention_kernel() -> Callable | None:
    """The kernel as a function of JAX arrays, or None where it is not available (see the module
    docstring). The function: (q [rows, H, hd], k_layer, v_layer [KV, blocks, B, hd], table int32
    [rows, nb], positions int32 [rows], lengths int32 [rows], sinks float32 [H] | None, *, scale,
    softcap, window) -> float32 [rows, H, hd]. float32 or bfloat16 q and pool only."""
    if not _load():
        return None
    return _call


def _call(q, k_layer, v_layer, table, positions, lengths, sinks, *, scale: float, softcap: float, window: int):
    rows, heads, hd = q.shape
    has_sinks = sinks is not None
    sinks = jnp.zeros((heads,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, heads, hd), jnp.float32))
    return call(q, k_layer, v_layer, table.astype(jnp.int32), positions.astype(jnp.int32), lengths.astype(jnp.int32),
                sinks, scale=np.float32(scale), softcap=np.float32(softcap), window=np.int64(window),
                has_sinks=np.int64(has_sinks))
