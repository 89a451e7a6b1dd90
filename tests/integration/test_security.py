"""Security of the internal paths: KV pulls over mutual TLS (a peer without a CA-signed
certificate gets nothing), and Redis with a password (wrong or missing: a clear error)."""
from __future__ import annotations

import datetime
import ipaddress

import grpc

import numpy as np
import pytest
import redis.asyncio as aioredis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_svc.puller import KVPuller
from prefill_svc.app import KV_SERVICE
from prefill_svc.kv_store import KVStore
from prefill_svc.service import KVTransferServicer
from tandem.redis_proc import RedisProcess, free_port
from tandem_core import grpc_util
from tandem_core.bus import conn, groups
from tandem_core.errors import KVTransferFailed
from tandem_core.settings import GrpcConfig, RedisConfig, WorkerSettings
from tandem_core.worker_pod import WorkerPod
from tandem_core.bus.ready import ReadyNotice
from tandem_core.types import GenerationRequest, KVPayload
from tandem_proto import kv_pb2_grpc
from tandem_core.keys import KeySpace

KS = KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)


def _cert(name: str, issuer_key, issuer_name, key, ca: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
         .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("tandem-prefill"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(tmp, name, cert, key):
    (tmp / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return str(tmp / f"{name}.crt"), str(tmp / f"{name}.key")


@pytest.fixture
def pki(tmp_path):
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("tandem-ca", ca_key, None, ca_key, ca=True)
    ca_file, _ = _write(tmp_path, "ca", ca, ca_key)
    out = {}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert, keyf = _write(tmp_path, name, _cert(name, ca_key, ca.subject, key), key)
        out[name] = GrpcConfig(tls_cert_file=cert, tls_key_file=keyf, tls_ca_file=ca_file)
    rogue_key = ec.generate_private_key(ec.SECP256R1())  # self-signed: not from the CA
    rogue = _cert("rogue", rogue_key, None, rogue_key)
    cert, keyf = _write(tmp_path, "rogue", rogue, rogue_key)
    out["rogue"] = GrpcConfig(tls_cert_file=cert, tls_key_file=keyf, tls_ca_file=ca_file)
    return out


async def test_kv_pull_over_mutual_tls(pki):
    store = KVStore(1 << 24, 60)
    server = grpc_util.make_server(8 << 20)
    kv_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(store, 4096, lambda _r: None), server)
    port = grpc_util.bind(server, "127.0.0.1", 0, pki["server"])
    await server.start()
    p = KVPayload(np.ones((2, 8, 2, 4), np.float32), np.zeros((2, 8, 2, 4), np.float32), 7, 3)
    try:
        for rid in ("a", "b", "c"):
            store.put(rid, p)

        def notice(rid):
            return ReadyNotice(GenerationRequest(rid, [1], 2), f"127.0.0.1:{port}", store.get(rid).capability,
                               0, "p", 3)

        good = KVPuller(8 << 20, tls=pki["client"])
        got = await good.pull(notice("a"), timeout_s=10)
        assert np.array_equal(got.k, p.k)
        for cfg in (None, pki["rogue"]):  # plaintext, or a certificate the CA did not sign
            bad = KVPuller(8 << 20, tls=cfg)
            with pytest.raises(KVTransferFailed):
                await bad.pull(notice("b"), timeout_s=3)
            await bad.close()
        assert store.get("b") is not None  # nothing was handed out
        await good.close()
    finally:
        await server.stop(None)


async def test_redis_password_required_and_used():
    proc = RedisProcess(password="s3cret-pw").start()
    try:
        url = f"redis://127.0.0.1:{proc.port}/0"
        ok = conn.connect(RedisConfig(url=url, password="s3cret-pw"))
        await groups.ensure_groups(ok, KS, "sec")
        assert await ok.ping()
        await ok.aclose()
        for pw in (None, "wrong"):
            bad = conn.connect(RedisConfig(url=url, password=pw))
            with pytest.raises(Exception, match="(?i)auth|password|NOAUTH"):
                await bad.ping()
            await bad.aclose()
        in_url = aioredis.Redis.from_url(proc.url)  # redis://:password@host/0 works too
        assert await in_url.ping()
        await in_url.aclose()
    finally:
        proc.close()


async def _health(address: str, service: str, cfg: GrpcConfig | None = None) -> int:
    async with grpc_util.channel(address, cfg) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status


async def test_mtls_port_with_a_plaintext_health_port(pki):
    """A worker pod with mutual TLS and `grpc.health_port` (how the chart runs it): the TLS port
    refuses plaintext, the health port answers grpc.health.v1 in plaintext (NOT_SERVING until
    ready, SERVING, NOT_SERVING once draining) and nothing else, and the KV pull works over mTLS."""
    server_cfg = pki["server"].model_copy(update={"host": "127.0.0.1", "health_port": free_port()})
    s = WorkerSettings(grpc=server_cfg)
    r = aioredis.Redis(host="127.0.0.1", port=1)  # never used: no heartbeats in this test
    pod = WorkerPod(s, r, [KV_SERVICE])
    store = KVStore(1 << 24, 60)
    kv_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(store, 4096, lambda _r: None), pod.server)
    address = pod.bind()
    await pod.start()
    health_address = f"127.0.0.1:{pod.health_port}"
    p = KVPayload(np.ones((2, 8, 2, 4), np.float32), np.zeros((2, 8, 2, 4), np.float32), 7, 3)
    try:
        assert pod.health_port == server_cfg.health_port
        for name in ("", KV_SERVICE):  # plaintext, before ready: NOT_SERVING
            assert await _health(health_address, name) == health_pb2.HealthCheckResponse.NOT_SERVING
        await pod.ready()
        for name in ("", KV_SERVICE):
            assert await _health(health_address, name) == health_pb2.HealthCheckResponse.SERVING
        assert await _health(address, KV_SERVICE, pki["client"]) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as plain:  # the TLS port: no plaintext, not even health
            await _health(address, KV_SERVICE)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        store.put("a", p)
        store.put("b", p)

        def notice(rid, at):
            return ReadyNotice(GenerationRequest(rid, [1], 2), at, store.get(rid).capability, 0, "p", 3)

        good = KVPuller(8 << 20, tls=pki["client"])
        got = await good.pull(notice("a", address), timeout_s=10)
        assert np.array_equal(got.k, p.k) and np.array_equal(got.v, p.v)
        await good.close()
        plain_puller = KVPuller(8 << 20, tls=None)  # the health port serves health only: no KV there
        with pytest.raises(KVTransferFailed):
            await plain_puller.pull(notice("b", health_address), timeout_s=3)
        await plain_puller.close()
        assert store.get("b") is not None
        await pod.drain()
        assert await _health(health_address, KV_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await pod.close(0)


def test_health_port_must_differ_from_the_grpc_port():
    with pytest.raises(ValueError, match="health_port"):
        GrpcConfig(port=50061, health_port=50061)
