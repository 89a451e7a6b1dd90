"""Weights straight into their shards: each device receives only its slice of each weight, read
from the checkpoint by block in the serving dtype.

For every leaf of the params pytree (checkpoint.LeafSource), `jax.make_array_from_callback` asks
for each device's shard by its index under the layout's sharding (sharding.Layout; one device
when unsharded); the callback reads only the file blocks that shard needs (rows of [out, in]
matrices, experts of a stack), in threads, transposes them into [in, out] on the host block by
block, converts them to the serving dtype, and (int8) quantizes them, so:
- no float32 copy of a whole tensor, no whole stack on one device, no replicated staging;
- a replicated leaf (norms, biases) is read once and handed to every device;
- on a CPU device the shard's host buffer (64-byte aligned) *is* the device buffer (JAX takes it
  without a copy), so a load holds the weights once plus the blocks in flight; on an accelerator
  the host stages at most `stage_bytes` of a leaf at a time (a leaf of layers is built in
  chunks of layers and assembled in place on the device, a donated dynamic_update_slice).
int8 (quantize.py's scheme, bit for bit): a block read for it always holds whole input rows of
each output column, so the per-column scale is the column's own max over every input even when the
input axis is split across chips (o and down projections); the scale leaf is then placed from the
scales found.

Progress (bytes done, GB/s, ETA) goes to a callback the caller logs; `LoadStats` says what was
read and what each device received. No I/O beyond the checkpoint's files, no settings here.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from tandem_engine.checkpoint import LeafSource
from tandem_engine.quantize import QUANTIZED, SCALE
from tandem_engine.sharding import Layout

log = logging.getLogger(__name__)

PIECE_BYTES = 4 << 20  # one read and transpose: a few MB, so a block is still in cache when transposed
TRANSPOSE_ROWS = 16  # rows of a file block transposed at a time (~1.9 GB/s a thread here, 0.4 for one big .T copy)
DEFAULT_STAGE_BYTES = 1 << 30  # an accelerator's host staging per leaf (CPU devices stage nothing extra)


class Progress(NamedTuple):
    done_bytes: int
    total_bytes: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.done_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_s(self) -> float:
        return (self.total_bytes - self.done_bytes) / self.rate if self.rate > 0 else float("inf")

    def line(self) -> str:
        return (f"{self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB "
                f"({100.0 * self.done_bytes / max(1, self.total_bytes):.0f}%), {self.rate / 1e9:.2f} GB/s, "
                f"ETA {self.eta_s:.0f}s")


class LoadStats(NamedTuple):
    """What one load did: the bytes of every host buffer handed to a device, in the order the
    devices' callbacks received them (leaf path, bytes), and seconds."""

    handed: list[tuple[tuple[str, ...], int]]
    seconds: float

    @property
    def largest_buffer(self) -> int:
        return max((n for _, n in self.handed), default=0)


def aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts at an `align`-byte boundary (JAX's CPU client
    then uses it as the device buffer instead of copying it)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dt).reshape(shape)


def _raw(a: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned ints (numpy copies those without ml_dtypes' cast loops)."""
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _transpose_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[..., :, r] = src[..., r, :] (dst = swapaxes(src)), a few rows at a time: a strided copy
    of one whole matrix thrashes the cache (0.4 GB/s measured, against 1.2 in row blocks)."""
    same = dst.dtype == src.dtype
    d, s = (_raw(dst), _raw(src)) if same else (dst, src)
    rows = s.shape[-2]
    for i in range(0, rows, TRANSPOSE_ROWS):
        j = min(rows, i + TRANSPOSE_ROWS)
        np.copyto(d[..., i:j], np.swapaxes(s[..., i:j, :], -1, -2), casting="unsafe")


def quantize_block(w: np.ndarray, in_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize.quantize_int8 on the host, for a block holding every input of its columns:
    (int8 of w's shape, float32 scales with `in_axis` dropped). Bit for bit the same: the
    float32 values, max |w| / 127 (1 for an all-zero column), round half to even, clip. (XLA
    divides by the constant 127 as a multiply by its float32 reciprocal: so does this.)"""
    w32 = np.asarray(w, np.float32)
    amax = np.max(np.abs(w32), axis=in_axis)
    scale = np.where(amax > 0, amax * np.float32(1.0 / 127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w32 / np.expand_dims(scale, in_axis)), -127, 127).astype(np.int8)
    return q, scale


class _Loader:
    """One load: every leaf of `sources` placed in turn, each shard's blocks read and converted
    on a pool of `threads` threads; `handed` records each buffer given to a device."""

    def __init__(self, sources: list[LeafSource], dtype, layout: Layout | None, quantize: str | None,
                 threads: int, stage_bytes: int | None, progress: Callable[[Progress], None] | None):
        self.sources, self.dtype, self.layout = sources, np.dtype(dtype), layout
        self.quantize = quantize
        self.device = jax.devices()[0]  # unsharded: the default device
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="tandem-load")
        platform = (layout.mesh.devices.flat[0] if layout is not None else self.device).platform
        # CPU devices take the shard buffers as they are: nothing extra to bound
        self.stage_bytes = stage_bytes if stage_bytes is not None else (None if platform == "cpu" else DEFAULT_STAGE_BYTES)
        self.total = sum(s.nbytes for s in sources)
        self.done = 0
        self.t0 = time.monotonic()
        self.progress = progress
        self.lock = threading.Lock()
        self.handed: list[tuple[tuple[str, ...], int]] = []

    # ---- shardings ---------------------------------------------------------------------------
    def shardings(self) -> dict[tuple[str, ...], Sharding]:
        if self.layout is None:
            one = SingleDeviceSharding(self.device)
            return {s.path: one for s in self.sources} | {
                (*s.path[:-1], s.path[-1] + SCALE): one for s in self.sources if self._quantized(s)}
        skeleton: dict = {"layers": {}}  # the params' shapes: param_shardings reads the vocabulary from them
        for s in self.sources:
            names = [s.path[-1]] + ([s.path[-1] + SCALE] if self._quantized(s) else [])
            for n in names:
                (skeleton["layers"] if s.path[0] == "layers" else skeleton)[n] = jax.ShapeDtypeStruct(s.shape, self.dtype)
        tree = self.layout.param_shardings(skeleton)
        out = {}
        for k, v in tree.items():
            if k == "layers":
                out.update({("layers", n): sh for n, sh in v.items()})
            else:
                out[(k,)] = v
        return out

    def _quantized(self, s: LeafSource) -> bool:
        return bool(self.quantize) and s.path[0] == "layers" and s.path[-1] in QUANTIZED

    # ---- one shard ---------------------------------------------------------------------------
    def _advance(self, nbytes: float) -> None:
        with self.lock:
            self.done += nbytes
            p = Progress(int(self.done), self.total, time.monotonic() - self.t0)
        if self.progress is not None:
            self.progress(p)

    def fill(self, s: LeafSource, index: tuple[slice, ...], shape: tuple[int, ...],
             layer0: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        """The shard `index` of leaf `s` (of `shape`: the leaf's, or a chunk's of its layers from
        `layer0`), as a host array in the serving dtype (int8 when quantized) and, when quantized,
        its layers' scales [layers, (E,) out] over every output column the shard's blocks read."""
        per = index[1:] if s.stacked else index
        layers = range(*index[0].indices(shape[0])) if s.stacked else range(1)
        per_shape = s.shape[1:] if s.stacked else s.shape
        sizes = tuple(len(range(*sl.indices(n))) for sl, n in zip(per, per_shape))
        quant = self._quantized(s)
        buf = aligned_empty((len(layers), *sizes) if s.stacked else sizes, np.int8 if quant else self.dtype)
        swapped = s.transposed and len(per) >= 2
        fsl = (*per[:-2], per[-1], per[-2]) if swapped else per  # the shard in file orientation
        fshape = s.file_shape
        row_axis = max(0, len(fshape) - 2)
        lead_ranges = [range(*sl.indices(n)) for sl, n in zip(fsl[:row_axis], fshape[:row_axis])]
        scales = np.zeros((len(layers), *map(len, lead_ranges), per_shape[-1]), np.float32) if quant else None
        r0, r1, _ = fsl[row_axis].indices(fshape[row_axis])
        # a quantized [in, out] block (gpt-oss's experts) reads every input row: its scales need them
        whole = quant and not swapped
        row_bytes = int(np.prod(fshape[row_axis + 1:], dtype=np.int64)) * self.dtype.itemsize
        step = fshape[row_axis] if whole else max(1, PIECE_BYTES // max(1, row_bytes))
        starts = [0] if whole else range(r0, r1, step)
        tasks = [(k, pos, a) for k in range(len(layers))
                 for pos in itertools.product(*[range(len(r)) for r in lead_ranges]) for a in starts]

        def one(task) -> None:
            k, pos, a = task
            layer = layers[k] + layer0 if s.stacked else -1
            lead = tuple(r[i] for r, i in zip(lead_ranges, pos))
            b = fshape[row_axis] if whole else min(r1, a + step)
            block = s.read(layer, lead, slice(a, b))  # [b - a, *rest] in file orientation, rest whole
            dst = (buf[k] if s.stacked else buf)[pos]
            if quant:
                assert scales is not None
                w = block.astype(self.dtype)  # what the unquantized weights would hold, then int8
                if swapped:  # [out rows a:b, in whole]
                    q, scales[(k, *pos, slice(a, b))] = quantize_block(w, in_axis=-1)
                    _transpose_into(dst[..., a - r0:b - r0], q[..., fsl[-1]])
                else:  # [in whole, out whole]
                    q, scales[(k, *pos)] = quantize_block(w, in_axis=-2)
                    np.copyto(dst, q[r0:r1, fsl[-1]])
                return
            if block.ndim == 0 or dst.ndim == 0:
                dst[...] = block
                return
            block = block[(slice(None), *fsl[row_axis + 1:])]
            if swapped:
                _transpose_into(dst[..., a - r0:b - r0], block)
            else:
                np.copyto(dst[a - r0:b - r0], block, casting="unsafe")

        list(self.pool.map(one, tasks))
        return buf, scales

    # ---- one leaf ----------------------------------------------------------------------------
    def leaf(self, s: LeafSource, sharding: Sharding, scale_sharding: Sharding | None) -> dict[str, jax.Array]:
        """Leaf `s` placed with `sharding` (and its scales with `scale_sharding` when quantized):
        whole, or on an accelerator whose host staging it would exceed, `chunk` layers at a time
        assembled in place on the devices."""
        quant = self._quantized(s)
        itemsize = 1 if quant else self.dtype.itemsize
        host_bytes = int(np.prod(s.shape, dtype=np.int64)) * itemsize * len(sharding.device_set)
        chunk = s.shape[0] if s.stacked else 1
        if self.stage_bytes is not None and s.stacked and host_bytes > self.stage_bytes:
            chunk = max(1, self.stage_bytes * s.shape[0] // host_bytes)
        scales = np.zeros((s.shape[0], *s.shape[1:-2], s.shape[-1]), np.float32) if quant else None
        if not s.stacked or chunk >= s.shape[0]:
            arr = self._make(s, s.shape, sharding, 0, scales)
        else:
            arr = _zeros(s.shape, np.int8 if quant else self.dtype, sharding)
            for start in range(0, s.shape[0], chunk):
                n = min(chunk, s.shape[0] - start)
                arr = _put_layers(arr, self._make(s, (n, *s.shape[1:]), sharding, start, scales), np.int32(start))
        name = s.path[-1]
        out = {name: arr}
        if quant:
            assert scales is not None and scale_sharding is not None
            out[name + SCALE] = jax.make_array_from_callback(
                scales.shape, scale_sharding, lambda idx: np.ascontiguousarray(scales[idx]))
        return out

    def _make(self, s: LeafSource, shape: tuple[int, ...], sharding: Sharding, layer0: int,
              scales: np.ndarray | None) -> jax.Array:
        """`jax.make_array_from_callback` over leaf `s` (or its layers [layer0, layer0 + shape[0])):
        each distinct shard is read once (a replicated one is handed to every device)."""
        made: dict[tuple, np.ndarray] = {}
        n_shards = len({_key(i) for i in sharding.devices_indices_map(shape).values()})
        part = shape[0] / s.shape[0] if s.stacked else 1.0

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            key = _key(index)
            if key not in made:
                buf, sc = self.fill(s, index, shape, layer0)
                if sc is not None and scales is not None:  # the scales of the columns this shard read
                    layers = range(*index[0].indices(shape[0]))
                    lead = (index[1:] if s.stacked else index)[:-2]
                    target = scales[(slice(layer0 + layers.start, layer0 + layers.stop), *lead)]
                    np.maximum(target, sc, out=target)  # shards that read a column find the same scale
                made[key] = buf
                self._advance(s.nbytes * part / n_shards)
            buf = made[key]
            with self.lock:
                self.handed.append((s.path, buf.nbytes))
            return buf

        return jax.make_array_from_callback(shape, sharding, shard)

    def run(self) -> dict:
        shardings = self.shardings()
        params: dict = {"layers": {}}
        try:
            for s in self.sources:
                scale_key = (*s.path[:-1], s.path[-1] + SCALE)
                got = self.leaf(s, shardings[s.path], shardings.get(scale_key))
                (params["layers"] if s.path[0] == "layers" else params).update(got)
        finally:
            self.pool.shutdown(wait=True)
        return params


def _key(index: tuple[slice, ...]) -> tuple:
    return tuple((sl.start, sl.stop, sl.step) for sl in index)


def _zeros(shape: tuple[int, ...], dtype, sharding: Sharding) -> jax.Array:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


@partial(jax.jit, donate_argnums=0)
def _put_layers(whole: jax.Array, part: jax.Array, start) -> jax.Array:
    """whole[start:start + len(part)] = part, in place (whole is donated)."""
    return jax.lax.dynamic_update_slice(whole, part, (start,) + (0,) * (whole.ndim - 1))


def place_checkpoint(sources: list[LeafSource], dtype, *, layout: Layout | None = None,
                     quantize: str | None = None, threads: int = 0, stage_bytes: int | None = None,
                     progress: Callable[[Progress], None] | None = None) -> tuple[dict, LoadStats]:
    """The params pytree of `sources`, each leaf placed with `layout`'s sharding (one device:
    the first of `jax.devices()`), in `dtype` (int8 + scales for quantize="int8"), and what the
    load did. `threads`: readers (0: four per CPU, at least 8, at most 64: direct reads block on
    the disk, and enough of them in flight keep it busy while the others transpose; 8 on 2 cores
    loaded 0.34-0.56 s against 0.36-0.78 with 4, alternated)."""
    threads = threads or max(8, min(64, 4 * (os.cpu_count() or 2)))
    loader = _Loader(sources, dtype, layout, quantize, threads, stage_bytes, progress)
    t0 = time.monotonic()
    params = loader.run()
    jax.block_until_ready(params)
    return params, LoadStats(loader.handed, time.monotonic() - t0)


__all__ = ["LoadStats", "PIECE_BYTES", "Progress", "aligned_empty", "place_checkpoint", "quantize_block"]
