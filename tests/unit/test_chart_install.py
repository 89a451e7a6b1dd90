"""`helm install` with no values: auth on, the API key and the Redis password generated once by
the install and kept by every `helm upgrade` (issue 44). Rendered as `helm install`/`helm upgrade`
render, with `lookup` seeing the cluster (a stand-in API server for Secrets: tests/unit/kube_api.py);
offline renders (`helm template`, Argo CD) with no secret source still fail and say what to set
(test_chart_gitops.py, test_no_secret_source_fails_with_what_to_set).
"""
from __future__ import annotations

import base64
import json
import re

import yaml

from tests.unit.kube_api import KubeAPI
from tests.unit.test_chart import NAMESPACE, RELEASE

NO_VALUES: dict = {}
AUTH, REDIS = f"{RELEASE}-tandem-gateway-auth", f"{RELEASE}-tandem-redis"


def _docs(files: dict[str, str]) -> list[dict]:
    return [d for f, t in files.items() if f.endswith(".yaml") for d in yaml.safe_load_all(t) if isinstance(d, dict)]


def _secret_values(files: dict[str, str]) -> tuple[str, str]:
    s = {d["metadata"]["name"]: d for d in _docs(files) if d["kind"] == "Secret"}
    (key,) = json.loads(base64.b64decode(s[AUTH]["data"]["api-keys"]))
    return key, base64.b64decode(s[REDIS]["data"]["redis-password"]).decode()


def _checksums(files: dict[str, str]) -> dict[str, str]:
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]["checksum/secrets"]
            for d in _docs(files) if d["kind"] in ("Deployment", "StatefulSet")}


def test_install_with_no_values_generates_secrets_and_upgrades_keep_them():
    with KubeAPI() as api:
        installed = api.render(NO_VALUES, name=RELEASE, namespace=NAMESPACE, upgrade=False)
        key, password = _secret_values(installed)
        assert re.fullmatch(r"tdm-[A-Za-z0-9]{40}", key) and re.fullmatch(r"[A-Za-z0-9]{64}", password)
        gw = next(d for d in _docs(installed) if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{RELEASE}-tandem-gateway")
        env = {e["name"]: e for e in gw["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["TANDEM_GATEWAY_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == AUTH  # auth on
        notes = installed["tandem/templates/NOTES.txt"]
        assert f"get secret {AUTH}" in notes and "kept by every helm upgrade" in notes
        api.apply(installed)
        for _ in range(2):  # every upgrade: the same key and password, and no pod restarts for them
            upgraded = api.render(NO_VALUES, name=RELEASE, namespace=NAMESPACE, upgrade=True)
            assert _secret_values(upgraded) == (key, password)
            assert _checksums(upgraded) == _checksums(installed)
    with KubeAPI() as other:  # another install (another cluster): other secrets
        assert _secret_values(other.render(NO_VALUES, name=RELEASE, namespace=NAMESPACE, upgrade=False)) != (key, password)


def test_given_secrets_still_win_over_generated_ones():
    with KubeAPI() as api:
        files = api.render({"gateway": {"auth": {"apiKeys": ["mine"]}}, "redis": {"auth": {"password": "pw"}}},
                           name=RELEASE, namespace=NAMESPACE, upgrade=False)
        assert _secret_values(files) == ("mine", "pw")
        gitops = api.render({"gateway": {"auth": {"existingSecret": "team-keys"}},
                             "redis": {"auth": {"existingSecret": "team-redis"}}},
                            name=RELEASE, namespace=NAMESPACE, upgrade=False)
        assert not [d for d in _docs(gitops) if d["kind"] == "Secret" and d["metadata"]["name"] in (AUTH, REDIS)]
