"""Smoke runs of the benchmarks that need Redis or the cluster, each for a few seconds. The one e2e
or integration file that imports or runs bench/ code, because the benchmark itself is what is
tested here (tests/unit/test_bench_*.py test bench code that needs no services; every other e2e and
integration test uses none). No timing is asserted.

- bench/serve.py's load generator against `tandem local`: the client, the workloads, the
  summaries and the JSON come out whole.
- bench/kv_capacity.py's slots side in a tiny run on `tandem local`: the decode pod's heartbeat
  carries the KV bytes it pulled (each turn of a conversation pulls at least its whole prompt's KV
  today) and the prefill pod's prefix cache the bytes its hits copied (one copy of each hit token's KV).
- bench/token_plane.py in a tiny run on a real Redis (its own redis-server) and real processes:
  the decode pods' fenced writes reach the TokenMux relays exactly once and in order, the report's
  fields are there, a fault injected into the publishers (a duplicate, a gap) makes the benchmark
  fail, and a gateway holding many streams keeps to its connection bound.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import token_plane as tp
from bench.token_plane_report import report
from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.e2e


def test_serve_bench_against_tandem_local(local_cluster, tmp_path):
    cmd = [sys.executable, "bench/serve.py", "--url", local_cluster.base_url, "--model", local_cluster.model,
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


def test_kv_capacity_bench_counts_the_kv_bytes_moved(tmp_path):
    cmd = [sys.executable, "bench/kv_capacity.py", "--configs", "slots", "--slots", "2", "--max-len", "256",
           "--requests", "16", "--clients", "4", "--turns", "2", "--turn-output", "8", "--prefix-requests", "2",
           "--system-len", "64", "--no-write", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "kv_capacity.json").read_text())
    per_token = doc["kv_bytes_per_token"]
    r = doc["results"]["slots"]
    assert r["capacity"]["errors"] == 0 and r["capacity"]["requests"] == 16
    samples = r["capacity"]["samples"]  # (too short a run for its heartbeats to say much)
    assert samples and all(0 <= run <= taken <= 2 for _t, run, taken in samples)
    assert 1 <= r["capacity"]["decoding_client_view"]["max"] <= 2
    turns = r["multi_turn"]["turns"]
    assert len(turns) == 2 and r["multi_turn"]["errors"] == 0
    for t in turns:  # at least the KV of the turn's new tokens (the pool keeps the rest: kv_reuse)
        assert t["pulled_bytes"] >= t["new_tokens"] * per_token > 0, t
    px = r["prefix"]
    assert px["errors"] == 0 and px["hit_tokens"] == 64  # the second request hits the 4 system blocks
    assert px["hit_copy_bytes"] == 0  # the prefill pod's cache is on the device: a hit reads its blocks in place
    assert "paged" not in doc["results"]


TINY = dict(publishers=1, gateways=1, batch=8, tokens=8, rates=[20.0, 40.0], warmup_s=0.3, measure_s=0.7)
MACHINE = {"nproc": 2, "cpu": "x", "mem_gib": 1.0, "python": "3", "date": "d", "load_avg_1m": 0.5}


def test_tiny_plane_run_delivers_every_stream_once_in_order():
    res = tp.run_plane(tp.PlanePlan(**TINY), progress=lambda _m: None)
    assert res["errors"] == 0, res["error_examples"]
    assert res["streams"] > 8 and res["streams_ok"] == res["streams"]
    assert res["tokens"] == 8 * res["streams"] and res["fenced"] == 0
    assert len(res["rows"]) == 2
    for row in res["rows"]:
        assert row["written"] > 0 and row["delivered"] > 0
        for q in ("p50", "p99"):
            assert row["latency_ms"][q] >= 0
        rc = row["redis"]
        # the fenced script's inner commands: one HEXISTS, XADD and EXPIRE per token at least
        for cmd in ("evalsha", "hexists", "xadd", "expire", "xread"):
            assert rc["calls_per_token_by_command"].get(cmd, 0) > 0, (cmd, rc["calls_per_token_by_command"])
        assert rc["calls_per_token_by_command"]["hexists"] == pytest.approx(1.0, abs=0.2)
        assert rc["bytes_in_per_token"] > 0 and rc["bytes_out_per_token"] > 0 and rc["cpu_us_per_token"] > 0
        assert "info" not in rc["commands"]  # the benchmark's own snapshots are left out
        assert row["gateway_cpu_us_per_token"] > 0
    assert set(res["cores"]["affinity"]) == {"redis", "gateway0", "publisher0"}
    assert set(res["key_ops"]) == {"1", "3", "16"} and all(res["key_ops"].values())
    assert res["xread_wakeup"]["in_reply"] >= 1
    doc = {"parts": {"plane": {"command": "test", "machine": MACHINE, "result": res}}}
    md = report(doc)
    assert "Redis cmds/tok" in md and f"{res['streams']:,} of {res['streams']:,} exactly once" in md
    assert tp.exit_code(doc) == 0


@pytest.mark.parametrize("fault, word", [("duplicate", "duplicate index 2"), ("gap", "gap: index 2 missing")])
def test_the_benchmark_fails_when_a_stream_is_broken(fault, word):
    res = tp.run_plane(tp.PlanePlan(**{**TINY, "rates": [20.0]}, inject=fault), progress=lambda _m: None)
    assert res["errors"] == 1, res["error_examples"]
    assert any(word in e for e in res["error_examples"])
    assert tp.exit_code({"parts": {"plane": {"result": res}}}) == 1


def test_many_streams_on_one_gateway_within_its_connection_bound():
    plan = tp.StreamsPlan(streams=400, publishers=1, pods=4, steps_per_s=0, max_connections=8, timeout_s=60)
    res = tp.run_streams(plan, 400, idle=100, progress=lambda _m: None)
    assert res["errors"] == 0, res["error_examples"]
    assert res["streams"] == res["streams_ok"] == 400 and res["idle_streams"] == 100
    assert 1 <= max(res["peak_gateway_connections"].values()) <= 8
    assert res["keys_per_read"] > 100  # the idle subscriptions are named in every read too
    assert res["tokens"] > 400 * 8 and res["deliver_s"] > 0
