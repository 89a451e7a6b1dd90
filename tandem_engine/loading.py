"""Building an Engine: the persistent compilation cache, CPU threads, weights, tp."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import jax
from jax.sharding import Mesh

from tandem_core.models import resolve_model
from tandem_engine.cpu_pool import limit_cpu_threads
from tandem_engine.engine import DEFAULT_BUCKETS, Engine
from tandem_engine.engine_base import DEFAULT_KV_BLOCK_SIZE, DEFAULT_STEPS_PER_DISPATCH
from tandem_engine.quantize import check_quantize
from tandem_engine.sharding import make_layout
from tandem_engine.shards import Progress
from tandem_engine.weights import load_params

__all__ = ["load_engine", "use_compile_cache"]
log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 5.0


def _progress_log(name: str) -> Callable[[Progress], None]:
    """A progress callback that logs a line every PROGRESS_EVERY_S seconds of a long load."""
    last = [0.0]

    def report(p: Progress) -> None:
        if p.seconds - last[0] >= PROGRESS_EVERY_S:
            last[0] = p.seconds
            log.info("loading weights of %s: %s", name, p.line())

    return report


def use_compile_cache(path: str) -> None:
    """Keep compiled executables in `path` across processes (JAX's persistent cache, on every
    backend); every compilation is cached, however quick. "" leaves the cache off."""
    if not path:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home in a container: compile every time, say so once
        logging.getLogger(__name__).warning("compilation cache %s unusable (%s); compiling without it", path, e)
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load_engine(model: str = "builtin", *, slots: int = 4, max_len: int = 512,
                prefill_buckets: tuple[int, ...] = DEFAULT_BUCKETS, dtype: str = "float32",
                tp: int = 1, mesh: Mesh | None = None, compile_cache_dir: str = "",
                cpu_threads: int = 0, prefix_chunk: int = 64, expert_parallel: bool = False,
                steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH,
                kv_block_size: int = DEFAULT_KV_BLOCK_SIZE, kv_blocks: int | None = None,
                quantize: str | None = None, kv_reuse: bool = True, kv_dtype: str | None = None,
                kv_window_group: bool = True) -> Engine:
    """An Engine for a preset name ("builtin": the shipped trained checkpoint; "tiny", "small-100m":
    random weights) or a HF directory of a served family (tandem_engine/arch.py).

    tp > 1 splits weights and KV over the first tp devices; or pass a `mesh` with a "tp" axis.
    num_kv_heads and intermediate_size must be divisible by tp (ValueError otherwise, checked
    before any weight is read). `expert_parallel`: a mixture of experts splits whole experts
    across the tp devices (the expert count must be divisible by tp) instead of each expert's
    hidden units. `kv_block_size`, `kv_blocks`: the KV pool's blocks (engine_decode.DecodeSide;
    `kv_reuse`: finished rows' blocks shared by later sequences, block_cache.py; `kv_window_group`:
    windowed layers beside global ones keep only their window's blocks, paged.WindowGroup, and then
    nothing is reused). `quantize="int8"`:
    the layer matrices held as int8 with per-output-channel scales (tandem_engine/quantize.py); the
    KV stays in `dtype` unless `kv_dtype="fp8"`."""
    check_quantize(quantize)  # fail fast on an unknown mode, before any weight is read
    use_compile_cache(compile_cache_dir)
    limit_cpu_threads(cpu_threads)  # before anything starts a backend
    info = resolve_model(model)
    if tp == 0:  # all local devices (the chips of this TPU host)
        tp = len(jax.devices())
    layout = make_layout(info, tp, mesh, expert_parallel)  # fail fast on a bad tp
    t0 = time.monotonic()
    params = load_params(info, dtype, layout=layout, quantize=quantize, progress=_progress_log(info.name))
    if info.path:
        log.info("weights of %s loaded in %.1fs (%s, tp=%d%s)", info.name, time.monotonic() - t0, dtype,
                 1 if layout is None else layout.tp, ", int8" if quantize else "")
    return Engine(info, params, slots=slots, max_len=max_len, prefill_buckets=prefill_buckets,
                  dtype=dtype, tp=tp, mesh=mesh, prefix_chunk=prefix_chunk,
                  expert_parallel=expert_parallel, steps_per_dispatch=steps_per_dispatch,
                  kv_block_size=kv_block_size, kv_blocks=kv_blocks, quantize=quantize, kv_reuse=kv_reuse,
                  kv_dtype=kv_dtype, window_group=kv_window_group)
