"""bench/kv_capacity.py's pure parts: the chat-shaped workload (seeded, in bounds, log-normal with
the scaled means), the KV arithmetic, the steady window and what is read in it, the multi-turn
rows and their verdict, the paged-flags check and the report. No servers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench import kv_capacity as kc


def test_chat_pairs_are_seeded():
    assert kc.chat_pairs(3, 50, 1024) == kc.chat_pairs(3, 50, 1024)
    assert kc.chat_pairs(3, 50, 1024) != kc.chat_pairs(4, 50, 1024)


@pytest.mark.parametrize("context", [1024, 512, 2048])
def test_chat_pairs_stay_in_their_bounds_and_the_context(context):
    pairs = kc.chat_pairs(0, 3000, context)
    p = np.array([x for x, _ in pairs])
    o = np.array([y for _, y in pairs])
    assert p.min() >= 32 and p.max() <= 900 and o.min() >= 16 and o.max() <= 256
    assert (p + o).max() <= context
    assert p.max() > 200 and o.max() == 256  # the tails reach far: not a fixed length


def test_chat_pairs_have_the_scaled_log_normal_shape():
    """Medians at mean x scale / exp(sigma^2 / 2), long right tails (mean > median, p90 / p50 as
    a log-normal's exp(1.2816 sigma)), and half the context halves the lengths."""
    n = 20000
    pairs = kc.chat_pairs(1, n, 1024, prompt_range=(1, 10**6), output_range=(1, 10**6))  # unclipped
    p = np.array([x for x, _ in pairs], float)
    o = np.array([y for _, y in pairs], float)
    scale = 1024 / kc.REF_CONTEXT
    want_p = kc.PROMPT_MEAN * scale / math.exp(kc.PROMPT_SIGMA ** 2 / 2)
    want_o = kc.OUTPUT_MEAN * scale / math.exp(kc.OUTPUT_SIGMA ** 2 / 2)
    assert np.median(p) == pytest.approx(want_p, rel=0.05)
    assert np.median(o) == pytest.approx(want_o, rel=0.05)
    assert p.mean() == pytest.approx(kc.PROMPT_MEAN * scale, rel=0.06)
    assert np.percentile(p, 90) / np.median(p) == pytest.approx(math.exp(1.2816 * kc.PROMPT_SIGMA), rel=0.08)
    assert np.percentile(o, 90) / np.median(o) == pytest.approx(math.exp(1.2816 * kc.OUTPUT_SIGMA), rel=0.08)
    half = kc.chat_pairs(1, n, 512, prompt_range=(1, 10**6), output_range=(1, 10**6))
    assert np.median([x for x, _ in half]) == pytest.approx(want_p / 2, rel=0.08)


def test_chat_pairs_refuse_a_context_too_small():
    with pytest.raises(ValueError, match="cannot hold"):
        kc.chat_pairs(0, 5, 40)


def test_kv_arithmetic():
    assert kc.kv_bytes_per_token(layers=4, kv_heads=2, head_dim=64, dtype_bytes=4) == 4096
    assert kc.paged_blocks(slots=8, max_len=1024, block=16) == 512
    assert kc.paged_blocks(slots=3, max_len=100, block=16) == 21  # a partial block still takes one
    assert kc.ratio(12.0, 4.0) == 3.0
    assert math.isnan(kc.ratio(1.0, 0.0)) and math.isnan(kc.ratio(None, 2.0)) and math.isnan(kc.ratio(math.nan, 1.0))


def test_the_steady_window_and_what_is_read_in_it():
    w = kc.steady_window([0.0, 0.0, 4.0, 10.0, 2.0])
    assert w == (1.5, 10.0)
    samples = [(0.5, 1), (2.0, 4), (5.0, 8), (9.0, 6), (11.0, 2)]
    assert kc.held_stats(samples, w) == {"max": 8, "median": 6, "samples": 3}
    assert math.isnan(kc.held_stats([], w)["max"])
    assert kc.tokens_per_s([0.0, 1.0, 2.0, 3.0, 3.5, 12.0], (1.0, 3.0)) == 1.5
    assert math.isnan(kc.tokens_per_s([1.0], (2.0, 2.0)))
    spans = [(0.0, 1.0), (0.5, 3.0), (2.0, 2.5), (4.0, 9.0)]
    assert kc.decoding_at_once(spans, (0.0, 3.0), step_s=0.25) == {"max": 2, "median": 1.5}
    assert kc.decoding_at_once(spans, (0.5, 1.0), step_s=0.25) == {"max": 2, "median": 2}
    assert math.isnan(kc.decoding_at_once(spans, (3.0, 3.0))["max"])


def test_held_now_reads_running_and_rows_taken_from_the_decode_heartbeats():
    cluster = {"workers": [
        {"role": "decode", "slots": 8, "free_slots": 3, "extra": {"requests": {"running": 4, "pulling": 1}}},
        {"role": "decode", "slots": 4, "free_slots": 1, "extra": {}},  # no requests: slots - free
        {"role": "decode", "slots": 4, "free_slots": 0, "draining": True, "extra": {"requests": {"running": 4}}},
        {"role": "prefill", "slots": 0, "free_slots": 0, "extra": {"prefix_cache": {"hit_copy_bytes": 7}}}]}
    assert kc.held_now(cluster) == (4 + 3, 5 + 3)
    assert kc.extra_sum(cluster, "hit_copy_bytes", sub="prefix_cache") == 7
    assert kc.extra_sum(cluster, "pulled_kv_bytes", "decode") is None
    assert kc.ready_now({"queues": {"ready": 3}}) == 3 and kc.ready_now({}) == 0


def test_starved_fraction_counts_the_samples_with_nothing_ready():
    samples = [(0.0, 0), (1.0, 0), (2.0, 3), (3.0, 0), (4.0, 1), (9.0, 0)]
    assert kc.starved_fraction(samples, (1.0, 4.0)) == 0.5
    assert math.isnan(kc.starved_fraction(samples, (5.0, 8.0)))


def test_conversation_turns_extend_the_previous_prompt():
    prompts = kc.conversation(0, 4, vocab=2048)
    assert all(prompts[k] == prompts[k + 1][:len(prompts[k])] for k in range(3))
    new = kc.new_tokens(prompts)
    assert new[0] == len(prompts[0]) and all(48 + 24 <= x <= 48 + 48 for x in new[1:])
    assert min(min(p) for p in prompts) >= 3


def test_turn_rows_and_the_multi_turn_verdict():
    prompts = [[5] * 100, [5] * 170, [5] * 250]
    per = 10
    whole = kc.turn_rows(prompts, [1280, 2560, 2560], per)  # today: each turn's whole (bucket-padded) prompt
    assert [r["new_tokens"] for r in whole] == [100, 70, 80]
    assert [r["needed_bytes"] for r in whole] == [1000, 700, 800]
    assert whole[1]["pulled_over_needed"] == pytest.approx(2560 / 700)
    assert kc.multi_turn_met(whole, per, block=16) is False
    only_new = kc.turn_rows(prompts, [1280, 80 * per, 96 * per], per)  # the new tokens' blocks (+1)
    assert kc.multi_turn_met(only_new, per, block=16) is True
    assert kc.multi_turn_met(kc.turn_rows(prompts, [1280, None, 0], per), per, block=16) is None


def test_missing_flags_reads_the_help_text():
    help_text = "usage: tandem local [--slots SLOTS]\n  --kv-layout {slots,paged}  the layout\n  --kv-blocks N"
    assert kc.missing_flags(["--slots", "12", "--kv-layout", "paged", "--kv-blocks", "64"], help_text) == []
    assert kc.missing_flags(["--kv-layout", "paged", "--kv-block-size", "16"], help_text) == ["--kv-block-size"]
    assert kc.missing_flags(["--kv-layout=paged"], "--kv-blocks") == ["--kv-layout=paged"]


def test_the_paged_side_reads_its_rows_and_kv_from_its_flags():
    c = kc.after_config(["--kv-blocks", "256", "--kv-block-size", "16"], 16, 1024)
    assert (c.rows, c.kv_positions) == (16, 4096)
    c = kc.after_config(["--slots", "12", "--kv-blocks=100", "--kv-block-size=32"], 16, 1024)
    assert (c.rows, c.kv_positions) == (12, 3200)
    c = kc.after_config(["--slots", "6"], 16, 256)  # no --kv-blocks: slots x max_len
    assert (c.rows, c.kv_positions) == (6, 1536)


def _cap(held, toks):
    return {"held": {"max": held + 1, "median": held, "samples": 9}, "occupied": {"max": held + 2, "median": held + 1},
            "decoding_client_view": {"max": held + 1, "median": held}, "ready_empty_fraction": 0.25,
            "output_tok_s": toks, "errors": 0,
            "ttft_ms": {"p50": 10.0, "p90": 20.0}, "tpot_ms": {"p50": 1.0, "p90": 2.0}}


def _doc(paged: dict) -> dict:
    args = {"slots": 4, "max_len": 1024, "block_size": 16, "requests": 40, "clients": 20, "seed": 0, "turns": 2,
            "turn_output": 32, "prefix_requests": 4, "system_len": 384}
    slots = {"args": [], "rows": 4, "kv_bytes": 4 * 1024 * 4096, "capacity": _cap(4, 100.0),
             "multi_turn": {"turns": kc.turn_rows([[1] * 100, [1] * 180], [4096 * 128, 4096 * 256], 4096), "errors": 0,
                            "met": False},
             "prefix": {"requests": 4, "hit_tokens": 1152, "hit_copy_bytes": 1152 * 4096, "bytes_per_hit": 384 * 4096,
                        "bytes_per_hit_token": 4096.0, "errors": 0}}
    doc = {"args": args, "argv": ["--quick"], "machine": {"nproc": 2, "mem_gib": 8, "cpu": "x", "date": "d",
                                                          "python": "3"},
           "code": "abc", "kv_bytes_per_token": 4096, "workload": kc.workload_stats(kc.chat_pairs(0, 40, 1024)),
           "results": {"slots": slots, "paged": paged}}
    doc["summary"] = kc.summary(doc)
    return doc


def test_summary_and_report_when_the_paged_side_ran():
    paged = {"args": ["--kv-layout", "paged"], "rows": 16, "kv_bytes": 4 * 1024 * 4096, "capacity": _cap(13, 160.0),
             "multi_turn": {"turns": [], "errors": 0, "met": True},
             "prefix": {"requests": 4, "hit_tokens": 1152, "hit_copy_bytes": 0, "bytes_per_hit": 0.0,
                        "bytes_per_hit_token": 0.0, "errors": 0}}
    doc = _doc(paged)
    sm = doc["summary"]
    assert sm["held_ratio_median"] == 13 / 4 and sm["tok_s_ratio"] == 1.6
    assert sm["targets"] == {"concurrent sequences >= 3x": "met", "output tok/s >= 1.5x": "met",
                             "multi-turn moves only the new turn's KV": "met", "a prefix hit copies nothing": "met"}
    text = kc.report(doc)
    assert "| paged / slots" in text and "3.25" in text and "Not run" not in text
    row = next(line for line in text.splitlines() if line.startswith("| slots"))
    assert [c.strip() for c in row.strip("|").split("|")][-2:] == ["25", "0"]  # ready queue empty %, errors


def test_too_few_heartbeat_samples_fall_back_to_the_client_view():
    paged = {"args": [], "rows": 16, "kv_bytes": 1, "capacity": _cap(13, 160.0)}
    doc = _doc(paged)
    assert doc["summary"]["held_basis"] == "heartbeats"
    paged["capacity"]["held"]["samples"] = 2
    paged["capacity"]["decoding_client_view"]["median"] = 10  # 10 / 4 < 3
    sm = kc.summary(doc)
    assert math.isnan(sm["held_ratio_median"]) and sm["held_basis"] == "client view"
    assert sm["targets"]["concurrent sequences >= 3x"] == "missed"


def test_summary_and_report_when_the_paged_side_could_not_run():
    doc = _doc({"skipped": "`tandem local` does not accept --kv-layout yet", "args": ["--kv-layout", "paged"]})
    assert set(doc["summary"]["targets"].values()) == {"not measured"}
    text = kc.report(doc)
    assert "Not run: paged: `tandem local` does not accept --kv-layout yet" in text
    assert "| slots" in text and "not measured" in text
