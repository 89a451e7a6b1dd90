"""The planner's Kubernetes calls against a real cluster, when one is reachable (KUBECONFIG set):
the Lease is created and renewed, and a Deployment's scale subresource is read and patched.
Without a cluster the same calls are exercised against `RecordingApi` (tests/unit/test_planner.py
and tests/integration/test_planner.py), which records exactly the requests sent here."""
from __future__ import annotations

import os
import time
import uuid

import pytest

pytestmark = pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="no Kubernetes cluster (KUBECONFIG unset)")


async def test_lease_and_scale_on_a_real_cluster():
    from kubernetes import client

    from planner.kube import KubeApi, LeaseKeeper

    api = KubeApi()
    ns = os.environ.get("TANDEM_TEST_NAMESPACE", "default")
    name = f"tandem-planner-test-{uuid.uuid4().hex[:6]}"
    apps = client.AppsV1Api()
    labels = {"app": name}
    apps.create_namespaced_deployment(ns, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": 0, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "pause", "image": "registry.k8s.io/pause:3.9"}]}}}})
    try:
        keeper = LeaseKeeper(api, ns, name, "test-a", 15, time.time)
        assert await keeper.refresh()  # created
        assert await keeper.refresh()  # renewed
        other = LeaseKeeper(api, ns, name, "test-b", 15, time.time)
        assert not await other.refresh()
        assert await api.read_scale(ns, name) == 0
        await api.patch_scale(ns, name, 1)
        assert await api.read_scale(ns, name) == 1
    finally:
        apps.delete_namespaced_deployment(name, ns)
        client.CoordinationV1Api().delete_namespaced_lease(name, ns)
