"""KV chunk codec: a `KVPayload` <-> a sequence of chunks small enough for gRPC messages.

Chunk 0 carries a JSON header (codec version, dtype, shapes, true_length, first_token, total
bytes). Every chunk carries `crc32`, the running CRC32 of the payload bytes up to and including
its data, so each chunk is checked as it arrives, and the last chunk's value is the CRC32 of the
whole payload: one CRC pass per side checks both. The decoder also checks order, count and byte
count, so a truncated or corrupted transfer is an error, never a wrong answer.

Chunk data is a zero-copy `memoryview` of the payload's arrays (a chunk never spans K and V);
the transport copies it once into its message. The transport (gRPC, a socket in benchmarks)
only ever moves these bytes.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Union

import numpy as np

from tandem_core.errors import KVTransferFailed
from tandem_core.types import KVPayload

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's 4 MiB default message limit
CODEC_VERSION = 2  # 2: running CRC32 per chunk (1 had a CRC per chunk and one per payload)

Bytes = Union[bytes, bytearray, memoryview]


@dataclass
class Chunk:
    seq: int
    total: int
    header: bytes
    data: Bytes
    crc32: int  # running CRC32 of the payload bytes through this chunk's data


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and friends live in ml_dtypes (installed with JAX)
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _byte_view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


def plan(nbytes: list[int], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(segment, offset, length) of every chunk: at most `chunk_bytes` each, never spanning two
    segments (K, V). At least one chunk."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    out = [(seg, off, min(chunk_bytes, n - off)) for seg, n in enumerate(nbytes) for off in range(0, n, chunk_bytes)]
    return out or [(0, 0, 0)]


def encode(payload: KVPayload, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
    k, v = payload.k, payload.v
    if k.dtype != v.dtype:
        raise ValueError(f"k and v dtypes differ: {k.dtype} vs {v.dtype}")
    views = [_byte_view(k), _byte_view(v)]
    header = json.dumps({
        "codec": CODEC_VERSION, "dtype": k.dtype.name, "k_shape": list(k.shape), "v_shape": list(v.shape),
        "true_length": int(payload.true_length), "first_token": int(payload.first_token),
        "nbytes": len(views[0]) + len(views[1]), "start": int(payload.start),
    }).encode()
    chunks = plan([len(x) for x in views], chunk_bytes)
    running = 0
    for seq, (seg, off, n) in enumerate(chunks):
        data = views[seg][off : off + n]
        running = zlib.crc32(data, running)
        yield Chunk(seq, len(chunks), header if seq == 0 else b"", data, running)


def _put_varint(out: bytearray, val: int) -> None:
    while val >= 0x80:
        out.append((val & 0x7F) | 0x80)
        val >>= 7
    out.append(val)


def serialize_chunk(c: Chunk) -> bytes:
    """`c` as a serialized `tandem.v1.KVChunk`, byte for byte what `KVChunk(...).SerializeToString()`
    gives, with one copy of the data and no protobuf arena (which costs a fresh allocation and
    page faults per message)."""
    head, tail = bytearray(), bytearray()
    for out, field, val in ((head, 1, c.seq), (head, 2, c.total), (tail, 7, c.crc32)):
        if val:
            _put_varint(out, field << 3)
            _put_varint(out, val & 0xFFFFFFFFFFFFFFFF)
    if c.header:
        _put_varint(head, 3 << 3 | 2)
        _put_varint(head, len(c.header))
        head += c.header
    if len(c.data):
        _put_varint(head, 4 << 3 | 2)
        _put_varint(head, len(c.data))
    return b"".join([head, c.data, tail])


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    val = shift = 0
    for j in range(i, min(i + 10, len(buf))):
        b = buf[j]
        val |= (b & 0x7F) << shift
        if b < 0x80:
            return val, j + 1
        shift += 7
    raise KVTransferFailed("KV chunk message is malformed (bad varint)")


def parse_chunk(msg: bytes) -> Chunk:
    """A serialized `tandem.v1.KVChunk` -> `Chunk` whose data is a zero-copy view of `msg`.

    The protobuf runtime would copy the data twice (parse, then `.data`); this reads the few
    scalar fields and slices the bytes. Unknown fields are skipped, as protobuf does."""
    vals = {1: 0, 2: 0, 7: 0}
    header, data = b"", memoryview(b"")
    i, n = 0, len(msg)
    while i < n:
        key, i = _varint(msg, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _varint(msg, i)
            vals[field] = val - (1 << 64) if val >= 1 << 63 else val
        elif wire == 2:
            ln, i = _varint(msg, i)
            if i + ln > n:
                raise KVTransferFailed("KV chunk message is malformed (field past the end)")
            if field == 3:
                header = bytes(msg[i : i + ln])
            elif field == 4:
                data = memoryview(msg)[i : i + ln]
            i += ln
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise KVTransferFailed(f"KV chunk message is malformed (wire type {wire})")
    if i != n:
        raise KVTransferFailed("KV chunk message is malformed (truncated)")
    return Chunk(vals[1], vals[2], header, data, vals[7] & 0xFFFFFFFF)


def decode(chunks: Iterable[Chunk]) -> KVPayload:
    dec = Decoder()
    for c in chunks:
        dec.add(c)
    return dec.finish()


class Decoder:
    """Incremental decoder: `add` each chunk as it arrives, then `finish`. Holds one buffer of the
    payload's size (allocated from the header), and nothing else."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self._max_bytes = max_bytes
        self._header: dict | None = None
        self._buf: np.ndarray | None = None
        self._off = 0
        self._crc = 0
        self._next = 0
        self._total = -1

    def _start(self, c: Chunk) -> None:
        try:
            h = json.loads(c.header)
            nbytes = int(h["nbytes"])
        except (ValueError, KeyError, TypeError) as e:
            raise KVTransferFailed(f"KV stream header is not valid: {e}") from e
        if h.get("codec") != CODEC_VERSION:
            raise KVTransferFailed(
                f"KV codec version {h.get('codec', 1)} from the sender, this side speaks {CODEC_VERSION}")
        if nbytes < 0 or (self._max_bytes is not None and nbytes > self._max_bytes):
            raise KVTransferFailed(f"KV payload of {nbytes} bytes is over this side's bound of {self._max_bytes}")
        self._header, self._total = h, c.total
        self._buf = np.empty(nbytes, np.uint8)

    def add(self, c: Chunk) -> None:
        if c.seq != self._next:
            raise KVTransferFailed(f"KV chunk out of order: got {c.seq}, expected {self._next}")
        if c.seq == 0:
            self._start(c)
        if self._buf is None:
            raise KVTransferFailed("KV stream did not start with a header chunk")
        end = self._off + len(c.data)
        if end > len(self._buf) or c.seq >= self._total or c.total != self._total:
            raise KVTransferFailed(
                f"KV stream longer than its header says ({len(self._buf)} bytes, {self._total} chunks)")
        crc = zlib.crc32(c.data, self._crc)
        if crc != c.crc32:
            raise KVTransferFailed(f"KV chunk {c.seq} checksum mismatch")
        self._buf[self._off : end] = np.frombuffer(c.data, np.uint8)
        self._off, self._crc = end, crc
        self._next += 1

    def finish(self) -> KVPayload:
        h, buf = self._header, self._buf
        if h is None or buf is None or self._next != self._total or self._off != len(buf):
            raise KVTransferFailed(
                f"KV stream incomplete: {self._next}/{self._total} chunks, "
                f"{self._off}/{0 if buf is None else len(buf)} bytes"
            )
        # Every chunk's running CRC matched, the last one's is the whole payload's: checked.
        dt = _dtype(h["dtype"])
        arr = buf.view(dt)
        nk = int(np.prod(h["k_shape"]))
        k = arr[:nk].reshape(h["k_shape"])
        v = arr[nk:].reshape(h["v_shape"])
        return KVPayload(k=k, v=v, true_length=h["true_length"], first_token=h["first_token"],
                         start=int(h.get("start", 0)))  # (a sender that predates parts: whole)
