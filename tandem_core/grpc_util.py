"""gRPC helpers: server bootstrap with health and reflection, and error <-> status mapping.

Reflection is served as `grpc.reflection.v1alpha.ServerReflection` and, for newer clients
(grpcurl, Postman, grpcui try v1 first), as `grpc.reflection.v1.ServerReflection`. grpcio-reflection
ships v1alpha only (1.85.1 is the newest on PyPI), and the two protocols are the same messages
under another package name, field for field; so the v1 service is the same servicer behind a
generic handler, its messages parsed and written with the v1alpha classes (the bytes are the
same), and the v1 file descriptor (v1alpha's, renamed) is added to the pool so that clients can
resolve the v1 service itself too.
"""
from __future__ import annotations

import logging

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from tandem_core.errors import TandemError
from tandem_core.settings import GrpcConfig

log = logging.getLogger(__name__)


def make_server(max_message_bytes: int) -> grpc.aio.Server:
    opts = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    return grpc.aio.server(options=opts)


def add_health(server: grpc.aio.Server, service_names: list[str],
               also: grpc.aio.Server | None = None) -> health.aio.HealthServicer:
    """grpc.health.v1 for Kubernetes' native `grpc:` probes. As grpcio builds it, the server as a
    whole ("") answers SERVING and each named service NOT_FOUND until `set_serving` says otherwise:
    call `set_serving(..., False)` before the server starts to stay NOT_SERVING until ready (the
    worker pods do, tandem_core/worker_pod.py). `also`: a second server (the plaintext health
    port, `health_server`) answering from the same servicer, so both always say the same."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if also is not None:
        health_pb2_grpc.add_HealthServicer_to_server(servicer, also)
    return servicer


def health_server(host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A plaintext server for grpc.health.v1 only, on its own port (`GrpcConfig.health_port`):
    Kubernetes' native `grpc:` probes speak no TLS, so with mutual TLS on the main port they are
    pointed here. It serves nothing but health (add it with `add_health(..., also=)`): no data
    and no other service is reachable without a certificate. Returns the server and its port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the gRPC health port {host}:{port}")
    return server, bound


async def set_serving(h: health.aio.HealthServicer, names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for n in ["", *names]:
        await h.set(n, status)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor() -> None:
    """grpc/reflection/v1/reflection.proto in the default pool: v1alpha's file, package renamed."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = f".{fdp.package}.", ".grpc.reflection.v1."
    fdp.name, fdp.package = _V1_FILE, "grpc.reflection.v1"
    for msg in fdp.message_type:
        for f in msg.field:
            if f.type_name.startswith(old):
                f.type_name = new + f.type_name[len(old):]
    for svc in fdp.service:
        for m in svc.method:
            m.input_type, m.output_type = (new + t[len(old):] for t in (m.input_type, m.output_type))
    pool.AddSerializedFile(fdp.SerializeToString())


def add_reflection(server: grpc.aio.Server, full_names: list[str]) -> None:
    """Reflection v1alpha and v1 (see the module docstring), listing `full_names`, health and both."""
    _add_v1_descriptor()
    names = [*full_names, reflection.SERVICE_NAME, REFLECTION_V1, health.SERVICE_NAME]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),))


def bind(server: grpc.aio.Server, host: str, port: int, tls: GrpcConfig | None = None) -> int:
    """Listen on host:port; with `tls` configured, mutual TLS (clients need a CA-signed cert)."""
    if tls is not None and tls.tls:
        creds = grpc.ssl_server_credentials(
            [(_read(tls.tls_key_file), _read(tls.tls_cert_file))], root_certificates=_read(tls.tls_ca_file),
            require_client_auth=True,
        )
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    return bound


def channel(address: str, cfg: GrpcConfig | None, options: list[tuple] | None = None) -> grpc.aio.Channel:
    """A client channel to another pod: mutual TLS when `cfg` has certificates, else plaintext."""
    opts, creds = _client(cfg, options)
    return grpc.aio.insecure_channel(address, options=opts) if creds is None else \
        grpc.aio.secure_channel(address, creds, options=opts)


def sync_channel(address: str, cfg: GrpcConfig | None, options: list[tuple] | None = None) -> grpc.Channel:
    """`channel`'s blocking twin, for calls made from a worker thread (the decode pod's KV pulls:
    decode_svc/puller.py), with the same TLS rules."""
    opts, creds = _client(cfg, options)
    return grpc.insecure_channel(address, options=opts) if creds is None else \
        grpc.secure_channel(address, creds, options=opts)


def _client(cfg: GrpcConfig | None, options: list[tuple] | None) -> tuple[list[tuple], grpc.ChannelCredentials | None]:
    opts = list(options or [])
    if cfg is None or not cfg.tls:
        return opts, None
    if cfg.tls_server_name:
        opts.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(cfg.tls_ca_file), private_key=_read(cfg.tls_key_file),
        certificate_chain=_read(cfg.tls_cert_file),
    )
    return opts, creds


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def status_code(err: TandemError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)


async def abort_with(context: grpc.aio.ServicerContext, err: Exception, request_id: str = "") -> None:
    """Map any exception onto a gRPC status in one place; unknown ones are INTERNAL and logged."""
    if isinstance(err, TandemError):
        await context.abort(status_code(err), err.message)
    log.exception("unhandled error request_id=%s", request_id)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}")
