"""The chart's pods as Docker containers: each container is started from the locally built image
(make base-image images) with what the rendered chart gives its pod, read from the rendered
manifests rather than restated here: the command, the environment (ConfigMap keys, values, Secret
keys, the downward API), the security context (user and group, read-only root filesystem,
capabilities dropped, no privilege escalation), the emptyDir volumes (tmpfs of the same size), the
memory limit, and the probes, which are waited on as the kubelet would (startup, then readiness).

What Kubernetes does that Docker does not is replaced, and only that: a pod's IP (status.podIP) is
its container's name on the Docker network (Docker's DNS resolves it), a Service's DNS name is a
network alias of the Redis container, a Secret volume is a read-only bind mount of a directory
holding the rendered Secret's keys, a StatefulSet's claim is a tmpfs. One deviation is chosen, for
time: the workers' JAX compilation cache (an emptyDir per pod in the chart) can be one host
directory they share (`shared`), so a second decode pod loads what the first compiled.

Nothing is pulled: an image that is not here is a reason not to run (`missing_engine_reason`).
"""
from __future__ import annotations

import base64
import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
TAG = yaml.safe_load((ROOT / "charts/tandem/Chart.yaml").read_text())["appVersion"]
IMAGES = {"gateway": f"tandem-gateway:{TAG}", "worker": f"tandem-worker-cpu:{TAG}", "redis": f"tandem-redis:{TAG}"}


def missing_engine_reason() -> str | None:
    """None when a Docker engine answers and every image is here; else why the tests cannot run."""
    if os.environ.get("TANDEM_TEST_NO_DOCKER"):
        return "TANDEM_TEST_NO_DOCKER is set"
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as e:  # noqa: BLE001  (any failure to reach the engine is the reason reported)
        return (f"no Docker engine reachable ({type(e).__name__}: {str(e)[:120]}); as root, .ci/run installs "
                "docker.io and starts dockerd (overlay2, or vfs)")
    try:
        missing = []
        for image in IMAGES.values():
            try:
                client.images.get(image)
            except docker.errors.ImageNotFound:
                missing.append(image)
    finally:
        client.close()
    if missing:
        return f"images not built here: {', '.join(missing)} (make base-image images; nothing is pulled)"
    return None


def _bytes(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(quantity))
    assert m, f"unexpected quantity {quantity!r}"
    return int(m.group(1)) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}[m.group(2)]


def secret_value(rendered, name: str, key: str) -> str | None:
    for s in rendered.kind("Secret"):
        if s["metadata"]["name"] == name:
            if key in (s.get("stringData") or {}):
                return s["stringData"][key]
            if key in (s.get("data") or {}):
                return base64.b64decode(s["data"][key]).decode()
    return None


@dataclass
class Pod:
    """One started container: `name` is its pod name, container name and DNS name on the network."""
    name: str
    container: object  # testcontainers DockerContainer
    ports: dict[str, int]  # the chart's port name -> container port
    spec: dict  # the chart's container spec
    host: str = "localhost"
    secret_dirs: list[tempfile.TemporaryDirectory] = field(default_factory=list)

    def host_port(self, port: int | str) -> int:
        number = self.ports[port] if isinstance(port, str) else port
        return int(self.container.get_exposed_port(number))

    def logs(self) -> str:
        out, err = self.container.get_logs()
        return (out + err).decode(errors="replace")

    def running(self) -> bool:
        w = self.container.get_wrapped_container()
        w.reload()
        return w.status == "running"

    def kill(self) -> None:
        """SIGKILL, as a node losing the pod would (nothing drains)."""
        self.container.get_wrapped_container().kill(signal="SIGKILL")


def container_env(rendered, workload: dict, pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would set it, from the rendered objects
    (envFrom ConfigMaps first, then env, which wins)."""
    c = workload["spec"]["template"]["spec"]["containers"][0]
    declared: dict[str, dict] = {}
    for src in c.get("envFrom", []):
        declared.update({k: {"value": v} for k, v in rendered.get("ConfigMap", src["configMapRef"]["name"])["data"].items()})
    declared.update({e["name"]: e for e in c.get("env", [])})
    env: dict[str, str] = {}
    for name, e in declared.items():
        if "value" in e:
            env[name] = str(e["value"])
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            assert path in ("metadata.name", "status.podIP"), f"{name}: downward API {path} not translated"
            env[name] = pod_name  # the pod's IP: its name, which Docker's DNS resolves on the network
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            value = secret_value(rendered, ref["name"], ref["key"])
            assert value is not None or ref.get("optional"), f"{name}: Secret {ref['name']}/{ref['key']} not rendered"
            if value is not None:
                env[name] = value
        else:
            raise AssertionError(f"{name}: {src} not translated")
    return env


def start_pod(rendered, workload: dict, pod_name: str, image: str, network, aliases: list[str] = (),
              shared: dict[str, str] | None = None, env: dict[str, str] | None = None) -> Pod:
    """Start `workload`'s (first) container as the chart's pod spec says, on `network`. `shared`:
    emptyDir mount paths to bind to a host directory instead of a tmpfs of their own; `env`: a
    test's variables beside the chart's (a fault plan)."""
    shared = shared or {}
    from testcontainers.core.container import DockerContainer

    pod_spec = workload["spec"]["template"]["spec"]
    c = pod_spec["containers"][0]
    psc, csc = pod_spec.get("securityContext", {}), c.get("securityContext", {})
    uid, gid = csc.get("runAsUser", psc.get("runAsUser")), csc.get("runAsGroup", psc.get("runAsGroup"))
    assert uid and gid and (csc.get("runAsNonRoot") or psc.get("runAsNonRoot")), "the chart runs every pod as non-root"
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    # A StatefulSet's claim (the bundled Redis' /data): a tmpfs of the claim's size, not kept.
    volumes.update({t["metadata"]["name"]: {"emptyDir": {"sizeLimit": t["spec"]["resources"]["requests"]["storage"]}}
                    for t in workload["spec"].get("volumeClaimTemplates", [])})
    tmpfs: dict[str, str] = {}
    binds: dict[str, dict] = {}
    secret_dirs = []
    for m in c.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "emptyDir" in v:
            size = v["emptyDir"].get("sizeLimit")
            if m["mountPath"] in shared:
                binds[shared[m["mountPath"]]] = {"bind": m["mountPath"], "mode": "rw"}
                continue
            # An emptyDir is writable by the pod's user: Docker's tmpfs over a directory the image
            # has takes that directory's mode, so the owner is given too (uid, and fsGroup's gid).
            opts = f"mode=1777,uid={uid},gid={psc.get('fsGroup', gid)}"
            tmpfs[m["mountPath"]] = f"size={_bytes(size)},{opts}" if size else opts
        elif "secret" in v:
            d = tempfile.TemporaryDirectory(prefix="tandem-secret-")
            secret_dirs.append(d)
            os.chmod(d.name, 0o755)
            name = v["secret"]["secretName"]
            obj = [x for x in rendered.kind("Secret") if x["metadata"]["name"] == name]
            assert obj, f"{pod_name}: Secret {name} not rendered"
            items = v["secret"].get("items") or [{"key": k, "path": k} for k in
                                                  {**(obj[0].get("data") or {}), **(obj[0].get("stringData") or {})}]
            for item in items:
                value = secret_value(rendered, name, item["key"])
                assert value is not None, f"{pod_name}: Secret {name}/{item['key']} not rendered"
                (Path(d.name) / item["path"]).write_text(value)
                os.chmod(Path(d.name) / item["path"], 0o444)
            binds[d.name] = {"bind": m["mountPath"], "mode": "ro"}
        elif "configMap" in v:
            d = tempfile.TemporaryDirectory(prefix="tandem-configmap-")
            secret_dirs.append(d)
            os.chmod(d.name, 0o755)
            cm = rendered.get("ConfigMap", v["configMap"]["name"])
            for key, value in cm["data"].items():
                (Path(d.name) / key).write_text(value)
                os.chmod(Path(d.name) / key, 0o444)
            binds[d.name] = {"bind": m["mountPath"], "mode": "ro"}
        else:
            raise AssertionError(f"{pod_name}: volume {v} not translated")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    kwargs = {
        "user": f"{uid}:{gid}",
        "read_only": bool(csc.get("readOnlyRootFilesystem")),
        "cap_drop": csc.get("capabilities", {}).get("drop", []),
        "security_opt": ["no-new-privileges"] if csc.get("allowPrivilegeEscalation") is False else [],
        "group_add": [str(psc["fsGroup"])] if "fsGroup" in psc else [],
        "entrypoint": c["command"],
    }
    limit = (c.get("resources") or {}).get("limits", {}).get("memory")
    if limit:
        kwargs["mem_limit"] = _bytes(limit)
    container = (DockerContainer(image).with_name(pod_name).with_network(network)
                 .with_network_aliases(pod_name, *aliases).with_exposed_ports(*ports.values())
                 .with_kwargs(**kwargs))
    container.tmpfs.update(tmpfs)  # docker's option strings (size=...), as they are
    container.volumes.update(binds)
    if c.get("args"):
        container = container.with_command(c["args"])
    for k, val in {**container_env(rendered, workload, pod_name), **(env or {})}.items():
        container = container.with_env(k, val)
    container.start()
    return Pod(pod_name, container, ports, c, container.get_container_host_ip(), secret_dirs)


def probe_once(pod: Pod, probe: dict) -> bool:
    """One probe of the chart's kind (httpGet, grpc, tcpSocket), from outside, against the
    published port: True when it passes."""
    timeout = probe.get("timeoutSeconds", 1)
    try:
        if "httpGet" in probe:
            g = probe["httpGet"]
            r = httpx.get(f"http://{pod.host}:{pod.host_port(g['port'])}{g.get('path', '/')}", timeout=timeout)
            return 200 <= r.status_code < 400
        if "grpc" in probe:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with grpc.insecure_channel(f"{pod.host}:{pod.host_port(probe['grpc']['port'])}") as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        if "tcpSocket" in probe:
            with socket.create_connection((pod.host, pod.host_port(probe["tcpSocket"]["port"])), timeout=timeout):
                return True
        if "exec" in probe:
            code, _ = pod.container.get_wrapped_container().exec_run(probe["exec"]["command"], user=None)
            return code == 0
    except Exception:  # noqa: BLE001  (a probe that errors fails, as the kubelet counts it)
        return False
    raise AssertionError(f"{pod.name}: probe {probe} not translated")


def wait_started(pod: Pod, scale: float = 1.0) -> float:
    """Wait as the kubelet would: the startup probe until it passes (at most failureThreshold x
    periodSeconds), then the readiness probe. Returns the seconds it took; fails with the
    container's log if the container exits or a probe runs out of tries."""
    t0 = time.monotonic()
    for kind in ("startupProbe", "readinessProbe"):
        probe = pod.spec.get(kind)
        if not probe:
            continue
        budget = probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10) * scale
        deadline = time.monotonic() + budget
        while not probe_once(pod, probe):
            if not pod.running():
                raise AssertionError(f"{pod.name} exited before its {kind} passed:\n{pod.logs()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{pod.name}: {kind} did not pass in {budget:.0f} s:\n{pod.logs()[-4000:]}")
            time.sleep(min(1.0, probe.get("periodSeconds", 10)))
    return time.monotonic() - t0


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def unique_prefix() -> str:
    return f"tandem-ct-{uuid.uuid4().hex[:6]}"
