"""KV transfer over real gRPC on loopback: chunked stream, checksums, capability tokens, release."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from decode_svc.puller import KVPuller
from prefill_svc.kv_store import KVStore
from prefill_svc.service import KVTransferServicer
from tandem_core import grpc_util, kvcodec
from tandem_core.errors import KVTransferFailed
from tandem_core.bus.ready import ReadyNotice
from tandem_core.types import GenerationRequest, KVPayload
from tandem_proto import kv_pb2, kv_pb2_grpc


def _payload(seed: int = 0, length: int = 64) -> KVPayload:
    rng = np.random.default_rng(seed)
    shape = (2, length, 2, 16)
    return KVPayload(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32),
                     true_length=length - 3, first_token=42)


def _register(servicer: KVTransferServicer, server, how: str) -> None:
    if how == "raw":  # PullKV serialized by kvcodec.serialize_chunk
        servicer.add_to_server(server)
    else:  # the generated registration: protobuf messages
        kv_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)


@pytest.fixture(params=["raw", "generated"])
async def kv_server(request):
    store = KVStore(budget_bytes=64 << 20, lease_s=60)
    released: list[str] = []
    server = grpc_util.make_server(8 << 20)
    _register(KVTransferServicer(store, 4096, released.append), server, request.param)
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


async def test_a_pull_from_a_position_moves_only_the_rest(kv_server):
    """A decode pod that holds a prompt's first positions (its block cache) asks for the rest:
    positions [from_position, true_length), said in the payload's `start`; a position outside
    (0, true_length) is INVALID_ARGUMENT and keeps the KV."""
    store, addr, released = kv_server
    p = _payload()
    held = store.put("r1", p)
    puller = KVPuller(8 << 20)
    try:
        with pytest.raises(KVTransferFailed, match="INVALID_ARGUMENT.*outside"):
            await puller.pull(_notice("r1", addr, held.capability), timeout_s=10, from_position=p.true_length)
        assert len(store) == 1 and released == []
        got = await puller.pull(_notice("r1", addr, held.capability), timeout_s=10, from_position=16)
    finally:
        await puller.close()
    assert got.start == 16 and got.true_length == p.true_length
    assert np.array_equal(got.k, p.k[:, 16:p.true_length]) and np.array_equal(got.v, p.v[:, 16:p.true_length])
    assert got.nbytes == p.nbytes * (p.true_length - 16) // p.k.shape[1]
    assert released == ["r1"]


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


class _CorruptingServicer(KVTransferServicer):
    """Flips one data byte of the third chunk on the wire, as a broken link or a buggy peer would."""

    async def PullKV(self, request, context):
        n = 0
        async for m in super().PullKV(request, context):
            if n == 2 and isinstance(m, bytes):
                i = len(m) // 2  # the middle of a serialized chunk is data
                m = m[:i] + bytes([m[i] ^ 1]) + m[i + 1 :]
            elif n == 2:
                m.data = bytes([m.data[0] ^ 1]) + m.data[1:]
            n += 1
            yield m


@pytest.mark.parametrize("how", ["raw", "generated"])
async def test_corrupted_chunk_over_grpc_is_kv_transfer_failed_with_reason(how):
    store = KVStore(budget_bytes=64 << 20, lease_s=60)
    server = grpc_util.make_server(8 << 20)
    _register(_CorruptingServicer(store, 4096, lambda _r: None), server, how)
    port = grpc_util.bind(server, "127.0.0.1", 0)
    await server.start()
    puller = KVPuller(8 << 20)
    try:
        held = store.put("rc", _payload(3))
        with pytest.raises(KVTransferFailed, match=r"request rc .* chunk 2 checksum mismatch"):
            await puller.pull(_notice("rc", f"127.0.0.1:{port}", held.capability), timeout_s=10)
    finally:
        await puller.close()
        await server.stop(None)


async def test_pull_past_its_deadline_fails_and_keeps_kv(kv_server):
    store, addr, released = kv_server
    held = store.put("rd", _payload(4, length=16384))  # 8 MiB in 2,048 chunks of 4 KiB
    puller = KVPuller(8 << 20)
    with pytest.raises(KVTransferFailed, match="DEADLINE_EXCEEDED"):
        await puller.pull(_notice("rd", addr, held.capability), timeout_s=0.005)
    got = await puller.pull(_notice("rd", addr, held.capability), timeout_s=30)  # the KV is still there
    await puller.close()
    assert got.k.shape == (2, 16384, 2, 16) and released == ["rd"]


async def test_a_lease_does_not_end_under_a_pull_in_flight(kv_server):
    """Issue 42 (4): a pull that started near the end of its KV's lease. `expired()` (the prefill
    loop frees what it lists and fails its request: "KV was not pulled ... within its lease") must
    not list KV a pull is still streaming, which would complete and decode after the client got
    that error; once the pull is over (here cut short) the lease applies again."""
    import time

    store, addr, released = kv_server
    held = store.put("r1", _payload(length=32768))  # 16 MiB: far more than gRPC's window, so the pull waits on us
    held.expires_at = time.monotonic() + 0.2  # the lease nearly over
    async with grpc.aio.insecure_channel(addr) as ch:
        call = kv_pb2_grpc.KVTransferStub(ch).PullKV(kv_pb2.PullKVRequest(request_id="r1", capability=held.capability))
        first = await call.read()  # the pull is under way: one chunk out, more to come
        assert first is not grpc.aio.EOF
        while time.monotonic() < held.expires_at + 0.1:
            await asyncio.sleep(0.05)
        assert store.expired() == [], "the lease ended under a pull in flight: its request would be failed"
        call.cancel()  # the decode pod gave up on it (its deadline, a crash)
    for _ in range(100):
        if store.expired() == ["r1"]:
            break
        await asyncio.sleep(0.02)
    assert store.expired() == ["r1"], "a pull that ended without the KV kept its lease from ending for ever"
