"""The KV chunk codec: chunk plan, running CRC32s, the zero-copy KVChunk parser."""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from tandem_core import kvcodec
from tandem_core.errors import KVTransferFailed
from tandem_core.types import KVPayload
from tandem_proto import kv_pb2


def _payload(length: int = 300, seed: int = 0) -> KVPayload:
    rng = np.random.default_rng(seed)
    shape = (2, length, 2, 8)
    return KVPayload(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32),
                     true_length=max(0, length - 1), first_token=5)


def _wire(c: kvcodec.Chunk) -> bytes:
    return kv_pb2.KVChunk(seq=c.seq, total=c.total, header=c.header, data=bytes(c.data), crc32=c.crc32).SerializeToString()


def test_plan_never_spans_k_and_v():
    p = kvcodec.plan([10_000, 5_000], 4096)
    assert p == [(0, 0, 4096), (0, 4096, 4096), (0, 8192, 1808), (1, 0, 4096), (1, 4096, 904)]
    assert kvcodec.plan([0, 0], 4096) == [(0, 0, 0)]
    assert kvcodec.plan([0, 10], 4096) == [(1, 0, 10)]
    with pytest.raises(ValueError):
        kvcodec.plan([10], 0)


def test_running_crc_is_the_payload_crc_and_data_is_zero_copy():
    p = _payload()
    chunks = list(kvcodec.encode(p, 512))
    whole = p.k.tobytes() + p.v.tobytes()
    assert chunks[-1].crc32 == zlib.crc32(whole)
    assert b"".join(bytes(c.data) for c in chunks) == whole
    assert all(isinstance(c.data, memoryview) for c in chunks)
    assert json.loads(chunks[0].header)["codec"] == kvcodec.CODEC_VERSION and chunks[1].header == b""


@pytest.mark.parametrize("length", [0, 1, 300])
def test_parse_chunk_reads_what_protobuf_writes(length):
    p = _payload(length)
    chunks = list(kvcodec.encode(p, 1024))
    parsed = [kvcodec.parse_chunk(_wire(c)) for c in chunks]
    for a, b in zip(chunks, parsed):
        assert (a.seq, a.total, a.header, bytes(a.data), a.crc32) == (b.seq, b.total, b.header, bytes(b.data), b.crc32)
    q = kvcodec.decode(parsed)
    assert np.array_equal(q.k, p.k) and np.array_equal(q.v, p.v) and q.k.shape == p.k.shape


@pytest.mark.parametrize("length", [0, 1, 300])
def test_serialize_chunk_writes_what_protobuf_writes(length):
    for c in kvcodec.encode(_payload(length), 1024):
        assert kvcodec.serialize_chunk(c) == _wire(c)
    big = kvcodec.Chunk(300, 1 << 20, b"", b"\x01" * 200, 0xFFFFFFFF)  # multi-byte varints, no header
    assert kvcodec.serialize_chunk(big) == _wire(big)


def test_parse_chunk_skips_unknown_fields_and_rejects_garbage():
    c = next(kvcodec.encode(_payload(), 4096))
    extra = _wire(c) + bytes([8 << 3 | 0, 1]) + bytes([9 << 3 | 5, 0, 0, 0, 0]) + bytes([10 << 3 | 2, 2, 7, 7])
    assert kvcodec.parse_chunk(extra).crc32 == c.crc32
    for bad in (_wire(c)[:-3], b"\xff" * 11, bytes([4 << 3 | 2, 100, 1]), bytes([1 << 3 | 3])):
        with pytest.raises(KVTransferFailed, match="malformed"):
            kvcodec.parse_chunk(bad)


def test_corruption_is_caught_at_the_chunk_it_hits():
    chunks = list(kvcodec.encode(_payload(), 1024))
    bad = bytearray(chunks[3].data)
    bad[10] ^= 1
    chunks[3] = kvcodec.Chunk(3, chunks[3].total, b"", bytes(bad), chunks[3].crc32)
    dec = kvcodec.Decoder()
    for c in chunks[:3]:
        dec.add(c)
    with pytest.raises(KVTransferFailed, match="chunk 3 checksum"):
        dec.add(chunks[3])


def test_header_checks_codec_version_and_bound():
    chunks = list(kvcodec.encode(_payload(), 4096))
    h = json.loads(chunks[0].header)
    old = kvcodec.Chunk(0, chunks[0].total, json.dumps({**h, "codec": 1}).encode(), chunks[0].data, chunks[0].crc32)
    with pytest.raises(KVTransferFailed, match="codec version 1"):
        kvcodec.Decoder().add(old)
    with pytest.raises(KVTransferFailed, match="over this side's bound"):
        kvcodec.Decoder(max_bytes=100).add(chunks[0])
    with pytest.raises(KVTransferFailed, match="header is not valid"):
        kvcodec.Decoder().add(kvcodec.Chunk(0, 1, b"{", b"", 0))
    with pytest.raises(KVTransferFailed, match="longer"):
        kvcodec.decode([*chunks, kvcodec.Chunk(len(chunks), len(chunks), b"", b"x", 0)])
