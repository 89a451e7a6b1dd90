"""bench/prefix.py's pure parts: the multi-turn workload, Prometheus counter parsing, summaries,
ratios and the report (no sockets, no servers)."""
from __future__ import annotations

import asyncio
import math

import pytest

from bench import prefix as pb
from bench import prefix_report as pr
from bench.loadgen import RequestResult

VOCAB = 2048


def _plan(**kw) -> pr.Plan:
    return pr.Plan(**{"conversations": 6, **kw})


def test_workload_shape_and_determinism():
    plan = _plan()
    convs = pb.build_workload(plan, VOCAB)
    assert len(convs) == 6 and all(len(c) == plan.turns for c in convs)
    assert convs == pb.build_workload(plan, VOCAB)
    assert convs != pb.build_workload(plan, VOCAB, seed=1)
    ids = {t for c in convs for turn in c for t in turn}
    assert min(ids) >= 3 and max(ids) < VOCAB


def test_every_turn_shares_the_system_prompt_and_extends_the_previous_one():
    plan = _plan()
    convs = pb.build_workload(plan, VOCAB)
    system = convs[0][0][: plan.system_len]
    for conv in convs:
        for k, turn in enumerate(conv):
            assert turn[: plan.system_len] == system
            if k:
                prev = conv[k - 1]
                assert turn[: len(prev)] == prev
                grown = len(turn) - len(prev) - plan.assistant_len
                assert plan.user_len[0] <= grown <= plan.user_len[1]
    # conversations differ after the system prompt
    assert convs[0][0][plan.system_len:] != convs[1][0][plan.system_len:]


def test_prompts_stay_below_the_largest_bucket_and_too_long_fails():
    convs = pb.build_workload(pr.Plan(), VOCAB)  # the full 32 x 4 plan
    assert max(len(t) for c in convs for t in c) < pr.MAX_PROMPT
    with pytest.raises(ValueError):
        pb.build_workload(_plan(system_len=450), VOCAB)


def test_bucket_prompts_cover_the_buckets_and_share_nothing():
    convs = pb.build_workload(_plan(), VOCAB)
    warm = pb.bucket_prompts(convs, VOCAB, seed=99)
    assert [len(p) for p in warm] == [16, 32, 64, 128, 256, 512]
    assert all(p[:16] != convs[0][0][:16] for p in warm)


def test_warm_up_conversations_do_not_share_the_measured_system_prompt():
    plan = _plan()
    a, b = pb.build_workload(plan, VOCAB), pb.build_workload(plan, VOCAB, seed=plan.seed + 1000)
    assert a[0][0][:16] != b[0][0][:16]


def test_parse_counters_vllm_text():
    text = "\n".join([
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 123.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="bench"} 7.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="bench"} 1.7e9',
        "vllm:prefix_cache_queries_total 200",
        "tandem_prefill_tokens_computed_total 5e1",
        "unrelated_total 1",
    ])
    got = pr.parse_counters(text)
    assert got == {pr.HITS: 130.0, pr.QUERIES: 200.0, pr.COMPUTED: 50.0}


def test_parse_counters_missing_and_bare_names():
    got = pr.parse_counters("vllm:prefix_cache_hits 4\nsomething_else 1\n")
    assert got[pr.HITS] == 4.0 and got[pr.QUERIES] is None and got[pr.COMPUTED] is None
    assert pr.parse_counters("") == {n: None for n in pr.COUNTERS}


def test_counter_delta_keeps_missing_as_none():
    before = {pr.HITS: 10.0, pr.QUERIES: None, pr.COMPUTED: 3.0}
    after = {pr.HITS: 40.0, pr.QUERIES: 5.0, pr.COMPUTED: 3.0}
    assert pr.counter_delta(before, after) == {pr.HITS: 30.0, pr.QUERIES: None, pr.COMPUTED: 0.0}


def _result(turn: int, ttft: float, prompt_len: int = 100, tokens: int = 24) -> RequestResult:
    return RequestResult(f"turn{turn}", prompt_len, 24, 0.0, ttft_s=ttft, itl_s=[0.01] * (tokens - 1),
                         e2e_s=ttft + 0.01 * (tokens - 1), tokens_out=tokens, usage_tokens=tokens)


def _summary(ttft: float, delta: dict, kind: str = "tandem") -> dict:
    results = [_result(t, ttft * t) for t in (1, 2, 3, 4) for _ in range(3)]
    return pr.summarize_system(results, [t for t in (1, 2, 3, 4) for _ in range(3)], 1.0, delta, kind)


def test_summarize_system_per_turn_and_hit_rate():
    s = _summary(0.01, {pr.HITS: 900.0, pr.QUERIES: 1200.0, pr.COMPUTED: 300.0})
    assert s["prompt_tokens"] == 1200 and s["hit_rate"] == pytest.approx(0.75)
    assert s["hits_per_query"] == pytest.approx(0.75) and s["prefill_computed"] == 300.0
    assert s["ttft_ms_by_turn"]["1"]["p50"] == pytest.approx(10.0)
    assert s["ttft_ms_by_turn"]["4"]["p90"] == pytest.approx(40.0)
    assert s["health"]["healthy"]


def test_summarize_vllm_computes_prefill_from_hits_and_missing_stays_none():
    s = _summary(0.01, {pr.HITS: 1000.0, pr.QUERIES: 1200.0, pr.COMPUTED: None}, kind="vllm")
    assert s["prefill_computed"] == 200
    t = _summary(0.01, {pr.HITS: None, pr.QUERIES: None, pr.COMPUTED: None})
    assert t["hit_rate"] is None and t["prefill_computed"] is None


def test_unhealthy_when_a_request_fails_or_tokens_bundle():
    results = [_result(1, 0.01), RequestResult("turn2", 100, 24, 0.0, error="HTTP 500")]
    s = pr.summarize_system(results, [1, 2], 1.0, {}, "tandem")
    assert not s["health"]["healthy"] and "1 requests failed" in s["health"]["reasons"][0]
    bundled = _result(1, 0.01, tokens=12)
    bundled.usage_tokens = 24
    s = pr.summarize_system([bundled], [1], 1.0, {}, "tandem")
    assert not s["health"]["healthy"]


def test_a_rare_merged_event_stays_healthy():
    results = [_result(1, 0.01) for _ in range(200)]
    results[0].tokens_out = 23  # one event carried two tokens: 4800 / 4799 tokens per event
    s = pr.summarize_system(results, [1] * 200, 1.0, {}, "vllm")
    assert s["health"]["healthy"] and s["health"]["short_streams"] == 1


def test_settled_counters_waits_for_two_equal_reads(monkeypatch):
    reads = iter([{pr.HITS: 1.0}, {pr.HITS: 5.0}, {pr.HITS: 9.0}, {pr.HITS: 9.0}, {pr.HITS: 10.0}])
    monkeypatch.setattr(pb, "read_counters", lambda url: next(reads))
    assert asyncio.run(pb.settled_counters("http://x", gap_s=0.0)) == {pr.HITS: 9.0}


def test_ratios_and_verdicts():
    systems = {"tandem-cache": _summary(0.01, {pr.HITS: 1000.0, pr.QUERIES: 1200.0, pr.COMPUTED: 200.0}),
               "tandem-nocache": _summary(0.04, {pr.HITS: 0.0, pr.QUERIES: 1200.0, pr.COMPUTED: 1200.0}),
               "vllm": _summary(0.02, {pr.HITS: 900.0, pr.QUERIES: 1200.0, pr.COMPUTED: None}, "vllm")}
    rows = {r["ratio"]: r for r in pr.ratio_rows(systems)}
    cache = rows["TTFT p50 tandem-cache / tandem-nocache"]
    assert cache["value"] == pytest.approx(0.25) and cache["verdict"] == "met"
    hit = rows["tandem-cache hit rate (hits / prompt tokens)"]
    assert hit["value"] == pytest.approx(1000 / 1200) and hit["verdict"] == "met"
    assert rows["TTFT p50 tandem-cache / vllm"]["verdict"] == "met"


def test_report_marks_missing_counters_na_and_withholds_ratios():
    systems = {"tandem-cache": _summary(0.01, {pr.HITS: None, pr.QUERIES: None, pr.COMPUTED: None}),
               "tandem-nocache": _summary(0.01, {pr.HITS: None, pr.QUERIES: None, pr.COMPUTED: None}),
               "vllm": {"status": "skipped", "reason": "vLLM CPU is not installed"}}
    doc = {"plan": vars(pr.Plan()), "systems": systems, "argv": ["--quick"], "seconds": 12.0, "code": "abc",
           "machine": {"nproc": 2, "cpu": "X", "mem_gib": 1.0, "date": "today", "python": "3.11"}}
    md = pr.report(doc)
    assert md.startswith("## Prefix caching (bench/prefix.py)")
    assert "n/a" in md and "python bench/prefix.py --quick" in md and "2 CPUs (X)" in md
    rows = {r["ratio"]: r for r in pr.ratio_rows(systems)}
    hit = rows["tandem-cache hit rate (hits / prompt tokens)"]
    assert hit["value"] is None and hit["verdict"] == "-" and "n/a" in hit["why"]
    vs = rows["TTFT p50 tandem-cache / vllm"]
    assert vs["value"] is None and "vllm skipped" in vs["why"]
    assert rows["TTFT p50 tandem-cache / tandem-nocache"]["value"] == pytest.approx(1.0)


def test_ttft_ratio_withheld_for_an_unhealthy_system():
    bad = pr.summarize_system([RequestResult("turn1", 100, 24, 0.0, error="boom"), _result(1, 0.02)], [1, 1],
                              1.0, {}, "tandem")
    rows = pr.ratio_rows({"tandem-cache": _summary(0.01, {}), "tandem-nocache": bad})
    assert rows[0]["value"] is None and "tandem-nocache unhealthy" in rows[0]["why"]
    assert not math.isnan(_summary(0.01, {})["ttft_ms"]["p50"])
