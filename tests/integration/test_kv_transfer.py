"""KV transfer over real gRPC on loopback: chunked stream, checksums, capability tokens, release."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from decode_svc.puller import KVPuller
from prefill_svc.kv_store import KVStore
from prefill_svc.service import KVTransferServicer
from tandem_core import grpc_util, kvcodec
from tandem_core.errors import KVTransferFailed
from tandem_core.streams import ReadyNotice
from tandem_core.types import GenerationRequest, KVPayload
from tandem_proto import kv_pb2, kv_pb2_grpc


def _payload(seed: int = 0, length: int = 64) -> KVPayload:
    rng = np.random.default_rng(seed)
    shape = (2, length, 2, 16)
    return KVPayload(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32),
                     true_length=length - 3, first_token=42)


@pytest.fixture
async def kv_server():
    store = KVStore(budget_bytes=64 << 20, lease_s=60)
    released: list[str] = []
    server = grpc_util.make_server(8 << 20)
    kv_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(store, 4096, released.append), server)
    port = grpc_util.bind(server, "127.0.0.1", 0)
    await server.start()
    try:
        yield store, f"127.0.0.1:{port}", released
    finally:
        await server.stop(None)


def _notice(rid: str, address: str, cap: str) -> ReadyNotice:
    return ReadyNotice(GenerationRequest(rid, [1, 2], 4), address, cap, 0, "p", 42)


async def test_pull_round_trip_many_chunks_then_released(kv_server):
    store, addr, released = kv_server
    p = _payload()
    held = store.put("r1", p)
    puller = KVPuller(8 << 20)
    got = await puller.pull(_notice("r1", addr, held.capability), timeout_s=10)
    await puller.close()
    assert np.array_equal(got.k, p.k) and np.array_equal(got.v, p.v)
    assert (got.true_length, got.first_token) == (p.true_length, p.first_token)
    assert released == ["r1"] and store.held_bytes == 0 and len(store) == 0


async def test_wrong_capability_is_permission_denied_and_keeps_kv(kv_server):
    store, addr, _ = kv_server
    store.put("r2", _payload(1))
    async with grpc.aio.insecure_channel(addr) as ch:
        call = kv_pb2_grpc.KVTransferStub(ch).PullKV(kv_pb2.PullKVRequest(request_id="r2", capability="nope"))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in call:
                pytest.fail("a chunk was sent to a caller without the capability")
    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert store.get("r2") is not None


async def test_unknown_request_fails_as_kv_transfer_error(kv_server):
    _, addr, _ = kv_server
    puller = KVPuller(8 << 20)
    with pytest.raises(KVTransferFailed, match="NOT_FOUND"):
        await puller.pull(_notice("missing", addr, "x"), timeout_s=5)
    await puller.close()


async def test_dead_address_fails_fast_with_clear_error():
    puller = KVPuller(8 << 20)
    with pytest.raises(KVTransferFailed, match="127.0.0.1:1"):
        await puller.pull(_notice("r", "127.0.0.1:1", "x"), timeout_s=3)
    await puller.close()


def test_codec_detects_corruption_and_truncation():
    chunks = list(kvcodec.encode(_payload(2), 1000))
    assert len(chunks) > 3
    bad = list(chunks)
    bad[2] = kvcodec.Chunk(bad[2].seq, bad[2].total, bad[2].header, b"x" + bad[2].data[1:], bad[2].crc32)
    with pytest.raises(KVTransferFailed, match="checksum"):
        kvcodec.decode(bad)
    with pytest.raises(KVTransferFailed, match="incomplete"):
        kvcodec.decode(chunks[:-1])
    with pytest.raises(KVTransferFailed, match="out of order"):
        kvcodec.decode([chunks[0], chunks[2]])


def test_store_budget_is_a_hard_bound():
    p = _payload()
    store = KVStore(budget_bytes=p.nbytes * 2, lease_s=60)
    assert store.room_for(p.nbytes) == 2
    store.put("a", p)
    store.put("b", p)
    assert store.room_for(p.nbytes) == 0
    with pytest.raises(MemoryError):
        store.put("c", p)
    assert store.expired(now=1e18) == ["a", "b"]
