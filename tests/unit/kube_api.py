"""A stand-in Kubernetes API server for the chart's `lookup` calls, with no cluster here.

It answers only what Helm's `lookup` of v1 Secrets asks (the core group's discovery, GET and LIST
of Secrets in a namespace) from `secrets`, a dict the test fills with the objects an earlier
render would have created; anything else is a 404. Rendering with `helm_python.Config.render`
pointed at it is how `helm install`/`helm upgrade` (and Flux's helm-controller) render: `lookup`
sees the cluster. Offline renders (`Chart.render`, `helm template`, Argo CD) see nothing.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import helm_python as helm
import yaml

from tests.unit.test_chart import CHART

_V1 = {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
    {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret", "verbs": ["get", "list"]}]}


def _not_found(what: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
            "message": f"{what} not found"}


class KubeAPI:
    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], dict] = {}  # (namespace, name) -> the Secret object
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a) -> None:
                pass

            def _send(self, code: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts == ["api", "v1"]:
                    return self._send(200, _V1)
                if parts[:3] == ["api", "v1", "namespaces"] and len(parts) in (5, 6) and parts[4] == "secrets":
                    ns = parts[3]
                    if len(parts) == 5:
                        items = [s for (n, _), s in api.secrets.items() if n == ns]
                        return self._send(200, {"kind": "SecretList", "apiVersion": "v1",
                                                "metadata": {"resourceVersion": "1"}, "items": items})
                    found = api.secrets.get((ns, parts[5]))
                    return self._send(200, found) if found else self._send(404, _not_found(parts[5]))
                return self._send(404, _not_found(self.path))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "KubeAPI":
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def render(self, values: dict, *, name: str, namespace: str, upgrade: bool) -> dict[str, str]:
        """What `helm install` (upgrade=False) or `helm upgrade` renders against this API."""
        cfg = helm.Config(kube_apiserver=f"http://127.0.0.1:{self._server.server_address[1]}", namespace=namespace)
        try:
            chart = helm.Chart.load(CHART)
            return cfg.render(chart, values, name=name, namespace=namespace,
                              is_install=not upgrade or None, is_upgrade=upgrade or None)
        finally:
            cfg.close()

    def apply(self, files: dict[str, str]) -> None:
        """Store the Secrets of a render, as the install would have created them."""
        for path, text in files.items():
            if not path.endswith(".yaml"):
                continue
            for doc in yaml.safe_load_all(text):
                if isinstance(doc, dict) and doc.get("kind") == "Secret":
                    self.secrets[(doc["metadata"]["namespace"], doc["metadata"]["name"])] = doc
