"""KV pull client: fetch one prefill result from the prefill pod named in its ready notice.

One gRPC channel per prefill address, reused. Every pull has a deadline; any failure (pod gone,
wrong capability, checksum mismatch, deadline) becomes `KVTransferFailed` with the reason.
"""
from __future__ import annotations

import grpc

from tandem_core import grpc_util, kvcodec
from tandem_core.errors import KVTransferFailed
from tandem_core.settings import GrpcConfig
from tandem_core.streams import ReadyNotice
from tandem_core.types import KVPayload
from tandem_proto import kv_pb2, kv_pb2_grpc


class KVPuller:
    def __init__(self, max_message_bytes: int, max_channels: int = 64, tls: GrpcConfig | None = None) -> None:
        self._opts = [("grpc.max_receive_message_length", max_message_bytes)]
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._max_channels = max_channels

    def _stub(self, address: str) -> kv_pb2_grpc.KVTransferStub:
        ch = self._channels.get(address)
        if ch is None:
            if len(self._channels) >= self._max_channels:  # bounded: drop the oldest
                _, old = self._channels.popitem()
                # closing is async; the channel is unreferenced and closes on GC
                del old
            ch = grpc_util.channel(address, self._tls, self._opts)
            self._channels[address] = ch
        return kv_pb2_grpc.KVTransferStub(ch)

    async def pull(self, notice: ReadyNotice, timeout_s: float) -> KVPayload:
        rid = notice.request.request_id
        dec = kvcodec.Decoder()
        try:
            call = self._stub(notice.address).PullKV(
                kv_pb2.PullKVRequest(request_id=rid, capability=notice.capability), timeout=timeout_s
            )
            async for m in call:
                dec.add(kvcodec.Chunk(m.seq, m.total, m.header, m.data, m.crc32, m.payload_crc32))
            return dec.finish()
        except grpc.aio.AioRpcError as e:
            raise KVTransferFailed(
                f"KV pull of request {rid} from {notice.address} failed: {e.code().name}: {e.details()}"
            ) from e

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
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
