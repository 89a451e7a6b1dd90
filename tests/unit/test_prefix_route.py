"""Cache-aware routing decisions (gateway/prefix_route.py) and the cluster prefix-cache counters
(gateway/metrics.py), apart from Redis."""
from __future__ import annotations

from collections import Counter

import pytest

from gateway.metrics import GatewayMetrics, PodCounters, prefix_cache_summary
from gateway.prefix_route import PrefixRouter, rendezvous
from gateway.cluster_view import ClusterView
from tandem_core.prefix import block_hashes

B = 4  # block size in these tests
PODS = ["p0", "p1", "p2", "p3"]


def _prompt(seed: int, blocks: int, tail: int = 1) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * B + tail)]


def _router(**kw) -> PrefixRouter:
    return PrefixRouter(block_size=kw.pop("block_size", B), **kw)


def test_longest_match_wins():
    r = _router()
    shared = _prompt(1, 2, tail=0)
    longer = shared + _prompt(2, 2, tail=0)
    r.record(block_hashes(shared, B), "p1")
    r.record(block_hashes(longer, B), "p2")  # p2 saw 4 blocks, the first 2 shared with p1's
    got = r.choose(longer + [7], PODS, {})
    assert (got.pod, got.reason, got.matched_blocks) == ("p2", "prefix_hit", 4)
    other = shared + _prompt(3, 1, tail=0)  # shares only 2 blocks, now owned by p2 (latest)
    got = r.choose(other, PODS, {})
    assert (got.pod, got.reason, got.matched_blocks) == ("p2", "prefix_hit", 2)


def test_a_routed_prompt_is_learned():
    r = _router()
    first = r.choose(_prompt(5, 3), PODS, {})
    assert first.reason == "rendezvous" and first.pod in PODS
    again = r.choose(_prompt(5, 3), PODS, {})
    assert (again.pod, again.reason, again.matched_blocks) == (first.pod, "prefix_hit", 3)


def test_rendezvous_is_stable_across_routers_and_spread_over_pods():
    a, b = _router(), _router()
    picks = [a.choose(_prompt(s, 2), PODS, {}).pod for s in range(400)]
    assert picks == [b.choose(_prompt(s, 2), list(reversed(PODS)), {}).pod for s in range(400)]
    counts = Counter(picks)
    assert set(counts) == set(PODS) and min(counts.values()) > 60  # ~100 each
    # The same first block, a different rest: the same pod (a cold shared prefix stays together).
    c = _router()
    head = _prompt(9, 1, tail=0)
    assert c.choose(head + [1] * 9, PODS, {}).pod == c.choose(head + [2] * 9, PODS, {}).pod


def test_rendezvous_moves_only_the_leaving_pods_share():
    keys = [i.to_bytes(2, "big") * 8 for i in range(500)]
    before = {k: rendezvous(k, PODS) for k in keys}
    after = {k: rendezvous(k, [p for p in PODS if p != "p2"]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "p2" for k in moved)
    joined = {k: rendezvous(k, PODS + ["p4"]) for k in keys}
    assert all(joined[k] in (before[k], "p4") for k in keys)


def test_busy_pod_falls_back_to_shared_and_is_not_recorded():
    r = _router(max_backlog=3)
    p = _prompt(7, 2)
    pod = rendezvous(block_hashes(p, B)[0], PODS)
    got = r.choose(p, PODS, {pod: 3})
    assert (got.pod, got.reason) == (None, "busy") and len(r) == 0
    assert r.choose(p, PODS, lambda q: 2 if q == pod else 0).pod == pod  # callable backlog, under the bound
    r.record(block_hashes(p, B), "p0")
    got = r.choose(p, PODS, {"p0": 5})
    assert (got.pod, got.reason, got.matched_blocks) == (None, "busy", 2)


def test_dead_or_draining_pod_is_never_chosen():
    r = _router()
    p = _prompt(3, 3)
    r.record(block_hashes(p, B), "gone")
    for _ in range(20):
        got = r.choose(p, ["p0", "p1"], {})
        assert got.pod in ("p0", "p1")
    # A shallower block owned by a live pod still counts as a (shorter) hit.
    r2 = _router()
    r2.record(block_hashes(p, B), "gone")
    r2.record(block_hashes(p[:B], B), "p1")  # block 0 -> p1, blocks 1, 2 -> gone
    got = r2.choose(p, ["p0", "p1"], {})
    assert (got.pod, got.reason, got.matched_blocks) == ("p1", "prefix_hit", 1)


def test_lru_bound_holds_and_keeps_recent_prefixes():
    r = _router(max_entries=10)
    for s in range(50):
        r.choose(_prompt(s, 3), PODS, {})
        assert len(r) <= 10
    hit = r.choose(_prompt(49, 3), PODS, {})
    assert hit.reason == "prefix_hit" and hit.matched_blocks == 3
    assert r.choose(_prompt(0, 3), PODS, {}).reason == "rendezvous"  # long evicted
    # A prompt longer than the index keeps its shallow blocks, the ones other prompts share.
    small = _router(max_entries=2)
    p = _prompt(1, 5)
    small.record(block_hashes(p, B), "p3")
    assert small.choose(p[:2 * B], PODS, {}).matched_blocks == 2


def test_short_single_pod_and_off():
    r = _router()
    assert r.choose(list(range(B - 1)), PODS, {}).reason == "short"
    assert r.choose(_prompt(1, 3), ["p0"], {}).reason == "single_pod"
    assert r.choose(_prompt(1, 3), [], {}).pod is None
    off = _router(enabled=False)
    assert (off.choose(_prompt(1, 3), PODS, {}).reason, len(off)) == ("off", 0)
    with pytest.raises(ValueError):
        PrefixRouter(block_size=0)


def test_cluster_view_lists_live_prefill_pods_that_take_per_pod_entries():
    on = {"prefix_cache": {"enabled": True}, "pool": "mine"}
    v = ClusterView.of([
        {"role": "prefill", "id": "a", "free_slots": 0, "extra": on},
        {"role": "prefill", "id": "nopool", "free_slots": 0, "extra": {"prefix_cache": {"enabled": True}}},  # ours
        {"role": "prefill", "id": "b", "free_slots": 0, "draining": True, "extra": on},
        {"role": "prefill", "id": "old", "free_slots": 0, "extra": {}},  # no cache published: older pod
        {"role": "prefill", "id": "off", "free_slots": 0, "extra": {"prefix_cache": {"enabled": False}}},
        {"role": "prefill", "id": "p2", "free_slots": 0, "extra": {**on, "pool": "other"}},
        {"role": "prefill", "id": "p1", "free_slots": 0, "extra": {**on, "pool": "mine"}},
        {"role": "decode", "id": "d", "free_slots": 2, "extra": on},
    ], pool="mine")
    assert v.prefill_ids == ("a", "nopool", "p1") and v.prefill_workers == 6


def _w(wid: str, pid: int = 1, **pc) -> dict:
    return {"id": wid, "role": "prefill", "pid": pid, "extra": {"prefix_cache": {"enabled": True, **pc}}}


def test_counter_deltas_and_restart():
    c = PodCounters()
    assert c.deltas([_w("a", queries=100, hits=40, computed=60), {"id": "x", "extra": {}}]) == \
        {"queries": 100, "hits": 40, "computed": 60}
    assert c.deltas([_w("a", queries=150, hits=70, computed=80)]) == {"queries": 50, "hits": 30, "computed": 20}
    assert c.deltas([_w("a", queries=150, hits=70, computed=80)]) == {"queries": 0, "hits": 0, "computed": 0}
    # Restarted: a count went down, so all began again at 0 (even the one that grew).
    assert c.deltas([_w("a", queries=200, hits=5, computed=195)]) == {"queries": 200, "hits": 5, "computed": 195}
    # Restarted with a new pid, counts happen to be higher.
    assert c.deltas([_w("a", pid=2, queries=300, hits=10, computed=290)]) == \
        {"queries": 300, "hits": 10, "computed": 290}
    small = PodCounters(max_pods=2)
    small.deltas([_w(f"p{i}", queries=1) for i in range(5)])
    assert len(small._last) == 2


def test_metrics_counters_and_summary():
    m = GatewayMetrics()
    m.observe_prefix_cache([_w("a", queries=10, hits=4, computed=6)])
    m.observe_prefix_cache([_w("a", queries=30, hits=14, computed=16)])
    text = m.render().decode()
    assert "vllm:prefix_cache_queries_total 30.0" in text and "vllm:prefix_cache_hits_total 14.0" in text
    assert "tandem_prefill_tokens_computed_total 16.0" in text
    s = prefix_cache_summary([_w("a", queries=10, hits=4, bytes=100, blocks=2, block_size=16),
                              _w("b", block_size=32), {"id": "c", "extra": {}}], 16)
    assert [r["id"] for r in s["workers"]] == ["a", "b"]
    assert s["workers"][0]["hit_rate"] == 0.4 and s["workers"][1]["hit_rate"] is None
    assert s["totals"]["bytes"] == 100 and s["totals"]["hit_rate"] == 0.4
    assert s["block_size_mismatch"] == ["b"]


def test_speculative_counters_follow_the_decode_pods_heartbeats():
    """vllm:spec_decode_* (decode_svc/speculate.py's counts): cluster increments, a pod that
    publishes none (speculation off: None) adds nothing."""
    def pod(pid, per_pos=None, **counts):
        return {"id": "d", "pid": pid, "extra": {"speculative": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                                                                  "accepted_per_pos": per_pos or {}, **counts}}}

    m = GatewayMetrics()
    m.observe_prefix_cache([pod(1, {"0": 4, "1": 3}, drafts=5, draft_tokens=20, accepted_tokens=12),
                            {"id": "off", "extra": {"speculative": None}}])
    m.observe_prefix_cache([pod(1, {"0": 8, "1": 6, "2": 1}, drafts=9, draft_tokens=36, accepted_tokens=30)])
    text = m.render().decode()
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1.0' in text
    assert "vllm:spec_decode_num_drafts_total 9.0" in text
    assert "vllm:spec_decode_num_draft_tokens_total 36.0" in text
    assert "vllm:spec_decode_num_accepted_tokens_total 30.0" in text
