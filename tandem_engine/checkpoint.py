"""What a Hugging Face checkpoint directory holds, and how to read any piece of a served weight
from it without reading the rest.

A served weight (a leaf of the params pytree: `embed`, `norm`, `lm_head`, or a per-layer stack
under `layers`) is described by a `LeafSource`: its shape, whether its last two axes are swapped
against the file (HF stores linear layers [out, in]; the model computes `x @ W` over [in, out]),
and a `read(layer, lead, rows)` that returns one block of the weight *in file orientation*: the
tensor of `layer` at the leading indices `lead` (an expert), rows `rows` of the next axis, every
later axis whole. Each block is one contiguous byte range of one file (or a few, for FP8 and
MXFP4 scales), read with `os.preadv` into memory of its own (direct I/O where the filesystem
allows it, so a cold read costs no page-cache copy): no memory map stays open, so the
page cache a load streams through is not counted as the process's memory, and nothing is ever
read whole that is not wanted whole. Quantized checkpoints are dequantized block by block (FP8
with block scales, as Qwen3's `*-FP8`; MXFP4, as gpt-oss), so no float32 copy of a whole tensor
exists either.

shards.py turns these blocks into each device's shard. No JAX here: numpy and the files only.
"""
from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np

from tandem_core.errors import ModelNotFound
from tandem_core.families import FAMILIES
from tandem_core.models import ModelInfo

QUANT_METHODS = ("fp8", "mxfp4")  # dequantized at load; anything else is refused at start

# our per-layer name -> (HF name under model.layers.{i}., transposed?) for the attention and norms
ATTN = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
}
QKV_BIAS = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
DENSE = {"w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}
# safetensors dtype names -> numpy (ml_dtypes for the ones numpy lacks)
ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
DIRECT_ALIGN = 4096  # direct I/O: offsets, lengths and buffers in multiples of the disk's block (512 or 4096)
FP4_VALUES = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        np.float32)


class TensorMeta(NamedTuple):
    """Where one tensor's bytes lie: its file, its first byte there, its dtype and shape."""

    file: Path
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class Tensors:
    """The tensors of a checkpoint directory (every safetensors file in it), read by block.

    `block(name, lead, rows)` reads tensor[lead..., rows] (one contiguous range of bytes) with
    `preadv`; the file descriptors stay open until `close`. Thread-safe: `preadv` has no shared
    offset, and the bookkeeping of what was used takes a lock."""

    def __init__(self, path: Path, direct: bool = True):
        self.path = path
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelNotFound(f"{path}: no *.safetensors files")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            wanted = set(json.loads(index.read_text()).get("weight_map", {}).values())
            missing = sorted(w for w in wanted if not (path / w).is_file())
            if missing:
                raise ModelNotFound(f"{path}: shards named by model.safetensors.index.json are missing: {missing[:5]}")
        self.meta: dict[str, TensorMeta] = {}
        for file in files:
            with open(file, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            for name, m in header.items():
                if m["dtype"] not in ST_DTYPES:
                    raise ModelNotFound(f"{path}: tensor {name!r} has dtype {m['dtype']}, which this loader does not read")
                self.meta[name] = TensorMeta(file, 8 + n + int(m["data_offsets"][0]), np.dtype(ST_DTYPES[m["dtype"]]),
                                             tuple(int(s) for s in m["shape"]))
        self.used: set[str] = set()
        self.direct = direct
        self._fds: dict[Path, tuple[int, bool]] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self.meta

    def info(self, name: str) -> TensorMeta:
        if name not in self.meta:
            raise ModelNotFound(f"{self.path}: tensor {name!r} is missing")
        with self._lock:
            self.used.add(name)
        return self.meta[name]

    def _fd(self, file: Path) -> tuple[int, bool]:
        """(descriptor, direct?): the file opened for direct I/O where its filesystem allows it
        (reads then go from the disk into our buffers with no page-cache copy: the copy was most
        of a load's read CPU), else buffered."""
        with self._lock:
            got = self._fds.get(file)
            if got is None:
                try:
                    got = (os.open(file, os.O_RDONLY | os.O_DIRECT), True) if self.direct else None
                except OSError:  # tmpfs, some FUSE mounts: no O_DIRECT
                    got = None
                got = got or (os.open(file, os.O_RDONLY), False)
                self._fds[file] = got
            return got

    def _buffered(self, file: Path) -> int:
        """Fall back to buffered reads for `file` (a direct read was refused)."""
        with self._lock:
            fd, direct = self._fds[file]
            if direct:
                os.close(fd)
                self._fds[file] = (os.open(file, os.O_RDONLY), False)
            return self._fds[file][0]

    def block(self, name: str, lead: tuple[int, ...] = (), rows: slice | None = None) -> np.ndarray:
        """tensor[*lead, rows] (rows: a step-1 slice of the axis after `lead`; None: all of it),
        every later axis whole, as a new array of the file's dtype."""
        m = self.info(name)
        shape = m.shape
        if len(lead) > len(shape) or any(not 0 <= i < s for i, s in zip(lead, shape)):
            raise IndexError(f"{name}: index {lead} out of {shape}")
        rest = shape[len(lead):]
        if rest:
            r0, r1 = (0, rest[0]) if rows is None else (rows.start or 0, rest[0] if rows.stop is None else rows.stop)
            r1 = min(r1, rest[0])
            out_shape: tuple[int, ...] = (max(0, r1 - r0), *rest[1:])
        else:
            r0, out_shape = 0, ()
        item = m.dtype.itemsize
        row_bytes = int(np.prod(rest[1:], dtype=np.int64)) * item if rest else item
        flat = 0
        for i, s in zip(lead, shape):  # the element offset of (lead..., r0, 0...)
            flat = flat * s + i
        flat = flat * (rest[0] if rest else 1) + r0
        start = m.offset + flat * row_bytes
        nbytes = int(np.prod(out_shape, dtype=np.int64)) * item
        fd, direct = self._fd(m.file)
        if direct:
            try:
                return self._read_direct(fd, start, nbytes, m).view(m.dtype).reshape(out_shape)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                fd = self._buffered(m.file)  # this filesystem takes O_DIRECT opens but not the reads
        out = np.empty(out_shape, m.dtype)
        self._read_into(fd, memoryview(out.reshape(-1).view(np.uint8)), start, name, m)
        return out

    def _read_direct(self, fd: int, start: int, nbytes: int, m: TensorMeta) -> np.ndarray:
        """Bytes [start, start + nbytes) by direct I/O: the aligned range around them read into an
        aligned buffer, the wanted bytes a view of it."""
        a0 = start - start % DIRECT_ALIGN
        a1 = -(-(start + nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN
        raw = np.empty(a1 - a0 + DIRECT_ALIGN, np.uint8)
        buf = raw[(-raw.ctypes.data) % DIRECT_ALIGN:][:a1 - a0]
        view, done, need = memoryview(buf), 0, start + nbytes - a0
        while done < need:
            n = os.preadv(fd, [view[done:]], a0 + done)
            if n <= 0:
                raise ModelNotFound(f"{m.file}: short read (file truncated?)")
            done += n
        return buf[start - a0:start - a0 + nbytes]

    def _read_into(self, fd: int, view: memoryview, start: int, name: str, m: TensorMeta) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                raise ModelNotFound(f"{m.file}: short read of tensor {name!r} (file truncated?)")
            done += n

    def left(self) -> list[str]:
        return [n for n in self.meta if n not in self.used and not n.endswith("rotary_emb.inv_freq")]

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


# ---------------------------------------------------------------------------------------------
# dequantization, block by block


def dequant_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], row0: int = 0) -> np.ndarray:
    """FP8 rows [row0, row0 + len(w)) of an [out, in] weight with one float scale per
    (block[0] x block[1]) tile (DeepSeek/Qwen3 `*-FP8`); `scale_inv` holds the scale rows of
    those rows' tiles (from tile row0 // block[0]). -> float32."""
    rows = (np.arange(row0, row0 + w.shape[0]) // block[0]) - row0 // block[0]
    cols = np.arange(w.shape[1]) // block[1]
    scale = np.asarray(scale_inv, np.float32)[rows][:, cols]
    return w.astype(np.float32) * scale


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (gpt-oss): blocks uint8 [..., R, G, 16] (two e2m1 values a byte, low nibble first),
    scales uint8 [..., R, G] (e8m0: 2 ** (s - 127) for each group of 32) -> float32 [..., G * 32, R]
    (transposed as transformers' `convert_moe_packed_tensors` returns it)."""
    blocks = np.asarray(blocks, np.uint8)
    vals = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    vals[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    vals[..., 1::2] = FP4_VALUES[blocks >> 4]
    vals *= np.exp2(np.asarray(scales, np.float32) - 127.0)[..., None]
    out = vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2)  # [..., R, G*32]
    return np.swapaxes(out, -1, -2)


# ---------------------------------------------------------------------------------------------
# what each leaf of the params pytree is read from

# read(layer, lead, rows) -> the block in file orientation (layer -1 for a leaf with no layer axis)
Read = Callable[[int, tuple[int, ...], slice], np.ndarray]


class LeafSource(NamedTuple):
    """One leaf of the params pytree as the checkpoint holds it.

    `shape`: ours, with the leading [num_layers] axis when `stacked`. `transposed`: the file holds
    each (per-layer) tensor with its last two axes swapped (HF [out, in] for our [in, out]).
    `read(layer, lead, rows)` returns file-orientation[lead..., rows, ...] of that layer;
    `lead` indexes the axes before the row axis (the row axis: the second to last of a matrix,
    the only one of a vector). `nbytes`: what the file holds for the whole leaf (progress)."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    stacked: bool
    transposed: bool
    read: Read
    nbytes: int

    @property
    def file_shape(self) -> tuple[int, ...]:
        """One layer's tensor in file orientation (the whole leaf's when not stacked)."""
        per = self.shape[1:] if self.stacked else self.shape
        return (*per[:-2], per[-1], per[-2]) if self.transposed else per


class Reader:
    """A checkpoint directory read by block, dequantizing what its quantization_config says is
    quantized. Every `tensor` call checks the tensor's shape against the model's."""

    def __init__(self, path: Path, hf: dict):
        self.t = Tensors(path)
        self.path = path
        q = hf.get("quantization_config") or {}
        self.method = q.get("quant_method")
        if self.method and self.method not in QUANT_METHODS:
            raise ModelNotFound(
                f"{path}: quantization {self.method!r} is not supported; served: bf16/f32 weights, "
                f"{', '.join(QUANT_METHODS)} (dequantized at load)")
        self.block = tuple(q.get("weight_block_size") or (128, 128))

    def has(self, name: str) -> bool:
        return name in self.t or f"{name}_blocks" in self.t

    def tensor(self, name: str, shape: tuple[int, ...]) -> tuple[Callable[[tuple[int, ...], slice], np.ndarray], int]:
        """(read(lead, rows), bytes in the file) for tensor `name`, which MUST have `shape` once
        dequantized (ModelNotFound otherwise, before anything is read)."""
        if name not in self.t and f"{name}_blocks" in self.t:  # MXFP4 experts: [.., R, G, 16] -> [.., G*32, R]
            blocks, scales = self.t.info(f"{name}_blocks"), self.t.info(f"{name}_scales")
            got = (*blocks.shape[:-3], blocks.shape[-2] * blocks.shape[-1] * 2, blocks.shape[-3])
            self._check(name, got, shape)
            # a block of the dequantized tensor reads whole experts: rows of [.., G*32, R] are the
            # packed layout's columns, so one expert at a time (`lead` names it)

            def mxfp4(lead: tuple[int, ...], rows: slice) -> np.ndarray:
                full = dequant_mxfp4(self.t.block(f"{name}_blocks", lead), self.t.block(f"{name}_scales", lead))
                return full[rows]

            return mxfp4, blocks.nbytes + scales.nbytes
        m = self.t.info(name)
        self._check(name, m.shape, shape)
        scale_name = name[: -len("weight")] + "weight_scale_inv" if name.endswith("weight") else None
        if scale_name and scale_name in self.t:  # FP8 with block scales: [out, in], tiles of self.block
            s = self.t.info(scale_name)
            b0 = self.block[0]

            def fp8(lead: tuple[int, ...], rows: slice) -> np.ndarray:
                r0 = rows.start or 0
                r1 = m.shape[0] if rows.stop is None else min(rows.stop, m.shape[0])
                w = self.t.block(name, lead, slice(r0, r1))
                sc = self.t.block(scale_name, lead, slice(r0 // b0, -(-r1 // b0)))
                return dequant_fp8(w, sc, self.block, r0)

            return fp8, m.nbytes + s.nbytes
        return (lambda lead, rows: self.t.block(name, lead, rows)), m.nbytes

    def _check(self, name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        if tuple(got) != tuple(want):
            raise ModelNotFound(f"{self.path}: tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}")

    def close(self) -> None:
        self.t.close()


def model_prefix(r: Reader) -> str:
    """Where the decoder's tensors live: `model.` (a causal LM) or under a multimodal wrapper
    (Gemma 3: `language_model.model.` or, as transformers 5 writes it, `model.language_model.`)."""
    for prefix in ("model.", "model.language_model.", "language_model.model."):
        if f"{prefix}embed_tokens.weight" in r.t:
            return prefix
    raise ModelNotFound(f"{r.path}: no embed_tokens.weight under model., model.language_model. or language_model.model.")


def layer_sources(cfg, family: str) -> dict[str, tuple[str, bool]]:
    """Our per-layer dense names -> (HF name under model.layers.{i}., transposed?)."""
    out = dict(ATTN)
    out.update({k: (v, False) for k, v in QKV_BIAS.items() if cfg.qkv_bias})
    if cfg.o_bias:
        out["bo"] = ("self_attn.o_proj.bias", False)
    if cfg.qk_norm:
        out.update(q_norm=("self_attn.q_norm.weight", False), k_norm=("self_attn.k_norm.weight", False))
    if cfg.sinks:
        out["sinks"] = ("self_attn.sinks", False)
    if cfg.sandwich_norms:  # Gemma: post_attention_layernorm is the attention output's norm
        out.update(attn_post_norm=("post_attention_layernorm.weight", False),
                   mlp_norm=("pre_feedforward_layernorm.weight", False),
                   mlp_post_norm=("post_feedforward_layernorm.weight", False))
    else:
        out["mlp_norm"] = ("post_attention_layernorm.weight", False)
    if not cfg.moe:
        out.update({k: (v, True) for k, v in DENSE.items()})
    return out


def _swap(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2])


def _layered(r: Reader, names: list[str], file_shape: tuple[int, ...]) -> tuple[Read, int]:
    """A per-layer tensor (names[i] is layer i's)."""
    reads, total = [], 0
    for n in names:
        fn, nb = r.tensor(n, file_shape)
        reads.append(fn)
        total += nb
    return (lambda layer, lead, rows: reads[layer](lead, rows)), total


def _per_expert(r: Reader, fmt: str, prefix_of: Callable[[int], str], layers: int, experts: int,
                file_shape: tuple[int, ...]) -> tuple[Read, int]:
    """[E, out, in] per layer from one [out, in] tensor per expert (Mixtral, Qwen3-MoE)."""
    reads, total = [], 0
    for i in range(layers):
        row = []
        for j in range(experts):
            fn, nb = r.tensor(prefix_of(i) + fmt.format(j=j), file_shape[1:])
            row.append(fn)
            total += nb
        reads.append(row)

    def read(layer: int, lead: tuple[int, ...], rows: slice) -> np.ndarray:
        return reads[layer][lead[0]](lead[1:], rows)

    return read, total


def _interleaved(read: Read, parity: int) -> Read:
    """Every other column of a fused gate/up tensor (gpt-oss: gate at even, up at odd)."""
    return lambda layer, lead, rows: read(layer, lead, rows)[..., parity::2]


def leaf_sources(info: ModelInfo, cfg, shapes: dict[str, tuple[int, ...]], r: Reader) -> list[LeafSource]:
    """Every leaf of the params pytree of a HF directory of a served family, as LeafSources.
    Shapes are checked against the model's here, before any weight is read."""
    family = (info.extra or {}).get("family", "llama")
    root = model_prefix(r)
    L = info.num_layers
    pre = lambda i: f"{root}layers.{i}."  # noqa: E731
    out: list[LeafSource] = []

    def add(path: tuple[str, ...], shape: tuple[int, ...], stacked: bool, transposed: bool, rn: tuple[Read, int]):
        out.append(LeafSource(path, shape, stacked, transposed, rn[0], rn[1]))

    d, v = info.hidden_size, info.vocab_size
    emb, nb = r.tensor(f"{root}embed_tokens.weight", (v, d))
    add(("embed",), (v, d), False, False, (lambda layer, lead, rows: emb(lead, rows), nb))
    nrm, nb = r.tensor(f"{root}norm.weight", (d,))
    add(("norm",), (d,), False, False, (lambda layer, lead, rows: nrm(lead, rows), nb))
    if not info.tie_word_embeddings:
        if not r.has("lm_head.weight"):
            raise ModelNotFound(f"{r.path}: lm_head.weight is missing and embeddings are not tied")
        head, nb = r.tensor("lm_head.weight", (v, d))
        add(("lm_head",), (d, v), False, True, (lambda layer, lead, rows: head(lead, rows), nb))
    elif r.has("lm_head.weight"):
        r.t.used.add("lm_head.weight")  # a tied copy some checkpoints carry anyway
    for ours, (name, transposed) in layer_sources(cfg, family).items():
        per = shapes[ours]
        add(("layers", ours), (L, *per), True, transposed,
            _layered(r, [pre(i) + name for i in range(L)], _swap(per) if transposed else per))
    if cfg.moe:
        e, (_, dd, f) = cfg.num_experts, shapes["we_gate"]
        names = FAMILIES[family].experts
        if names is None:
            raise ModelNotFound(f"{r.path}: the {family} family has no experts, but its config.json names some")
        add(("layers", "router"), (L, dd, e), True, True,
            _layered(r, [pre(i) + names.router for i in range(L)], (e, dd)))
        if names.fused:  # all experts in one tensor, gate and up interleaved on the last axis
            gu = _layered(r, [pre(i) + names.gate for i in range(L)], (e, dd, 2 * f))
            gub = _layered(r, [pre(i) + names.gate + "_bias" for i in range(L)], (e, 2 * f))
            router_bias = names.router[: -len("weight")] + "bias"
            add(("layers", "router_bias"), (L, e), True, False,
                _layered(r, [pre(i) + router_bias for i in range(L)], (e,)))
            add(("layers", "we_gate"), (L, e, dd, f), True, False, (_interleaved(gu[0], 0), gu[1] // 2))
            add(("layers", "we_up"), (L, e, dd, f), True, False, (_interleaved(gu[0], 1), gu[1] // 2))
            add(("layers", "we_down"), (L, e, f, dd), True, False,
                _layered(r, [pre(i) + names.down for i in range(L)], (e, f, dd)))
            add(("layers", "be_gate"), (L, e, f), True, False, (_interleaved(gub[0], 0), gub[1] // 2))
            add(("layers", "be_up"), (L, e, f), True, False, (_interleaved(gub[0], 1), gub[1] // 2))
            add(("layers", "be_down"), (L, e, dd), True, False,
                _layered(r, [pre(i) + names.down + "_bias" for i in range(L)], (e, dd)))
        else:  # one module per expert
            add(("layers", "we_gate"), (L, e, dd, f), True, True, _per_expert(r, names.gate, pre, L, e, (e, f, dd)))
            add(("layers", "we_up"), (L, e, dd, f), True, True, _per_expert(r, names.up, pre, L, e, (e, f, dd)))
            add(("layers", "we_down"), (L, e, f, dd), True, True, _per_expert(r, names.down, pre, L, e, (e, dd, f)))
    left = [n for n in r.t.left() if not n.endswith(("weight_scale_inv", "_scales"))
            and not n.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                  "model.multi_modal_projector."))]
    if left:
        raise ModelNotFound(f"{r.path}: tensors this {family} model does not use (another architecture?): {left[:5]}")
    return out


__all__ = ["FP4_VALUES", "LeafSource", "QUANT_METHODS", "Reader", "Tensors", "dequant_fp8", "dequant_mxfp4",
           "leaf_sources", "model_prefix"]
