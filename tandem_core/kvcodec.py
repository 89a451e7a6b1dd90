"""KV chunk codec: a `KVPayload` <-> a sequence of chunks small enough for gRPC messages.

Chunk 0 carries a JSON header (dtype, shapes, true_length, first_token, total bytes). Every chunk
carries the CRC32 of its data; the last carries the CRC32 of the whole payload. The decoder checks
both and the byte count, so a truncated or corrupted transfer is an error, never a wrong answer.
The transport (gRPC, a socket in benchmarks) only ever moves these bytes.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from tandem_core.errors import KVTransferFailed
from tandem_core.types import KVPayload

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's 4 MiB default message limit


@dataclass
class Chunk:
    seq: int
    total: int
    header: bytes
    data: bytes
    crc32: int
    payload_crc32: int = 0


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and friends live in ml_dtypes (installed with JAX)
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def encode(payload: KVPayload, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
    k = np.ascontiguousarray(payload.k)
    v = np.ascontiguousarray(payload.v)
    if k.dtype != v.dtype:
        raise ValueError(f"k and v dtypes differ: {k.dtype} vs {v.dtype}")
    header = {
        "dtype": k.dtype.name, "k_shape": list(k.shape), "v_shape": list(v.shape),
        "true_length": int(payload.true_length), "first_token": int(payload.first_token),
        "nbytes": int(k.nbytes + v.nbytes),
    }
    views = [memoryview(k.reshape(-1).view(np.uint8)), memoryview(v.reshape(-1).view(np.uint8))]
    total_bytes = header["nbytes"]
    total = max(1, -(-total_bytes // chunk_bytes))
    running = 0
    seq = 0
    buf = bytearray()
    for view in views:
        off = 0
        while off < len(view):
            take = min(chunk_bytes - len(buf), len(view) - off)
            buf += view[off : off + take]
            off += take
            if len(buf) == chunk_bytes:
                running = zlib.crc32(buf, running)
                yield _chunk(seq, total, header, bytes(buf), running, seq == total - 1)
                seq += 1
                buf = bytearray()
    if buf or seq == 0:
        running = zlib.crc32(buf, running)
        yield _chunk(seq, total, header, bytes(buf), running, True)


def _chunk(seq: int, total: int, header: dict, data: bytes, running: int, last: bool) -> Chunk:
    return Chunk(
        seq=seq, total=total, header=json.dumps(header).encode() if seq == 0 else b"",
        data=data, crc32=zlib.crc32(data), payload_crc32=running if last else 0,
    )


def decode(chunks: Iterable[Chunk]) -> KVPayload:
    dec = Decoder()
    for c in chunks:
        dec.add(c)
    return dec.finish()


class Decoder:
    """Incremental decoder: `add` each chunk as it arrives, then `finish`."""

    def __init__(self) -> None:
        self._header: dict | None = None
        self._buf = bytearray()
        self._crc = 0
        self._next = 0
        self._total = -1
        self._payload_crc: int | None = None

    def add(self, c: Chunk) -> None:
        if c.seq != self._next:
            raise KVTransferFailed(f"KV chunk out of order: got {c.seq}, expected {self._next}")
        if zlib.crc32(c.data) != c.crc32:
            raise KVTransferFailed(f"KV chunk {c.seq} checksum mismatch")
        if c.seq == 0:
            self._header = json.loads(c.header)
            self._total = c.total
            self._buf = bytearray(self._header["nbytes"])
            self._off = 0
        if self._header is None:
            raise KVTransferFailed("KV stream did not start with a header chunk")
        end = self._off + len(c.data)
        if end > len(self._buf):
            raise KVTransferFailed(f"KV stream longer than its header says ({len(self._buf)} bytes)")
        self._buf[self._off : end] = c.data
        self._off = end
        self._crc = zlib.crc32(c.data, self._crc)
        self._next += 1
        if c.seq == self._total - 1:
            self._payload_crc = c.payload_crc32

    def finish(self) -> KVPayload:
        h = self._header
        if h is None or self._next != self._total or self._off != len(self._buf):
            raise KVTransferFailed(
                f"KV stream incomplete: {self._next}/{self._total} chunks, "
                f"{getattr(self, '_off', 0)}/{len(self._buf)} bytes"
            )
        if self._payload_crc != self._crc:
            raise KVTransferFailed("KV payload checksum mismatch")
        dt = _dtype(h["dtype"])
        arr = np.frombuffer(self._buf, dtype=dt)
        nk = int(np.prod(h["k_shape"]))
        k = arr[:nk].reshape(h["k_shape"])
        v = arr[nk:].reshape(h["v_shape"])
        return KVPayload(k=k, v=v, true_length=h["true_length"], first_token=h["first_token"])
