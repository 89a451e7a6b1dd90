"""The planner's decisions, apart from its calls: predictor, replica math, bounds and cooldowns,
holds, the Lease protocol and what would be sent to the Kubernetes API (planner/)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from decode_svc.blocks import BlockBudget
from planner.correct import LIMIT, Corrections
from planner.decide import (DecodeBatch, Infeasible, Observation, PlanConfig, Planner, decode_batch, decode_needed,
                             prefill_needed)
from planner.kube import LeaseKeeper, RecordingApi, lease_action, lease_body
from planner.kv import KVCapacity, pod_capacity, pool_capacity
from planner.predict import LoadPredictor
from planner.profile import parse_profile
from planner.settings import PlannerSettings, RoleBounds, SLOConfig
from tandem_core.load_report import Increments
from tests.unit.clock import Clock

PROFILE = parse_profile({
    "format": "tandem-capacity-profile/v1", "model": "test",
    "prefill": {"points": [{"tokens": 16, "seconds": 0.01}, {"tokens": 512, "seconds": 0.2}]},
    "decode": {"slots": 8, "points": [{"batch": 1, "itl_s": 0.005}, {"batch": 8, "itl_s": 0.012}]},
    "handoff_s": 0.01,
})


def planner(**kw) -> Planner:
    bounds = {"prefill": RoleBounds(max_replicas=kw.pop("max_p", 16)), "decode": RoleBounds(max_replicas=kw.pop("max_d", 16))}
    cfg = PlanConfig(slo=SLOConfig(ttft_s=kw.pop("ttft", 1.0), itl_s=kw.pop("itl", 0.05)), bounds=bounds,
                     scale_up_cooldown_s=kw.pop("up", 0.0), scale_down_cooldown_s=kw.pop("down", 0.0))
    return Planner(kw.pop("profile", PROFILE), cfg, predictor=LoadPredictor(margin_sigmas=kw.pop("sigmas", 0.0)))


def obs(t: float, rate: float, isl: float = 200, osl: float = 100, interval: float = 10.0, **kw) -> Observation:
    return Observation(t=t, interval_s=interval, arrivals=round(rate * interval), prompt_tokens_mean=isl,
                       output_tokens_mean=osl, **kw)


def test_replicas_follow_the_profile_and_the_queueing_bound():
    s = PROFILE.prefill_seconds(200)
    # rho = min(0.8, 1 - s / 1.0) = 0.8 here: 20 req/s * s / 0.8
    assert prefill_needed(20, 200, PROFILE, SLOConfig(ttft_s=1.0), 0.8) == math.ceil(20 * s / 0.8)
    # a tight TTFT target lowers the utilisation a pod may run at, so more pods
    tight = prefill_needed(40, 200, PROFILE, SLOConfig(ttft_s=0.2), 0.8)
    assert tight == math.ceil(40 * s / (1 - s / 0.2))
    assert tight > prefill_needed(40, 200, PROFILE, SLOConfig(ttft_s=1.0), 0.8)
    # decode: a loose ITL target lets a pod run all 8 slots: 0.8 * 8 / 0.012 tokens/s each
    assert decode_needed(20, 100, PROFILE, SLOConfig(itl_s=0.05), 0.8) == math.ceil(2000 / (0.8 * 8 / 0.012))
    # a target between batch 1 and 8 caps the batch: fewer tokens per pod, more pods
    assert PROFILE.decode_batch_for_itl(0.007) == 3
    assert decode_needed(20, 100, PROFILE, SLOConfig(itl_s=0.007), 0.8) > decode_needed(20, 100, PROFILE, SLOConfig(itl_s=0.05), 0.8)


def test_targets_no_replica_count_meets_are_infeasible_and_held():
    with pytest.raises(Infeasible, match="TTFT target"):
        prefill_needed(1, 512, PROFILE, SLOConfig(ttft_s=0.15), 0.8)
    with pytest.raises(Infeasible, match="ITL"):
        decode_needed(1, 100, PROFILE, SLOConfig(itl_s=0.004), 0.8)
    p = planner(ttft=0.15)
    d = p.step(obs(10, 5, isl=512), {"prefill": 2, "decode": 3})
    assert d.held.startswith("SLO infeasible") and (d.prefill, d.decode) == (2, 3)


def test_scale_up_is_immediate_and_down_waits_for_the_window():
    p = planner(down=60.0)
    cur = {"prefill": 1, "decode": 1}
    d = p.step(obs(10, 40), cur)
    assert d.prefill > 1 and d.decode > 1 and not d.held
    high = {"prefill": d.prefill, "decode": d.decode}
    t = 10
    for _ in range(5):  # the load drops; within the first window nothing scales down
        t += 10
        d = p.step(obs(t, 1), high)
        assert (d.prefill, d.decode) == (high["prefill"], high["decode"])
    for _ in range(12):  # once the high wants leave the 60 s window, it comes down to the floor
        t += 10
        d = p.step(obs(t, 1), {"prefill": d.prefill, "decode": d.decode})
    assert (d.prefill, d.decode) == (1, 1)


def test_scale_up_cooldown_and_max_bound_say_why():
    p = planner(up=100.0, max_p=2)
    d = p.step(obs(10, 40), {"prefill": 1, "decode": 1})
    assert d.prefill == 2 and any("capped at max_replicas 2" in n for n in d.notes)
    first = d.decode
    d = p.step(obs(20, 80), {"prefill": 2, "decode": first})
    assert d.decode == first and any("decode: up to" in n and "scale-up cooldown" in n for n in d.notes)
    d = p.step(obs(120, 80), {"prefill": 2, "decode": first})
    assert d.decode > first  # the cooldown is over


def test_never_scales_to_zero_unless_allowed():
    with pytest.raises(ValueError, match="allow_zero"):
        RoleBounds(min_replicas=0)
    p = planner()
    d = p.step(obs(10, 0.0, isl=None, osl=None), {"prefill": 1, "decode": 1})
    assert d.held  # no request seen: nothing to size from
    d = p.step(obs(20, 0.0, isl=100, osl=10), {"prefill": 1, "decode": 1})
    assert (d.prefill, d.decode) == (1, 1)


def test_backlog_adds_capacity_to_drain_it_within_an_interval():
    quiet = planner().step(obs(10, 1), {"prefill": 1, "decode": 1})
    queued = planner().step(obs(10, 1, prefill_backlog=400), {"prefill": 1, "decode": 1})
    assert queued.prefill > quiet.prefill and queued.decode == quiet.decode


def test_prompts_prefilled_on_decode_pods_do_not_size_prefill():
    all_remote = planner().step(obs(10, 40), {"prefill": 1, "decode": 1})
    mostly_direct = planner().step(obs(10, 40, prefill_arrivals=40, prefill_prompt_tokens_mean=200),
                                   {"prefill": 1, "decode": 1})
    assert mostly_direct.prefill < all_remote.prefill and mostly_direct.decode == all_remote.decode


def test_predictor_tracks_a_trend_and_its_margin_grows_with_noise():
    steady, noisy = LoadPredictor(margin_sigmas=2), LoadPredictor(margin_sigmas=2)
    for i in range(12):
        steady.observe(10 + i, 100, 50)
        noisy.observe(10 + i + (8 if i % 2 else -8), 100, 50)
    assert steady.forecast().rate == pytest.approx(22, abs=1.0)  # the trend carries it one step on
    assert noisy.forecast().margin > 4 * steady.forecast().margin
    with pytest.raises(ValueError, match="no forecast"):
        LoadPredictor().forecast()


def test_increments_survive_restarts_and_new_reporters():
    inc = Increments(("admitted",))
    assert inc.step([{"id": "a", "pid": 1, "admitted": 100, "ts": 10}]) == {"admitted": 0, "span_s": 0}  # baseline
    # a went on (its two reports 2 s apart); b is new: its count is from before this reader
    got = inc.step([{"id": "a", "pid": 1, "admitted": 130, "ts": 12}, {"id": "b", "pid": 2, "admitted": 7, "ts": 12}])
    assert got == {"admitted": 30, "span_s": 2}
    # a restarted: its count began again; b went on
    got = inc.step([{"id": "a", "pid": 9, "admitted": 4, "ts": 16}, {"id": "b", "pid": 2, "admitted": 10, "ts": 16}])
    assert got == {"admitted": 7, "span_s": 4}


def test_lease_protocol():
    now = 1_000_000.0
    assert lease_action(None, "me", now) == "create"
    mine = lease_body("l", "ns", "me", 15, now, None)
    assert mine["spec"]["holderIdentity"] == "me" and mine["spec"]["leaseTransitions"] == 0
    assert lease_action(mine, "me", now + 5) == "renew"
    assert lease_action(mine, "other", now + 5) == "wait"
    assert lease_action(mine, "other", now + 16) == "take"
    mine["metadata"]["resourceVersion"] = "7"
    taken = lease_body("l", "ns", "other", 15, now + 16, mine)
    assert taken["spec"]["leaseTransitions"] == 1 and taken["metadata"]["resourceVersion"] == "7"


async def test_one_planner_holds_the_lease_and_the_other_takes_over_when_it_stops():
    clock = Clock(1_000_000.0)
    a = RecordingApi(replicas={"p": 1, "d": 1})
    b = RecordingApi(store=a.store)
    ka = LeaseKeeper(a, "ns", "tandem-planner", "a", 15, clock)
    kb = LeaseKeeper(b, "ns", "tandem-planner", "b", 15, clock)
    assert await ka.refresh() and not await kb.refresh()
    clock.t += 10
    assert await ka.refresh() and not await kb.refresh()  # a renews in time
    clock.t += 16  # a stopped renewing
    assert await kb.refresh() and not await ka.refresh()
    assert [c["verb"] for c in a.calls] == ["GET", "POST", "GET", "PUT", "GET"]
    assert b.calls[-1]["verb"] == "PUT" and b.calls[-1]["body"]["spec"]["holderIdentity"] == "b"
    assert b.calls[-1]["path"] == "/apis/coordination.k8s.io/v1/namespaces/ns/leases/tandem-planner"


def test_settings_reject_nonsense():
    with pytest.raises(ValueError, match="min_replicas 5 > max_replicas 2"):
        RoleBounds(min_replicas=5, max_replicas=2)
    with pytest.raises(ValueError):
        PlannerSettings(mode="sometimes")


def test_pods_slower_than_the_profile_get_more_replicas():
    seen = dict(prefill_seconds_seen=3 * PROFILE.prefill_seconds(200), prefilled_per_s=20.0)
    plain = planner().step(obs(10, 20), {"prefill": 1, "decode": 1})
    slow = planner().step(obs(10, 20, **seen), {"prefill": 1, "decode": 1})
    # one interval at 3x moves the factor halfway: 1 + (3 - 1) / 2 = 2
    assert slow.corrections[0] == pytest.approx(2.0) and slow.prefill > plain.prefill
    # decode: 20 req/s x 100 tokens = 2000 tokens/s over 1 pod at 24 ms a gap = 48 per step -> batch 8
    # (clamped), where the profile steps in 12 ms: 2x slower, so the factor moves halfway, to 1.5
    slow_d = planner().step(obs(10, 20, itl_mean_s=0.024, decoded_tokens_per_s=2000.0), {"prefill": 1, "decode": 1})
    assert slow_d.corrections[1] == pytest.approx(1.5) and slow_d.decode > plain.decode
    off = Planner(PROFILE, planner().cfg, corrections=Corrections(enabled=False))
    assert off.step(obs(10, 20, **seen), {"prefill": 1, "decode": 1}).corrections == (1.0, 1.0)
    # a wild measurement is clamped
    wild = planner().step(obs(10, 20, prefill_seconds_seen=100.0, prefilled_per_s=1.0), {"prefill": 1, "decode": 1})
    assert wild.corrections[0] == pytest.approx((1 + LIMIT) / 2)


# -- KV capacity (planner/kv.py) bounds the decode batch ------------------------------------------

# A small paged pool: 128 blocks of 16 positions, one block of reserve a row, 16 rows.
SMALL_PAGED = KVCapacity("paged", rows=16, block_size=16, blocks_total=128, reserve_blocks=1)


def test_kv_capacity_counts_sequences_as_the_block_budget_admits_them():
    # 700 positions: ceil(700 / 16) = 44 blocks + 1 of reserve = 45 a sequence; 128 // 45 = 2
    assert SMALL_PAGED.blocks_for(700) == 45 and SMALL_PAGED.sequences(700) == 2
    assert SMALL_PAGED.sequences(704) == 2 and SMALL_PAGED.blocks_for(705) == 46
    # short sequences: 3 blocks each would fit 42, but the pod has 16 rows
    assert SMALL_PAGED.sequences(32) == 16
    # longer than the pool: an empty pod still takes one
    assert SMALL_PAGED.sequences(100_000) == 1
    # the slot layout set max_len aside per row: rows, whatever the length
    assert KVCapacity("slots", rows=4).sequences(100_000) == 4
    with pytest.raises(ValueError, match="block_size 0"):
        KVCapacity("paged", rows=4, block_size=0, blocks_total=10)
    with pytest.raises(ValueError, match="layout"):
        KVCapacity("pages", rows=4)


def test_kv_capacity_read_from_heartbeats_and_the_smallest_pod_kept():
    paged = {"layout": "paged", "block_size": 16, "blocks_total": 256, "blocks_free": 64, "blocks_used": 192,
             "reserve_blocks": 2}
    big = pod_capacity(16, 3, {"pool": "p", "kv": paged})
    assert big == KVCapacity("paged", rows=16, block_size=16, blocks_total=256, reserve_blocks=2, used=0.75)
    older_kv = {k: v for k, v in paged.items() if k != "reserve_blocks"}  # a pod from before reserve_blocks
    older = pod_capacity(16, 16, {"kv": {**older_kv, "blocks_total": 128, "blocks_free": 128}})
    assert older is not None and older.reserve_blocks == 1 and older.used == 0.0
    slots = pod_capacity(8, 6, {"pool": "p"})  # a slot pod publishes its rows only
    assert slots == KVCapacity("slots", rows=8, used=0.25)
    assert pod_capacity(0, 0, {}) is None  # no rows: says nothing
    assert pod_capacity(8, 8, {"kv": {"layout": "paged", "block_size": "x"}}) is None
    assert pod_capacity(8, 8, {"kv": {**paged, "blocks_total": 0}}) is None  # malformed: says nothing
    got = pool_capacity([big, older, slots])
    # the fewest rows (the slot pod's 8) and the smallest pool (128 blocks, its reserve)
    assert (got.layout, got.rows, got.blocks_total, got.block_size, got.reserve_blocks, got.pods) == \
        ("paged", 8, 128, 16, 1, 3)
    assert got.used == pytest.approx((0.75 + 0.0 + 0.25) / 3)
    assert pool_capacity([slots]).layout == "slots" and pool_capacity([]) is None


def test_decode_batch_is_capped_by_what_the_kv_holds_at_the_mean_length():
    slo = SLOConfig(itl_s=0.05)  # the ITL target allows all 8 of the profile's slots
    # a running sequence holds prompt + output / 2 on average: 600 + 200 / 2 = 700 positions
    b = decode_batch(PROFILE, slo, kv=SMALL_PAGED, prompt_tokens=600, output_tokens=200)
    assert (b.itl, b.kv, b.positions, b.size, b.kv_bound) == (8, 2, 700, 2, True)
    assert b.note() == "decode: KV holds 2 sequences of ~700 positions per pod, below the 8 the ITL target allows"
    itl_only = decode_needed(20, 200, PROFILE, slo, 0.8)
    assert itl_only == math.ceil(20 * 200 / (0.8 * 8 / 0.012))  # as before: 8
    kv_bound = decode_needed(20, 200, PROFILE, slo, 0.8, kv=SMALL_PAGED, prompt_tokens=600)
    assert kv_bound == math.ceil(20 * 200 / (0.8 * 2 / PROFILE.decode_itl(2))) and kv_bound > itl_only
    # no capacity: exactly the ITL rule
    assert decode_needed(20, 200, PROFILE, slo, 0.8, kv=None, prompt_tokens=600) == itl_only
    assert decode_batch(PROFILE, slo, prompt_tokens=600, output_tokens=200) == DecodeBatch(itl=8)
    # short sequences on a paged pod with more rows than the profile's slots: the batch stays at
    # the profile's 8 (no step time is extrapolated past its slots), so nothing changes
    short = decode_batch(PROFILE, slo, kv=SMALL_PAGED, prompt_tokens=16, output_tokens=32)
    assert (short.kv, short.size, short.kv_bound, short.note()) == (16, 8, False, "")
    assert decode_needed(20, 32, PROFILE, slo, 0.8, kv=SMALL_PAGED, prompt_tokens=16) == decode_needed(20, 32, PROFILE, slo, 0.8)
    # a slot pod with fewer rows than the profile measured runs only its rows
    assert decode_batch(PROFILE, slo, kv=KVCapacity("slots", rows=4), prompt_tokens=16, output_tokens=32).size == 4


def test_planner_sizes_decode_by_the_kv_and_says_so():
    cur = {"prefill": 1, "decode": 1}
    plain = planner().step(obs(10, 20, isl=600, osl=200), cur)
    bound = planner().step(obs(10, 20, isl=600, osl=200, kv=SMALL_PAGED), cur)
    assert plain.decode_batch == DecodeBatch(itl=8) and not any(n.startswith("decode: KV") for n in plain.notes)
    assert bound.decode_batch.size == 2 and bound.wanted_decode > plain.wanted_decode
    assert bound.wanted_prefill == plain.wanted_prefill  # prefill does not read the KV
    assert "decode: KV holds 2 sequences of ~700 positions per pod, below the 8 the ITL target allows" in bound.notes
    # short requests: the same pool is no bound, and the decision is the ITL rule's
    short = planner().step(obs(10, 20, isl=16, osl=32, kv=SMALL_PAGED), cur)
    assert short.wanted_decode == planner().step(obs(10, 20, isl=16, osl=32), cur).wanted_decode
    assert not short.decode_batch.kv_bound and short.notes == ()


class _PagedPool:
    """What `BlockBudget` reads of a paged engine: the pool's sizes and its free count (set by hand)."""

    kv_block_size, kv_blocks_total, max_len, steps_per_dispatch = 16, 128, 2048, 20

    def __init__(self) -> None:
        self.free = self.kv_blocks_total

    def kv_blocks_free(self) -> int:
        return self.free

    def window_group_summary(self) -> None:  # no windowed layers beside global ones
        return None


@pytest.mark.parametrize("positions", [1, 16, 17, 100, 700, 764, 1500, 2048])
def test_planner_counts_sequences_as_the_decode_pods_block_budget_admits_them(positions):
    """The planner's rule (planner/kv.py) read from the paged pod's own heartbeat summary
    (decode_svc/blocks.py) admits exactly as many sequences as `BlockBudget.fits` does on the
    pod, one after another, each at `positions` (reserve: 20 steps = 2 blocks a row)."""
    pool = _PagedPool()
    budget = BlockBudget(pool, reserve_steps=20)  # type: ignore[arg-type]  # the attributes it reads
    cap = pod_capacity(64, 64, {"kv": budget.summary()})
    assert cap is not None and cap.reserve_blocks == 2
    running = 0
    while budget.fits(positions, running):
        pool.free -= budget.blocks_for(positions)
        running += 1
    assert cap.sequences(positions) == running


def test_a_scale_up_is_planned_a_cold_start_ahead():
    """The profile's cold start (a new pod's load + compile) is the scale-up's lead time: on a rising
    load the planner sizes for the load a pod started now will meet when it serves (60 s = six 10 s
    intervals of the trend ahead), so it asks for more pods sooner than without it; on a flat load
    and on a falling one the lead changes nothing."""
    slow = dataclasses.replace(PROFILE, cold_start_s=60.0)
    assert parse_profile({**_doc(), "cold_start_s": 60}).cold_start_s == 60.0
    assert parse_profile(_doc()).cold_start_s == 0.0
    with pytest.raises(ValueError, match="cold_start_s"):
        parse_profile({**_doc(), "cold_start_s": -1})

    def run(profile, rates):
        p, cur, out = planner(profile=profile), {"prefill": 1, "decode": 1}, []
        for i, r in enumerate(rates):
            d = p.step(obs(10 * (i + 1), r), cur)
            out.append((d.wanted_prefill, d.wanted_decode))
        return out

    rising = [10, 20, 30, 40, 50]
    now, ahead = run(PROFILE, rising)[-1], run(slow, rising)[-1]
    # Holt's trend on a straight line is its slope (+10 req/s an interval): six intervals further out
    assert ahead[0] > now[0] and ahead[1] > now[1], (now, ahead)
    # the far forecast sized it: one pod interval at 1 + 6 intervals of trend, against the near one's
    near = LoadPredictor(margin_sigmas=0.0)
    for r in rising:
        near.observe(r, 200, 100)
    far_rate = near.forecast(7).planned_rate
    assert far_rate > near.forecast().planned_rate
    assert ahead[1] == decode_needed(far_rate, 100, PROFILE, SLOConfig(itl_s=0.05), 0.8)
    for flat_or_falling in ([30] * 5, [50, 40, 30, 20, 10]):
        assert run(slow, flat_or_falling) == run(PROFILE, flat_or_falling)


def _doc() -> dict:
    return {"format": "tandem-capacity-profile/v1", "model": "test",
            "prefill": {"points": [{"tokens": 16, "seconds": 0.01}]},
            "decode": {"slots": 8, "points": [{"batch": 1, "itl_s": 0.005}]}}
