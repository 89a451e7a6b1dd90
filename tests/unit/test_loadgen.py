"""bench/loadgen.py's statistics on synthetic timings: percentiles, SLO attainment, goodput search,
delayed steps, and the workload generator's shape. No server, no clock."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.loadgen import (
    RequestResult, delayed_step_fraction, gaps_under_burst, goodput, make_workload, percentile,
    poisson_arrivals, slo_attainment, summarize,
)


def _req(ttft: float, gaps: list[float], kind: str = "short", sent: float = 0.0, error: str | None = None):
    r = RequestResult(kind, 8, len(gaps) + 1, sent, error=error)
    if error:
        return r
    r.ttft_s, r.itl_s, r.tokens_out = ttft, list(gaps), len(gaps) + 1
    t = sent + ttft
    r.token_s = [t]
    for g in gaps:
        t += g
        r.token_s.append(t)
    r.e2e_s = ttft + sum(gaps)
    return r


@pytest.mark.parametrize("q", [0, 1, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    v = list(np.random.default_rng(3).exponential(1.0, 101))
    assert percentile(v, q) == pytest.approx(float(np.percentile(v, q)))


def test_percentile_by_hand_and_edge_cases():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile([4, 1, 3, 2], 100) == 4
    assert math.isnan(percentile([], 50))
    assert percentile([1.0, math.nan, 3.0], 50) == 2.0  # NaN (failed requests) is ignored


def test_tpot_and_slo_attainment_count_failures_as_misses():
    fast = _req(0.1, [0.01] * 9)  # tpot 10 ms
    slow_tokens = _req(0.1, [0.2] * 4)  # tpot 200 ms
    slow_first = _req(2.0, [0.01] * 4)
    failed = _req(0, [], error="HTTP 500")
    assert fast.tpot_s == pytest.approx(0.01)
    assert slo_attainment([fast, slow_tokens, slow_first, failed], 1.0, 0.05) == 0.25
    assert slo_attainment([fast], 0.1, 0.01) == 1.0  # SLOs are inclusive
    assert math.isnan(slo_attainment([], 1, 1))


def test_summarize_pools_gaps_and_counts_throughput():
    rs = [_req(0.1, [0.01, 0.03]), _req(0.3, [0.02]), _req(0, [], error="boom")]
    s = summarize(rs, wall_s=2.0, ttft_slo_s=0.2, tpot_slo_s=1.0)
    assert (s["requests"], s["errors"], s["tokens_out"]) == (3, 1, 5)
    assert s["itl_s"]["p50"] == pytest.approx(0.02)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["output_tokens_per_s"] == 2.5 and s["requests_per_s"] == 1.0
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert summarize(rs, 2.0, 1, 1, kinds=("long",))["requests"] == 0


def test_goodput_is_last_passing_rate_interpolated_to_the_crossing():
    pts = [(1, 1.0), (2, 0.98), (4, 0.94), (8, 0.70), (16, 0.1)]
    # between 4 (0.94) and 8 (0.70): 0.9 is crossed a sixth of the way
    assert goodput(pts) == pytest.approx(4 + 4 * (0.04 / 0.24))
    assert goodput(list(reversed(pts))) == goodput(pts)  # order of the sweep does not matter


def test_goodput_edges():
    assert goodput([(1, 0.95), (2, 0.92)]) == 2  # never missed: the highest rate tried
    assert goodput([(1, 0.5), (2, 0.99)]) == 0.0  # the lowest rate misses: no goodput
    assert goodput([(1, 0.95), (2, 0.5), (4, 0.95)]) == pytest.approx(1 + 0.05 / 0.45)  # first miss ends it
    assert goodput([]) == 0.0
    assert goodput([(3, 0.9)]) == 3  # exactly the target passes
    assert goodput([(1, 1.0), (2, math.nan)]) == 1


def test_delayed_step_fraction_uses_the_median_gap():
    rs = [_req(0.1, [0.01] * 18 + [0.05, 0.02])]  # median 10 ms: 50 ms is > 3x, 20 ms is not
    assert delayed_step_fraction(rs, 3.0) == pytest.approx(1 / 20)
    assert delayed_step_fraction(rs + [_req(0.1, [1.0] * 5, kind="long")], 3.0) == pytest.approx(1 / 20)
    assert math.isnan(delayed_step_fraction([], 3.0))


def test_gaps_under_burst_keep_gaps_ending_while_a_long_prompt_is_in_flight():
    short = _req(0.1, [0.1] * 10)  # tokens at 0.1, 0.2, ..., 1.1
    long_ = _req(0.25, [0.05], kind="long", sent=0.45)  # in flight 0.45 .. 0.75
    got = gaps_under_burst([short, long_])
    assert len(got) == 3  # the gaps ending at 0.5, 0.6 and 0.7


def test_poisson_arrivals_have_the_asked_rate():
    a = poisson_arrivals(np.random.default_rng(0), rate=20.0, n=20000)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert len(a) / a[-1] == pytest.approx(20.0, rel=0.05)
    assert poisson_arrivals(np.random.default_rng(0), 0, 3) == [0.0, 0.0, 0.0]


def test_workload_is_seeded_and_has_bursts_of_long_prompts():
    w1 = make_workload(7, 40, 4.0, "chat", vocab=100, bursts=(3, 2.0, 200, 8))
    w2 = make_workload(7, 40, 4.0, "chat", vocab=100, bursts=(3, 2.0, 200, 8))
    assert [(s.arrival_s, s.prompt) for s in w1] == [(s.arrival_s, s.prompt) for s in w2]
    longs = [s for s in w1 if s.kind == "long"]
    assert longs and len(longs) % 3 == 0 and all(s.prompt_len == 200 and s.output_len == 8 for s in longs)
    assert all(len(s.prompt) == s.prompt_len and all(3 <= t < 100 for t in s.prompt) for s in w1)
    assert [s.arrival_s for s in w1] == sorted(s.arrival_s for s in w1)
    fixed = make_workload(1, 5, 0.0, (16, 4), vocab=50)
    assert {(s.prompt_len, s.output_len, s.arrival_s) for s in fixed} == {(16, 4, 0.0)}
