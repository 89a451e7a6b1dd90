"""gRPC helpers: server bootstrap with health and reflection, and error <-> status mapping."""
from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem_core.errors import TandemError

log = logging.getLogger(__name__)


def make_server(max_message_bytes: int) -> grpc.aio.Server:
    opts = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    return grpc.aio.server(options=opts)


def add_health(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """grpc.health.v1 for Kubernetes' native `grpc:` probes; starts NOT_SERVING until ready."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


async def set_serving(h: health.aio.HealthServicer, names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for n in ["", *names]:
        await h.set(n, status)


def add_reflection(server: grpc.aio.Server, full_names: list[str]) -> None:
    reflection.enable_server_reflection([*full_names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    return bound


def status_code(err: TandemError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)


async def abort_with(context: grpc.aio.ServicerContext, err: Exception, request_id: str = "") -> None:
    """Map any exception onto a gRPC status in one place; unknown ones are INTERNAL and logged."""
    if isinstance(err, TandemError):
        await context.abort(status_code(err), err.message)
    log.exception("unhandled error request_id=%s", request_id)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}")
