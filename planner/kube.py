"""The planner's Kubernetes calls: the Deployments' scale subresource, and one active planner
through a coordination.k8s.io/v1 Lease (the leader-election pattern of client-go, by hand).

`lease_action` and `lease_body` are pure (unit-tested); `KubeApi` makes the real calls with the
`kubernetes` client (in a thread: it is synchronous); `RecordingApi` is the same five calls
against an in-memory object store, writing each request it would send as one JSON line, which is
how the planner runs without a cluster (setting kubernetes.record_file) and how the tests see
exactly what would be sent. The tests run the real client too when KUBECONFIG is set.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import socket
import threading
from pathlib import Path

log = logging.getLogger(__name__)
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class Conflict(RuntimeError):
    """Someone else wrote the Lease between our read and our write (HTTP 409)."""


def default_namespace(configured: str) -> str:
    if configured:
        return configured
    try:
        return SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def default_identity(configured: str) -> str:
    return configured or f"{socket.gethostname()}-{os.getpid()}"


def _ts(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_ts(s: object) -> float | None:
    if isinstance(s, dt.datetime):
        return s.timestamp()
    if not s:
        return None
    return dt.datetime.fromisoformat(str(s).replace("Z", "+00:00")).timestamp()


def lease_action(lease: dict | None, me: str, now: float) -> str:
    """"create" (no Lease yet), "renew" (ours), "take" (expired or released), or "wait"."""
    if lease is None:
        return "create"
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if holder == me:
        return "renew"
    renewed = _parse_ts(spec.get("renewTime")) or _parse_ts(spec.get("acquireTime"))
    duration = float(spec.get("leaseDurationSeconds") or 0)
    if not holder or renewed is None or now > renewed + duration:
        return "take"
    return "wait"


def lease_body(name: str, namespace: str, me: str, duration_s: int, now: float, previous: dict | None) -> dict:
    """The Lease to write for `lease_action`'s create/renew/take (keeps resourceVersion for the
    optimistic-concurrency check, acquireTime while we hold it, and counts transitions)."""
    spec = dict((previous or {}).get("spec") or {})
    meta = {"name": name, "namespace": namespace}
    rv = ((previous or {}).get("metadata") or {}).get("resourceVersion")
    if rv:
        meta["resourceVersion"] = rv
    taking = spec.get("holderIdentity") != me
    if taking:
        spec["acquireTime"] = _ts(now)
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if previous else 0)
    spec.update(holderIdentity=me, leaseDurationSeconds=int(duration_s), renewTime=_ts(now))
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


def scale_patch(replicas: int) -> dict:
    return {"spec": {"replicas": int(replicas)}}


class KubeApi:
    """The real calls, through the `kubernetes` client (in-cluster config, else KUBECONFIG)."""

    def __init__(self) -> None:
        from kubernetes import client, config  # imported here: only mode=kubernetes needs it

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self._client = client
        self.apps, self.coord = client.AppsV1Api(), client.CoordinationV1Api()
        self._serialize = client.ApiClient().sanitize_for_serialization

    async def read_scale(self, namespace: str, name: str) -> int:
        s = await asyncio.to_thread(self.apps.read_namespaced_deployment_scale, name, namespace)
        return int(s.spec.replicas or 0)

    async def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        await asyncio.to_thread(self.apps.patch_namespaced_deployment_scale, name, namespace, scale_patch(replicas))

    async def read_lease(self, namespace: str, name: str) -> dict | None:
        try:
            obj = await asyncio.to_thread(self.coord.read_namespaced_lease, name, namespace)
        except self._client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return self._serialize(obj)

    async def write_lease(self, namespace: str, body: dict, create: bool) -> dict:
        try:
            if create:
                obj = await asyncio.to_thread(self.coord.create_namespaced_lease, namespace, body)
            else:
                obj = await asyncio.to_thread(self.coord.replace_namespaced_lease, body["metadata"]["name"],
                                              namespace, body)
        except self._client.ApiException as e:
            if e.status == 409:
                raise Conflict(str(e.reason)) from None
            raise
        return self._serialize(obj)


class RecordingApi:
    """KubeApi's calls against an in-memory store (shared by every instance given the same
    `store`), each request appended to `record_file` (if set) and to `calls`."""

    def __init__(self, record_file: str = "", store: dict | None = None, replicas: dict[str, int] | None = None) -> None:
        self.record_file, self.calls = record_file, []
        self.store = store if store is not None else {"scale": dict(replicas or {}), "leases": {}, "rv": 0}
        self._lock = threading.Lock()

    def _record(self, verb: str, path: str, body: dict | None = None) -> None:
        call = {"verb": verb, "path": path, **({"body": body} if body is not None else {})}
        self.calls.append(call)
        if self.record_file:
            with open(self.record_file, "a") as f:
                f.write(json.dumps(call) + "\n")

    async def read_scale(self, namespace: str, name: str) -> int:
        self._record("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale")
        if name not in self.store["scale"]:
            raise LookupError(f"deployment {namespace}/{name} not found")
        return self.store["scale"][name]

    async def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        self._record("PATCH", f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale", scale_patch(replicas))
        self.store["scale"][name] = int(replicas)

    async def read_lease(self, namespace: str, name: str) -> dict | None:
        self._record("GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}")
        got = self.store["leases"].get((namespace, name))
        return json.loads(json.dumps(got)) if got else None

    async def write_lease(self, namespace: str, body: dict, create: bool) -> dict:
        name = body["metadata"]["name"]
        base = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._record("POST" if create else "PUT", base if create else f"{base}/{name}", body)
        with self._lock:
            have = self.store["leases"].get((namespace, name))
            if create and have is not None:
                raise Conflict(f"lease {name} already exists")
            if not create and (have is None or have["metadata"]["resourceVersion"]
                               != body["metadata"].get("resourceVersion")):
                raise Conflict(f"lease {name} was modified")
            self.store["rv"] += 1
            obj = json.loads(json.dumps(body))
            obj["metadata"]["resourceVersion"] = str(self.store["rv"])
            self.store["leases"][(namespace, name)] = obj
        return json.loads(json.dumps(obj))


class LeaseKeeper:
    """Holds (or waits for) the Lease; `leader` says whether this planner may scale now."""

    def __init__(self, api, namespace: str, name: str, identity: str, duration_s: int, clock) -> None:
        self.api, self.namespace, self.name = api, namespace, name
        self.identity, self.duration_s, self.clock = identity, duration_s, clock
        self.leader = False
        self._renewed = float("-inf")

    async def refresh(self) -> bool:
        """Create, renew or take the Lease, or see that another planner holds it."""
        now = self.clock()
        lease = await self.api.read_lease(self.namespace, self.name)
        action = lease_action(lease, self.identity, now)
        was = self.leader
        if action == "wait":
            self.leader = False
        else:
            body = lease_body(self.name, self.namespace, self.identity, self.duration_s, now, lease)
            try:
                await self.api.write_lease(self.namespace, body, create=action == "create")
                self.leader, self._renewed = True, now
            except Conflict:
                self.leader = False
        if self.leader != was:
            log.info("planner %s %s the lease %s/%s", self.identity, "holds" if self.leader else "lost",
                     self.namespace, self.name)
        return self.leader
