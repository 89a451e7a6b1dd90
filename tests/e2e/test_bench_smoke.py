"""Smoke run of bench/serve.py's load generator against `tandem local` for a few seconds: the
client, the workloads, the summaries and the JSON come out whole. No timing is asserted."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.e2e


def test_serve_bench_against_tandem_local(cluster, tmp_path):
    cmd = [sys.executable, "bench/serve.py", "--url", cluster.base_url, "--model", cluster.model,
           "--rates", "4", "--duration-s", "2", "--saturate-n", "6", "--slots", "4", "--no-write",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "serve.json").read_text())
    ep = doc["systems"]["endpoint"]
    assert ep["status"] == "ok", ep
    assert ep["saturate"]["requests"] == 6 and ep["saturate"]["errors"] == 0
    assert ep["saturate"]["tokens_out"] > 6
    steady = ep["steady"]["4.0"]
    assert steady["requests"] >= 4 and steady["errors"] == 0
    burst = ep["burst"]
    assert burst["short"]["requests"] > 0 and burst["all"]["errors"] == 0
    raw = json.loads((tmp_path / "serve" / "endpoint.json").read_text())
    for r in raw["saturate"]["results"]:  # every token was streamed and timed
        assert r["tokens_out"] == r["output_len"] and len(r["itl_s"]) == r["tokens_out"] - 1
    assert "endpoint" in proc.stdout
