"""KV pull client: fetch one prefill result from the prefill pod named in its ready notice.

One gRPC channel per prefill address, reused. Every pull has a deadline; any failure (pod gone,
wrong capability, checksum mismatch, deadline) becomes `KVTransferFailed` with the reason.
"""
from __future__ import annotations

import grpc

from tandem_core import grpc_util, kvcodec
from tandem_core.errors import KVTransferFailed
from tandem_core.settings import GrpcConfig
from tandem_core.bus.ready import ReadyNotice
from tandem_core.types import KVPayload
from tandem_proto import kv_pb2, kv_pb2_grpc

_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
PULL_METHOD = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['PullKV'].name}"


class KVPuller:
    def __init__(self, max_message_bytes: int, max_channels: int = 64, tls: GrpcConfig | None = None) -> None:
        self._opts = [("grpc.max_receive_message_length", max_message_bytes)]
        self._tls = tls
        self._stubs: dict[str, tuple[grpc.aio.Channel, kv_pb2_grpc.KVTransferStub, object]] = {}
        self._max_channels = max_channels

    def _stub(self, address: str) -> kv_pb2_grpc.KVTransferStub:
        return self._get(address)[1]

    def _pull_call(self, address: str):
        """PullKV returning each message's serialized bytes: `kvcodec.parse_chunk` reads them
        without the copies a protobuf parse makes."""
        return self._get(address)[2]

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

    async def pull(self, notice: ReadyNotice, timeout_s: float) -> KVPayload:
        rid = notice.request.request_id
        dec = kvcodec.Decoder()
        call = None
        try:
            call = self._pull_call(notice.address)(
                kv_pb2.PullKVRequest(request_id=rid, capability=notice.capability), timeout=timeout_s
            )
            async for m in call:
                dec.add(kvcodec.parse_chunk(m))
            return dec.finish()
        except grpc.aio.AioRpcError as e:
            raise KVTransferFailed(
                f"KV pull of request {rid} from {notice.address} failed: {e.code().name}: {e.details()}"
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
