"""The KV transfer gRPC servicer: streams a held prefill result to the decode pod that claimed it.

A pull MUST present the request's capability token (else PERMISSION_DENIED, nothing sent). The KV
is released after the last chunk has been sent, or by an explicit ReleaseKV.
"""
from __future__ import annotations

import hmac
import logging
from typing import Callable

import grpc

from prefill_svc.kv_store import KVStore
from tandem_core import kvcodec
from tandem_proto import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)


class KVTransferServicer(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, store: KVStore, chunk_bytes: int, on_release: Callable[[str], None]) -> None:
        self._store = store
        self._chunk_bytes = chunk_bytes
        self._on_release = on_release

    def _check(self, request_id: str, capability: str):
        held = self._store.get(request_id)
        if held is None:
            return None, (grpc.StatusCode.NOT_FOUND, f"no KV held for request {request_id} (released or lease ended)")
        if not hmac.compare_digest(held.capability.encode(), capability.encode()):
            return None, (grpc.StatusCode.PERMISSION_DENIED, f"wrong capability for request {request_id}")
        return held, None

    async def PullKV(self, request, context):
        held, err = self._check(request.request_id, request.capability)
        if err:
            await context.abort(*err)
        held.pulls += 1
        sent = 0
        for c in kvcodec.encode(held.payload, self._chunk_bytes):
            yield kv_pb2.KVChunk(
                seq=c.seq, total=c.total, header=c.header, data=c.data, crc32=c.crc32,
                payload_crc32=c.payload_crc32,
            )
            sent += len(c.data)
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
