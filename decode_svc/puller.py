"""KV pull client: fetch one prefill result from the prefill pod named in its ready notice.

One gRPC channel per prefill address, reused. Every pull has a deadline; any failure (pod gone,
wrong capability, checksum mismatch, deadline) becomes `KVTransferFailed` with the reason; a
capability refused because a later prefill of the same request replaced the KV, `KVSuperseded`.

A pull runs on a worker thread over a blocking channel, not on the event loop: reading the stream
and decoding its chunks (checksums, copies into the payload's arrays) was the largest share of the
decode pod's event-loop CPU per token (bench/host_path.py's profile), and gRPC's blocking iterator
waits without the GIL. A pull cancelled on the loop cancels its call, so the thread ends at once.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from tandem_core import grpc_util, kvcodec
from tandem_core.errors import KVSuperseded, KVTransferFailed
from tandem_core.settings import GrpcConfig
from tandem_core.bus.ready import ReadyNotice
from tandem_core.types import KVPayload
from tandem_proto import kv_pb2, kv_pb2_grpc

_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
PULL_METHOD = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['PullKV'].name}"
WRONG_CAPABILITY = "wrong capability for request"  # how prefill_svc/service.py starts that refusal


class KVPuller:
    def __init__(self, max_message_bytes: int, max_channels: int = 64, tls: GrpcConfig | None = None,
                 pull_threads: int = 16) -> None:
        self._opts = [("grpc.max_receive_message_length", max_message_bytes)]
        self._tls = tls
        self._stubs: dict[str, tuple[grpc.aio.Channel, kv_pb2_grpc.KVTransferStub, object]] = {}
        self._max_channels = max_channels
        self._sync: dict[str, tuple[grpc.Channel, object]] = {}  # address -> blocking channel, its PullKV
        self._sync_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=pull_threads, thread_name_prefix="kv-pull")

    def _stub(self, address: str) -> kv_pb2_grpc.KVTransferStub:
        return self._get(address)[1]

    def _get(self, address: str):
        got = self._stubs.get(address)
        if got is None:
            if len(self._stubs) >= self._max_channels:  # bounded: drop the oldest
                old = self._stubs.pop(next(iter(self._stubs)))
                # closing is async; the channel is unreferenced and closes on GC
                del old
            ch = grpc_util.channel(address, self._tls, self._opts)
            pull = ch.unary_stream(PULL_METHOD, request_serializer=kv_pb2.PullKVRequest.SerializeToString,
                                   response_deserializer=None)
            got = self._stubs[address] = (ch, kv_pb2_grpc.KVTransferStub(ch), pull)
        return got

    def _sync_pull(self, address: str):
        with self._sync_lock:
            got = self._sync.get(address)
            if got is None:
                if len(self._sync) >= self._max_channels:  # bounded: drop the oldest
                    self._sync.pop(next(iter(self._sync)))[0].close()
                ch = grpc_util.sync_channel(address, self._tls, self._opts)
                pull = ch.unary_stream(PULL_METHOD, request_serializer=kv_pb2.PullKVRequest.SerializeToString,
                                       response_deserializer=None)
                got = self._sync[address] = (ch, pull)
            return got[1]

    async def pull(self, notice: ReadyNotice, timeout_s: float, from_position: int = 0) -> KVPayload:
        """The notice's KV; `from_position` > 0: positions from there on only (this pod holds the
        rest), though a prefill pod that predates parts sends it whole (payload.start 0)."""
        calls: list = []  # the call, once the thread started it: cancelled if this pull is
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._pull, notice, timeout_s, calls,
                                                                    from_position)
        except asyncio.CancelledError:
            for call in calls:
                call.cancel()
            raise

    def _pull(self, notice: ReadyNotice, timeout_s: float, calls: list, from_position: int = 0) -> KVPayload:
        """One pull on a worker thread: messages' serialized bytes, read by `kvcodec.parse_chunk`
        without the copies a protobuf parse makes."""
        rid = notice.request.request_id
        dec = kvcodec.Decoder()
        call = None
        try:
            call = self._sync_pull(notice.address)(
                kv_pb2.PullKVRequest(request_id=rid, capability=notice.capability, from_position=from_position),
                timeout=timeout_s)
            calls.append(call)
            for m in call:
                dec.add(kvcodec.parse_chunk(m))
            payload = dec.finish()
            if payload.start not in (0, from_position):
                raise KVTransferFailed(f"asked for positions from {from_position}, got them from {payload.start}")
            return payload
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            # a decode pod presents the capability its notice carries: refused, the KV held under
            # the id is another prefill's (prefill_svc/service.py), and this notice is stale
            superseded = code == grpc.StatusCode.PERMISSION_DENIED and (details or "").startswith(WRONG_CAPABILITY)
            raise (KVSuperseded if superseded else KVTransferFailed)(
                f"KV pull of request {rid} from {notice.address} failed: {getattr(code, 'name', code)}: {details}"
            ) from e
        except KVTransferFailed as e:
            if call is not None:
                call.cancel()  # stop the sender now, not when the call is collected
            raise KVTransferFailed(f"KV pull of request {rid} from {notice.address} failed: {e.message}") from e

    async def release(self, notice: ReadyNotice, timeout_s: float = 5.0) -> bool:
        """Tell the prefill pod to free a KV nobody will pull (request cancelled). Best effort:
        if this fails, the prefill pod's lease frees it."""
        try:
            resp = await self._stub(notice.address).ReleaseKV(
                kv_pb2.ReleaseKVRequest(request_id=notice.request.request_id, capability=notice.capability),
                timeout=timeout_s,
            )
            return resp.released
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        for ch, *_ in self._stubs.values():
            await ch.close()
        self._stubs.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._sync_lock:
            for ch, _pull in self._sync.values():
                ch.close()
            self._sync.clear()
