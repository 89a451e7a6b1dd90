"""The KV transfer gRPC servicer: streams a held prefill result to the decode pod that claimed it.

A pull MUST present the request's capability token (else PERMISSION_DENIED, nothing sent). The KV
is released after the last chunk has been sent, or by an explicit ReleaseKV.

Register it with `servicer.add_to_server(server)`: PullKV's messages are then serialized by
`kvcodec.serialize_chunk` (the same bytes protobuf writes, with one copy of the data and no
protobuf arena; measured several times cheaper per byte). Registered with the generated
`kv_pb2_grpc.add_KVTransferServicer_to_server` it still works, through protobuf messages.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import grpc

from prefill_svc.kv_store import KVStore
from tandem_core import kvcodec
from tandem_core.types import KVPayload
from tandem_proto import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name


class KVTransferServicer(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, store: KVStore, chunk_bytes: int, on_release: Callable[[str], None]) -> None:
        self._store = store
        self._chunk_bytes = chunk_bytes
        self._on_release = on_release
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-encode")
        self._raw = False  # True once registered by add_to_server: PullKV yields serialized bytes

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Like `kv_pb2_grpc.add_KVTransferServicer_to_server`, with PullKV's messages serialized by
        `kvcodec.serialize_chunk`."""
        self._raw = True
        handlers = {
            "PullKV": grpc.unary_stream_rpc_method_handler(
                self.PullKV, request_deserializer=kv_pb2.PullKVRequest.FromString, response_serializer=None),
            "ReleaseKV": grpc.unary_unary_rpc_method_handler(
                self.ReleaseKV, request_deserializer=kv_pb2.ReleaseKVRequest.FromString,
                response_serializer=kv_pb2.ReleaseKVResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)

    def _check(self, request_id: str, capability: str):
        held = self._store.get(request_id)
        if held is None:
            return None, (grpc.StatusCode.NOT_FOUND, f"no KV held for request {request_id} (released or lease ended)")
        if not hmac.compare_digest(held.capability.encode(), capability.encode()):
            # (a decode pod presenting a notice's own capability gets this only when a later prefill
            # of the same request replaced the KV: decode_svc/puller.py reads it as superseded)
            return None, (grpc.StatusCode.PERMISSION_DENIED,
                          f"wrong capability for request {request_id} (the KV held under it is another prefill's)")
        return held, None

    async def PullKV(self, request, context):
        held, err = self._check(request.request_id, request.capability)
        if err:
            await context.abort(*err)
        payload = held.payload
        start = int(request.from_position)
        if start:  # the puller holds positions [0, start) already: the rest only
            if not 0 < start < payload.true_length:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"from_position {start} is outside (0, {payload.true_length}) for request "
                                    f"{request.request_id}")
            n = payload.true_length
            payload = KVPayload(k=payload.k[:, start:n], v=payload.v[:, start:n], true_length=n,
                                first_token=payload.first_token, start=start)
        held.pulls += 1
        sent = 0
        # Chunks are encoded (running CRC, the copy out of the held arrays) on a worker thread, the
        # next one while this one is being sent: at most two chunks of a pull are in memory here.
        # (Encoding the first one on the event loop instead measured slower.)
        loop = asyncio.get_running_loop()
        chunks = kvcodec.encode(payload, self._chunk_bytes)
        nxt = loop.run_in_executor(self._pool, _message, chunks, self._raw)
        held.pulling += 1  # (its lease waits for it: KVStore.expired)
        try:
            while (got := await nxt) is not None:
                nxt = loop.run_in_executor(self._pool, _message, chunks, self._raw)
                yield got[0]
                sent += got[1]
        finally:
            nxt.cancel()  # a pull cut short (cancelled, deadline) drops the chunk it prefetched
            held.pulling -= 1
        # The last chunk was handed to the transport: the decode pod has everything.
        if self._store.release(request.request_id):
            self._on_release(request.request_id)
        log.debug("kv pulled request_id=%s bytes=%d", request.request_id, sent)

    async def ReleaseKV(self, request, context):
        held, err = self._check(request.request_id, request.capability)
        if err:
            if err[0] == grpc.StatusCode.NOT_FOUND:
                return kv_pb2.ReleaseKVResponse(released=False)
            await context.abort(*err)
        released = self._store.release(request.request_id)
        if released:
            self._on_release(request.request_id)
        return kv_pb2.ReleaseKVResponse(released=released)


def _message(chunks: Iterator[kvcodec.Chunk], raw: bool) -> tuple[bytes | kv_pb2.KVChunk, int] | None:
    """The next chunk as a message (serialized bytes when `raw`) and its data size; None at the end."""
    c = next(chunks, None)
    if c is None:
        return None
    if raw:
        return kvcodec.serialize_chunk(c), len(c.data)
    return kv_pb2.KVChunk(seq=c.seq, total=c.total, header=c.header, data=bytes(c.data), crc32=c.crc32), len(c.data)
