"""The chart's internal gRPC mTLS, on by default: the certificate it makes works with the code.

The chart-made CA and certificate (Helm's genCA/genSignedCert, rendered offline) are read back from
the rendered Secret and used as a pod would use them, from the paths and the server name the chart
sets in its environment: a real gRPC server on loopback requiring mutual TLS answers a client with
the same material, refuses a plaintext one, and its plaintext health port answers the probe. The
probe ports themselves are checked in test_chart.py (test_probe_ports_exist_and_grpc_probes_are_native).
"""
from __future__ import annotations

import base64

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.redis_proc import free_port
from tandem_core import grpc_util
from tandem_core.settings import GrpcConfig
from tests.unit.kube_api import KubeAPI
from tests.unit.test_chart import NAMESPACE, RELEASE, SERVICES, render, rendered, seeded


async def _check(address: str, cfg: GrpcConfig | None) -> int:
    async with grpc_util.channel(address, cfg) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return reply.status


async def test_the_chart_made_certificate_serves_mutual_tls(tmp_path):
    r = rendered("default")
    secret = r.get("Secret", f"{RELEASE}-tandem-grpc-tls")
    assert secret["type"] == "kubernetes.io/tls"
    env = r.container_env("prefill")
    prefix = SERVICES["prefill"][1]
    mount = r.values["grpcTLS"]["mountPath"]
    files = {}
    for key in ("ca.crt", "tls.crt", "tls.key"):  # where the pod reads them: the Secret's keys under mountPath
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
        files[key] = str(tmp_path / key)
    assert env[prefix + "GRPC__TLS_CERT_FILE"]["value"] == f"{mount}/tls.crt"
    assert env[prefix + "GRPC__TLS_KEY_FILE"]["value"] == f"{mount}/tls.key"
    assert env[prefix + "GRPC__TLS_CA_FILE"]["value"] == f"{mount}/ca.crt"
    server_name = env[prefix + "GRPC__TLS_SERVER_NAME"]["value"]

    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    assert cert.issuer == ca.subject
    assert server_name in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usages and ExtendedKeyUsageOID.CLIENT_AUTH in usages  # one cert, both ends

    cfg = GrpcConfig(host="127.0.0.1", tls_cert_file=files["tls.crt"], tls_key_file=files["tls.key"],
                     tls_ca_file=files["ca.crt"], tls_server_name=server_name, health_port=free_port())
    server = grpc_util.make_server(1 << 20)
    port = grpc_util.bind(server, cfg.host, 0, cfg)
    health_srv, health_port = grpc_util.health_server(cfg.host, cfg.health_port)
    grpc_util.add_health(server, [], also=health_srv)
    await server.start()
    await health_srv.start()
    try:
        assert await _check(f"127.0.0.1:{port}", cfg) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await _check(f"127.0.0.1:{port}", None)
        assert await _check(f"127.0.0.1:{health_port}", None) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)
        await health_srv.stop(None)


def _tls_secret(files: dict[str, str]) -> dict:
    docs = [d for f, t in files.items() if f.endswith(".yaml") for d in yaml.safe_load_all(t) if isinstance(d, dict)]
    return next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{RELEASE}-tandem-grpc-tls")


def test_the_chart_made_ca_is_kept_across_upgrades():
    """`helm upgrade` (lookup sees the cluster: tests/unit/kube_api.py) renders the Secret the
    install made, unchanged; an offline render cannot see it and makes another (documented)."""
    values = seeded({})
    with KubeAPI() as api:
        installed = api.render(values, name=RELEASE, namespace=NAMESPACE, upgrade=False)
        first = _tls_secret(installed)
        api.apply(installed)
        for _ in range(2):
            assert _tls_secret(api.render(values, name=RELEASE, namespace=NAMESPACE, upgrade=True))["data"] == first["data"]
        # A Secret without the three keys (someone emptied it) is made again, whole.
        api.secrets[(NAMESPACE, first["metadata"]["name"])] = {**first, "data": {"ca.crt": first["data"]["ca.crt"]}}
        remade = _tls_secret(api.render(values, name=RELEASE, namespace=NAMESPACE, upgrade=True))["data"]
        assert set(remade) == {"ca.crt", "tls.crt", "tls.key"} and remade["ca.crt"] != first["data"]["ca.crt"]
    assert _tls_secret(render({}))["data"] != first["data"]
