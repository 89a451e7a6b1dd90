"""bench/plan_model.py, plan_policies.py and plan_trace.py (the cluster simulator) on a hand-written
profile: requests are conserved (also through scale-down), an idle cluster's TTFT is prefill +
hand-off + one step, a full decode pod makes slots / itl(slots) tokens a second, the HPA's formula
and stabilization, and the trace generator's seed and bounds. No sockets, no clock."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.plan_model import SimConfig, simulate
from bench.plan_policies import HPAPolicy, HPAStabilizer, PlannerPolicy, StaticPolicy, hpa_desired, scaled, size_for
from bench.plan_trace import Trace, TraceSpec, poisson_slice, rate_curve, read_jsonl, synthetic, write_jsonl
from planner.decide import DecodeBatch, PlanConfig
from planner.kv import KVCapacity
from planner.profile import parse_profile
from planner.settings import RoleBounds, SLOConfig

PROFILE = parse_profile({
    "format": "tandem-capacity-profile/v1", "model": "hand",
    "prefill": {"points": [{"tokens": 64, "seconds": 0.01}, {"tokens": 512, "seconds": 0.05},
                           {"tokens": 2048, "seconds": 0.2}]},
    "decode": {"slots": 8, "points": [{"batch": 1, "itl_s": 0.01}, {"batch": 4, "itl_s": 0.012},
                                      {"batch": 8, "itl_s": 0.02}]},
    "handoff_s": 0.005})
BOUNDS = {r: RoleBounds(min_replicas=1, max_replicas=16) for r in ("prefill", "decode")}


def trace(ts, prompt=64, output=16) -> Trace:
    n = len(ts)
    return Trace(np.asarray(ts, float), np.full(n, prompt, np.int64), np.full(n, output, np.int64))


class Scripted:
    """Replicas from a list, one entry a tick: scale-up and scale-down at will."""

    name = "scripted"

    def __init__(self, plan, period_s=5.0):
        self.plan, self.period_s, self.k = plan, period_s, 0

    def initial(self):
        return {"prefill": 2, "decode": 2}

    def decide(self, t, snap):
        self.k += 1
        return self.plan[self.k % len(self.plan)]


def _small_day(seed=1, duration=600.0):
    return synthetic(TraceSpec(duration_s=duration, low_rpm=600, peak_rpm=2400, bursts_per_hour=12,
                               prompt_median=200, output_median=40, output_bounds=(1, 200), seed=seed))


@pytest.mark.parametrize("cfg", [SimConfig(startup_s=7.0), SimConfig(startup_s=3.0, first_token="decode"),
                                 SimConfig(startup_s=0.0, prefill_hold=2)])
def test_every_arrival_finishes_once_through_scale_down(cfg):
    tr = _small_day()
    plan = [{"prefill": 1, "decode": 1}, {"prefill": 4, "decode": 6}, {"prefill": 3, "decode": 2},
            {"prefill": 1, "decode": 5}, {"prefill": 5, "decode": 1}]
    res = simulate(tr, PROFILE, Scripted(plan), cfg)
    assert res.unfinished == 0
    assert not np.isnan(res.finish).any()  # each finished (finishing twice raises in the model)
    assert (res.finish >= res.arrival).all() and (res.ttft > 0).all()
    downs = [e for e in res.scale_events if e[3] < e[2]]
    assert len(downs) > 10
    for role, asked, ready, gone in res.pods:
        assert gone >= asked and (math.isnan(ready) or asked <= ready <= gone)
    gone = [p for p in res.pods if p[3] < res.end_s - 1e-9]
    assert len(gone) > 5  # pods really left (drained), and the work still all finished


def test_idle_cluster_ttft_is_prefill_handoff_and_one_step():
    tr = trace([1.0, 10.0, 20.0], prompt=300, output=20)
    res = simulate(tr, PROFILE, StaticPolicy({"prefill": 1, "decode": 1}), SimConfig(first_token="decode"))
    want = PROFILE.prefill_seconds(300) + PROFILE.handoff_s + PROFILE.decode_itl(1)
    assert res.ttft == pytest.approx([want] * 3, rel=1e-9)
    assert res.itl == pytest.approx([PROFILE.decode_itl(1)] * 3, rel=1e-6)
    # Tandem's own path: token 0 comes from the prefill pod, the hand-off lands in the first gap.
    res = simulate(tr, PROFILE, StaticPolicy({"prefill": 1, "decode": 1}), SimConfig(first_token="prefill"))
    assert res.ttft == pytest.approx([PROFILE.prefill_seconds(300)] * 3, rel=1e-9)
    gap = (PROFILE.handoff_s + 19 * PROFILE.decode_itl(1)) / 19
    assert res.itl == pytest.approx([gap] * 3, rel=1e-6)


def test_full_decode_pod_makes_slots_over_itl_tokens_per_second():
    slots, out, waves = PROFILE.slots, 2000, 3
    tr = trace([0.0] * (slots * waves), prompt=8, output=out)
    res = simulate(tr, PROFILE, StaticPolicy({"prefill": 4, "decode": 1}), SimConfig(first_token="decode"))
    start = np.nanmin(res.ttft + res.arrival) - PROFILE.decode_itl(slots)
    rate = slots * waves * out / (np.nanmax(res.finish) - start)
    assert rate == pytest.approx(slots / PROFILE.decode_itl(slots), rel=0.01)
    assert np.nanmedian(res.itl) == pytest.approx(PROFILE.decode_itl(slots), rel=0.01)


def test_pod_hours_count_from_ask_to_exit():
    tr = trace(np.linspace(0, 100, 50))
    res = simulate(tr, PROFILE, StaticPolicy({"prefill": 2, "decode": 3}), SimConfig())
    assert res.pod_hours("prefill") == pytest.approx(2 * res.end_s / 3600)
    assert res.pod_hours("decode") == pytest.approx(3 * res.end_s / 3600)
    assert res.scale_events == []


def test_hpa_formula_and_tolerance():
    assert hpa_desired(4, 10.0, 5.0) == 8
    assert hpa_desired(4, 5.4, 5.0) == 4  # within 10%
    assert hpa_desired(4, 5.6, 5.0) == 5  # ceil(4.48)
    assert hpa_desired(4, 1.0, 5.0) == 1
    assert hpa_desired(3, 0.0, 5.0) == 0
    assert hpa_desired(0, 2.0, 5.0) == 1


def test_hpa_scale_down_stabilization_and_up_rate():
    s = HPAStabilizer(down_window_s=300.0)
    assert s.recommend(0.0, 10, 2) == 6  # up now, at most max(2x, +4) per sync
    assert s.recommend(15.0, 10, 6) == 10
    for t in range(30, 300, 15):  # the load dropped: the highest of the last 300 s holds
        assert s.recommend(float(t), 2, 10) == 10
    assert s.recommend(300.0, 2, 10) == 10  # t=15's 10 is still inside the window
    assert s.recommend(315.0, 2, 10) == 2  # every recommendation of the window is 2 now


def test_hpa_policy_scales_with_queue():
    tr = _small_day(seed=3)
    pol = HPAPolicy({"prefill": 1.0, "decode": 6.0}, BOUNDS, {"prefill": 1, "decode": 1})
    res = simulate(tr, PROFILE, pol, SimConfig(startup_s=10.0))
    assert res.unfinished == 0
    ups = [e for e in res.scale_events if e[3] > e[2]]
    assert ups and max(e[3] for e in res.scale_events) <= 16


def test_planner_policy_runs_and_conserves():
    tr = _small_day(seed=4)
    slo = SLOConfig(ttft_s=0.5, itl_s=0.02)
    start = size_for(len(tr) / tr.duration_s, float(tr.prompt.mean()), float(tr.output.mean()), PROFILE, slo)
    pol = PlannerPolicy(PROFILE, PlanConfig(slo, BOUNDS, scale_down_cooldown_s=120.0), start, interval_s=15.0)
    res = simulate(tr, PROFILE, pol, SimConfig(startup_s=10.0))
    assert res.unfinished == 0 and len(pol.log) > 10
    assert all(1 <= d.prefill <= 16 and 1 <= d.decode <= 16 for _, d in pol.log)


def test_planner_corrections_see_a_cluster_slower_than_its_profile():
    """The observation carries what the pods did (busy seconds a prompt, tokens decoded, the mean
    gap): the planner's correction factors find the cluster's 2x prefill and 1.5x decode."""
    tr = _small_day(seed=4)
    slo = SLOConfig(ttft_s=0.5, itl_s=0.05)
    start = size_for(len(tr) / tr.duration_s, float(tr.prompt.mean()), float(tr.output.mean()), PROFILE, slo)
    pol = PlannerPolicy(PROFILE, PlanConfig(slo, BOUNDS), start, interval_s=15.0)
    simulate(tr, scaled(PROFILE, prefill_mult=2.0, decode_mult=1.5), pol, SimConfig(startup_s=10.0))
    corr = np.asarray([d.corrections for _, d in pol.log[5:]])
    assert np.median(corr[:, 0]) == pytest.approx(2.0, rel=0.05)
    assert np.median(corr[:, 1]) == pytest.approx(1.5, rel=0.1)


def test_speculative_decoding_tokens_per_step_speed_a_pod_up_and_the_planner_sees_it():
    """tokens_per_step 2 (speculative decoding's mean accepted length): a full pod makes twice the
    tokens a second at the same step time, and the planner's decode correction, read from the
    per-token gap the gateways measure, finds the pods twice as fast as the profile's steps."""
    slots, out = PROFILE.slots, 2000
    tr = trace([0.0] * slots, prompt=8, output=out)
    res = simulate(tr, PROFILE, StaticPolicy({"prefill": 4, "decode": 1}),
                   SimConfig(first_token="decode", tokens_per_step=2.0))
    assert np.nanmedian(res.itl) == pytest.approx(PROFILE.decode_itl(slots) / 2, rel=0.02)
    tr = _small_day(seed=4)
    slo = SLOConfig(ttft_s=0.5, itl_s=0.05)
    start = size_for(len(tr) / tr.duration_s, float(tr.prompt.mean()), float(tr.output.mean()), PROFILE, slo)
    pol = PlannerPolicy(PROFILE, PlanConfig(slo, BOUNDS), start, interval_s=15.0)
    simulate(tr, PROFILE, pol, SimConfig(startup_s=10.0, tokens_per_step=2.0))
    corr = np.asarray([d.corrections for _, d in pol.log[5:]])
    assert np.median(corr[:, 1]) == pytest.approx(0.5, rel=0.15)
    with pytest.raises(ValueError, match="tokens_per_step"):
        SimConfig(tokens_per_step=0.5)


def test_trace_generator_is_seeded_and_bounded():
    spec = TraceSpec(duration_s=1800.0, low_rpm=300, peak_rpm=3000, prompt_bounds=(8, 512),
                     output_bounds=(4, 64), seed=7)
    a, b = synthetic(spec), synthetic(spec)
    assert np.array_equal(a.t, b.t) and np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
    c = synthetic(TraceSpec(**{**spec.__dict__, "seed": 8}))
    assert len(c) != len(a) or not np.array_equal(c.t, a.t)
    assert (np.diff(a.t) >= 0).all() and a.t[0] >= 0 and a.t[-1] <= spec.duration_s
    assert a.prompt.min() >= 8 and a.prompt.max() <= 512 and a.output.min() >= 4 and a.output.max() <= 64
    _, per_min = a.rate_per_bin(60.0, spec.duration_s)
    assert per_min.max() <= spec.max_rate * 1.3
    grid, rate = rate_curve(spec, np.random.default_rng(7))
    assert rate.min() >= spec.low_rpm / 60 * 0.8 - 1e-9 and rate.max() <= spec.max_rate
    expected = np.trapezoid(rate, grid) if hasattr(np, "trapezoid") else np.trapz(rate, grid)
    assert len(a) == pytest.approx(expected, rel=0.1)


def test_recorded_trace_round_trip(tmp_path):
    sl = poisson_slice(4.0, 30.0, [(32, 8), (128, 16)], seed=2)
    assert set(map(int, sl.prompt)) <= {32, 128} and sl.t[-1] < 30.0
    f = tmp_path / "trace.jsonl"
    write_jsonl(sl, f)
    f.write_text("# recorded\n" + f.read_text() + "\n")
    back = read_jsonl(f)
    assert np.allclose(back.t, sl.t - sl.t[0], atol=1e-5) and np.array_equal(back.output, sl.output)
    f.write_text('{"t": 0, "prompt_tokens": 3}\n')
    with pytest.raises(ValueError, match="output"):
        read_jsonl(f)


# A small paged pool: 256 blocks of 16 positions (4096), a block of reserve a row, 8 rows.
SMALL_PAGED = KVCapacity("paged", rows=8, block_size=16, blocks_total=256, reserve_blocks=1)


def _kv_run(kv, kv_signal=True):
    """4 req/s of 1500-token prompts and 200-token outputs for 10 minutes, the planner every 15 s."""
    tr = poisson_slice(4.0, 600.0, [(1500, 200)], seed=1)
    slo = SLOConfig(ttft_s=0.5, itl_s=0.05)
    start = size_for(len(tr) / tr.duration_s, 1500.0, 200.0, PROFILE, slo)  # by the ITL rule: 3 decode pods
    pol = PlannerPolicy(PROFILE, PlanConfig(slo, BOUNDS, scale_down_cooldown_s=120.0), start, interval_s=15.0,
                        kv_signal=kv_signal)
    return simulate(tr, PROFILE, pol, SimConfig(startup_s=10.0, kv=kv)), pol


def test_long_prompts_on_a_small_paged_pool_get_the_decode_pods_their_kv_needs():
    """A running request holds 1500 + 200 / 2 = 1600 positions, 101 blocks with its reserve: the
    pool runs 2 of them, where the ITL target allows the profile's 8. The planner that reads the
    pods' KV sizes decode at 2 a pod from its first decision; the ITL rule alone (the planner before
    it read KV) sizes at 8 a pod, and only the ready queue that then builds pushes it up, late:
    requests wait for a decode pod and their gaps grow."""
    slo = SLOConfig(ttft_s=0.5, itl_s=0.05)
    assert size_for(4.0, 1500.0, 200.0, PROFILE, slo, kv=SMALL_PAGED)["decode"] > size_for(4.0, 1500.0, 200.0, PROFILE, slo)["decode"]
    kv_res, kv_pol = _kv_run(SMALL_PAGED)
    itl_res, itl_pol = _kv_run(SMALL_PAGED, kv_signal=False)
    assert kv_res.unfinished == 0 and itl_res.unfinished == 0
    kv_d = [d for _, d in kv_pol.log if not d.held]
    itl_d = [d for _, d in itl_pol.log if not d.held]
    assert all(d.decode_batch.size == 2 and d.decode_batch.itl == 8 for d in kv_d)
    assert all(d.decode_batch.kv is None and d.decode_batch.size == d.decode_batch.itl for d in itl_d)
    assert "decode: KV holds 2 sequences of ~1600 positions per pod, below the 8 the ITL target allows" in kv_d[0].notes
    assert kv_d[0].wanted_decode > itl_d[0].wanted_decode  # the same first interval, sized apart
    assert np.median([d.decode for d in kv_d]) > np.median([d.decode for d in itl_d])
    # the ITL rule's pods ran out of KV: prefilled requests waited for a decode pod, gaps grew
    assert itl_res.series["ready_queue"].mean() > 1.0 > kv_res.series["ready_queue"].mean()
    assert np.nanpercentile(itl_res.itl, 90) > 2 * np.nanpercentile(kv_res.itl, 90)


def test_without_a_kv_model_the_simulator_and_the_planner_are_as_before():
    """kv=None: no capacity in the snapshot, so the planner sizes by the ITL target alone; and the
    cluster is the same as one whose pods' rows are the profile's slots (which bounds nothing)."""
    res, pol = _kv_run(None)
    rows, rows_pol = _kv_run(KVCapacity("slots", rows=PROFILE.slots))
    assert res.unfinished == 0
    assert all(d.decode_batch == DecodeBatch(itl=8) for _, d in pol.log if not d.held)
    assert [(d.prefill, d.decode, d.wanted_decode) for _, d in pol.log] == \
        [(d.prefill, d.decode, d.wanted_decode) for _, d in rows_pol.log]
    assert np.array_equal(res.finish, rows.finish) and res.scale_events == rows.scale_events
