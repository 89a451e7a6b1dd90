"""bench/token_plane.py's pure parts: the per-stream check (exactly once, in order) and the join of
send and arrival times catch duplicates, gaps, reordering, wrong tokens and missing finishes, so
the benchmark fails when the token plane does; INFO deltas per token, the saturation rule, the
cluster placement, the live histogram and the report."""
from __future__ import annotations

import numpy as np
import pytest

from bench import token_plane as tp
from bench import token_plane_stats as st
from bench.token_plane_procs import top_frames
from bench.token_plane_report import report
from bench.token_plane_roles import PlaneConfig, length_of, parse_rid, rid, token_of


def _good(n: int, slot: int = 0, gen: int = 0):
    return np.arange(n), np.array([token_of(slot, gen, i) for i in range(n)]), np.array([0] * (n - 1) + [1])


def _check(index, token, finish, n=5, slot=0, gen=0):
    return st.check_stream(np.array(index), np.array(token), np.array(finish), n,
                           lambda i: token_of(slot, gen, i))


def test_a_good_stream_passes():
    assert _check(*_good(5)) is None


@pytest.mark.parametrize("index, want", [
    ([0, 1, 1, 2, 3, 4], "duplicate index 1"),
    ([0, 1, 3, 4], "gap: index 2 missing"),
    ([0, 2, 1, 3, 4], "out of order"),
    ([0, 1, 2, 3, 4, 5], "unexpected index 5"),
    ([], "nothing delivered"),
])
def test_bad_indices_are_named(index, want):
    tok = [token_of(0, 0, i) for i in index]
    fin = [0] * len(index)
    assert want in _check(index, tok, fin)


def test_wrong_token_and_finish_are_named():
    idx, tok, fin = _good(5)
    tok2 = tok.copy()
    tok2[3] += 1
    assert "wrong token at index 3" in _check(idx, tok2, fin)
    assert "no finish" in _check(idx, tok, np.zeros(5))
    early = fin.copy()
    early[1] = 1
    assert "finish before the end, at index 1" in _check(idx, tok, early)


def _pub(starts, n_steps):
    return {"step_times": np.arange(n_steps, dtype=float), "starts": np.array(starts, dtype=np.int64).reshape(-1, 3)}


def _gw(records):
    """records: [(slot, gen, index list, arrival offset)] -> a gateway's saved arrays."""
    idx, tok, fin, arr, counts, req = [], [], [], [], [], []
    for slot, gen, index, off in records:
        req.append((slot, gen))
        counts.append(len(index))
        idx += index
        tok += [token_of(slot, gen, i) for i in index]
        fin += [1 if k == len(index) - 1 else 0 for k in range(len(index))]
        arr += [float(i) + off for i in range(len(index))]
    return {"req": np.array(req, dtype=np.int64).reshape(-1, 2), "counts": np.array(counts, dtype=np.int64),
            "index": np.array(idx), "token": np.array(tok), "finish": np.array(fin), "arrival": np.array(arr)}


def test_join_times_every_token_and_catches_bad_streams():
    n = 4
    length = lambda s, g: n  # noqa: E731
    pubs = [_pub([(0, 0, 0), (1, 0, 0), (0, 1, 4)], 8)]
    good = _gw([(0, 0, [0, 1, 2, 3], 0.5), (1, 0, [0, 1, 2, 3], 0.25)])
    good1 = _gw([(0, 1, [0, 1, 2, 3], 4.5)])
    j = st.join(pubs, [good, good1], length, token_of)
    assert (j["streams"], j["streams_ok"], j["errors"], j["tokens"]) == (3, 3, 0, 12)
    lat = np.sort(j["arrival"] - j["send"])
    assert np.allclose(lat, [0.25] * 4 + [0.5] * 8)
    # a duplicate, a stream never delivered, a stream no publisher wrote: three errors
    bad = _gw([(0, 0, [0, 1, 1, 2, 3], 0.5), (7, 0, [0, 1, 2, 3], 0.0)])
    j = st.join(pubs, [bad, good1], length, token_of)
    assert j["errors"] == 3 and j["streams_ok"] == 1
    text = " | ".join(j["error_examples"])
    assert "duplicate index 1" in text and "slot 1 gen 0: nothing delivered" in text
    assert "slot 7 gen 0: delivered but never written" in text


def test_a_broken_run_makes_the_benchmark_exit_non_zero():
    good = {"parts": {"plane": {"result": {"series": [{"errors": 0}]}}, "streams": {"result": {"runs": [{"errors": 0}]}}}}
    assert tp.exit_code(good) == 0
    assert tp.exit_code({"parts": {"plane": {"result": {"series": [{"errors": 0}, {"errors": 1}]}}}}) == 1
    good["parts"]["streams"]["result"]["runs"].append({"errors": 2})
    assert tp.exit_code(good) == 1


def test_window_stats():
    send = np.array([0.0, 0.5, 1.0, 1.5, 2.0])
    arrival = send + np.array([0.001, 0.002, 0.003, 0.004, 0.005])
    w = st.window_stats(send, arrival, 0.4, 1.6)
    assert w["written"] == 3 and w["delivered"] == 3
    assert w["latency_ms"]["p50"] == pytest.approx(3.0)
    assert w["written_per_s"] == pytest.approx(3 / 1.2)


def _info(calls: dict, cpu: float, bin_: int, bout: int) -> dict:
    out = {f"cmdstat_{c}": {"calls": n, "usec": 10 * n} for c, n in calls.items()}
    out.update({"used_cpu_sys": cpu / 2, "used_cpu_user": cpu / 2, "total_net_input_bytes": bin_,
                "total_net_output_bytes": bout})
    return out


def test_redis_cost_per_token_leaves_out_the_benchmarks_own_commands():
    a = _info({"evalsha": 10, "xadd": 100, "info": 5}, 1.0, 1000, 500)
    b = _info({"evalsha": 12, "xadd": 200, "xread": 10, "info": 7, "client|list": 3}, 1.5, 21000, 2500)
    c = st.redis_cost(a, b, seconds=2.0, tokens=100)
    assert c["calls"] == 2 + 100 + 10
    assert c["calls_per_token_by_command"] == {"evalsha": 0.02, "xadd": 1.0, "xread": 0.1}
    assert set(c["own_commands"]) == {"info", "client|list"}
    assert c["cpu_us_per_token"] == pytest.approx(5000.0) and c["cpu_util"] == pytest.approx(0.25)
    assert c["bytes_in_per_token"] == 200 and c["bytes_out_per_token"] == 20


def test_saturation_rule():
    row = lambda d, w=None, t=None, p99=5.0: {"delivered_per_s": d, "written_per_s": w or d,  # noqa: E731
                                              "target_per_s": t or w or d, "p99_ms": p99}
    assert st.saturated([row(100), row(200)], 50) == ""
    assert "p99" in st.saturated([row(100), row(200, p99=80)], 50)
    assert "written" in st.saturated([row(100), row(150, w=200)], 50)
    assert "asked" in st.saturated([row(100), row(150, t=300)], 50)
    assert "did not rise" in st.saturated([row(100), row(200), row(202)], 50)


def test_lag_histogram_quantiles():
    counts = np.zeros(len(st.LAG_EDGES_MS), dtype=np.int64)
    for lag in [0.2] * 90 + [10] * 9 + [300]:
        counts[st.lag_bucket(lag)] += 1
    assert st.hist_quantile(counts, 0.5) == 0.5
    assert st.hist_quantile(counts, 0.99) == 12
    assert st.hist_quantile(counts, 1.0) == 384
    assert np.isnan(st.hist_quantile(np.zeros(3), 0.5))


def test_placement_over_slot_ranges():
    owner = st.slot_owner([(0, 99, "a"), (100, 199, "b")])
    assert owner(0) == "a" and owner(150) == "b"
    with pytest.raises(KeyError):
        owner(200)
    doc = st.placement({"k1": 3, "k2": 1, "k3": 4}, {"k1": 5, "k2": 5, "k3": 150}.get, owner)
    assert doc["nodes"]["a"] == {"keys": 2, "ops": 4, "slots_used": 1, "ops_share": 0.5}
    assert doc["distinct_slots"] == 2 and doc["max_ops_share"] == 0.5


def test_per_key_fit_recovers_costs():
    runs = [{"xread_keys": k, "tokens": t, "cost": 2.0 * k + 7.0 * t} for k, t in ((100, 10), (1000, 20), (50, 500))]
    fit = st.per_key_fit(runs, "cost")
    assert fit["per_key"] == pytest.approx(2.0) and fit["per_token"] == pytest.approx(7.0)
    assert st.per_key_fit(runs[:1], "cost") is None


def test_request_ids_round_trip_and_lengths():
    r = rid(0xDEADBEEF, 12345, 67)
    assert r.startswith("cmpl-") and len(r) == 5 + 32
    assert parse_rid(r) == (0xDEADBEEF, 12345, 67)
    cfg = PlaneConfig(redis_url="", out_dir="", run_id=1, tokens=0)
    assert {length_of(cfg, s, 0) for s in range(200)} == set(range(8, 17))
    assert length_of(PlaneConfig(redis_url="", out_dir="", run_id=1, tokens=32), 5, 5) == 32


def test_pins_and_streams_specs():
    assert tp._pins("redis=0,publishers=1,gateways=0-1") == {"redis": [0], "publishers": [1], "gateways": [0, 1]}
    with pytest.raises(SystemExit):
        tp._pins("decode=0")
    assert tp.parse_streams("1000") == (1000, 0) and tp.parse_streams("1000+9000") == (1000, 9000)


def test_top_frames_from_raw_stacks():
    lines = ["<module> (x.py:1);run (a.py:3);xread (core.py:9) 6", "<module> (x.py:1);run (a.py:3);get (t.py:2) 4"]
    top = top_frames(lines)
    assert top["samples"] == 10
    assert top["self"][0] == ("xread (core.py)", 0.6)
    assert ("run (a.py)", 1.0) not in top["total"]  # what everything runs under is left out


def test_report_renders_every_part():
    row = {"steps_per_s": 10.0, "target_per_s": 640.0, "written_per_s": 640.0, "delivered_per_s": 639.0,
           "latency_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0}, "gateway_cpu_us_per_token": 50.0,
           "publisher_cpu_us_per_token": 20.0, "gateway_cpu_util": 0.1, "publisher_cpu_util": 0.05,
           "load_avg_1m": 1.0, "seconds": 2.0, "cpu_s": {"redis": 0.1, "gateway": 0.4, "publisher": 0.2},
           "redis": {"calls_per_token": 3.1, "bytes_in_per_token": 300.0, "bytes_out_per_token": 90.0,
                                         "cpu_us_per_token": 20.0, "cpu_util": 0.02,
                                         "calls_per_token_by_command": {"xadd": 1.0}, "usec_per_token_by_command": {"xadd": 2.0}}}
    machine = {"nproc": 2, "cpu": "x", "mem_gib": 1.0, "python": "3", "date": "d", "load_avg_1m": 0.5}
    plane = {"plan": {"publishers": 1, "gateways": 1}, "rows": [row], "saturated": "", "streams": 10, "streams_ok": 10,
             "errors": 0, "error_examples": [], "tokens": 100, "fenced": 0,
             "config": {"batch": 64, "tokens": 64, "cancel_poll_s": 0.05, "shards": 1, "gateways": 1},
             "cores": {"affinity": {"redis": [0, 1]}, "last_cpu_samples": {"redis": {"0": 3, "1": 1}}}}
    md = report({"parts": {"plane": {"command": "c", "machine": machine, "result": {"series": [plane, plane]}}}})
    assert md.count("### The token plane alone") == 2
    assert "kept 0.35 of the 2 cores busy" in md
    assert "| steps/s" in md and "Redis cmds/tok" in md and "10 of 10 exactly once" in md and "cpu0 75%" in md
