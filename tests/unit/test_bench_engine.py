"""bench/engine.py's arithmetic and bench/common.py's outputs: roofline formulas checked by hand,
markdown tables, RESULTS.md sections that leave other benchmarks' sections alone, and the summary
merge. No timing is measured or asserted here."""
from __future__ import annotations

import json

import pytest

from bench import common, run_all
from bench import engine as bench
from tandem_core.models import PRESETS, ModelInfo

TOY = ModelInfo(name="toy", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=64)


def test_layer_params_by_hand():
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8 = 192; mlp 3 * 8 * 16 = 384
    assert bench.layer_matmul_params(TOY) == 2 * (192 + 384)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_layer_params_agree_with_model_info(name):
    info = PRESETS[name]
    d, n = info.hidden_size, info.num_layers
    emb = info.vocab_size * d * (1 if info.tie_word_embeddings else 2)
    assert bench.layer_matmul_params(info) + 2 * n * d + d + emb == info.num_params


def test_decode_bytes_and_roofline():
    weights = (bench.layer_matmul_params(TOY) + (2 * 2 + 1) * 8 + 100 * 8) * 4
    assert bench.decode_weight_bytes(TOY) == weights
    assert bench.decode_weight_bytes(TOY, dtype_bytes=2) == weights // 2
    kv = 2 * 2 * 3 * 10 * 1 * 4 * 4  # k+v, layers, batch, context, kv heads, head dim, fp32
    assert bench.kv_bytes(TOY, batch=3, context=10) == kv
    assert bench.decode_roofline_s(TOY, 3, 10, bandwidth=1e3) == pytest.approx((weights + kv) / 1e3)


def test_prefill_flops_and_roofline():
    t = 16
    want = 2 * bench.layer_matmul_params(TOY) * t + 2 * 2 * 2 * 4 * t * t + 2 * 8 * 100
    assert bench.prefill_flops(TOY, t) == want
    assert bench.prefill_roofline_s(TOY, t, flops_per_s=want) == pytest.approx(1.0)
    # 100M preset at 2048 tokens: ~0.4 TFLOP of projections, attention adds ~20%
    big = PRESETS["small-100m"]
    assert 0.3e12 < bench.prefill_flops(big, 2048) < 0.8e12


def test_idle_fraction():
    assert bench.idle_fraction(10.0, 8.0) == pytest.approx(0.2)
    assert bench.idle_fraction(8.0, 10.0) == 0.0  # device slower than the loop: never starved
    assert bench.idle_fraction(0.0, 1.0) == 0.0


def test_decode_max_len_covers_every_round():
    plan = bench.Plan(decode_steps=16, decode_rounds=3, prefill_reps=1, hf_batches=(8,), hf_new_tokens=8)
    n = bench.decode_max_len(plan)
    assert n % 64 == 0 and n > bench.PROMPT_LEN + 3 * 3 * 16


def test_summary_keys_and_tables_from_fake_results():
    r8 = bench.DecodeResult(batch=8, device_s=0.01, wall_serial_s=0.0125, wall_pipelined_s=0.01, context=80,
                             sampling_ms=4.0)
    r32 = bench.DecodeResult(batch=32, device_s=0.02, wall_serial_s=0.025, wall_pipelined_s=0.02, context=80)
    res = {"name": "small-100m", "info": TOY, "decode": [r8, r32], "prefill": [(2048, 2.0)],
           "hf": {8: 400.0}, "skipped": []}
    keys = bench.summary_keys([res], bandwidth=1e6, flops=1e9)
    assert keys["engine_decode_b8_vs_hf_generate"] == pytest.approx(800 / 400)
    roof = bench.decode_roofline_s(TOY, 32, 80, 1e6)
    assert keys["engine_decode_b32_over_mem_roofline_100m"] == pytest.approx(0.02 / roof, rel=1e-2)
    assert keys["engine_prefill_2048_over_matmul_roofline_100m"] == pytest.approx(
        2.0 / bench.prefill_roofline_s(TOY, 2048, 1e9), rel=1e-2)
    assert keys["engine_idle_fraction_b8_serial_100m"] == pytest.approx(0.2)
    rows = bench.pipeline_rows(res)
    assert rows[0][4] == pytest.approx(2.5)  # serial host gap, ms
    row = bench.decode_rows(res, 1e6)[0]
    assert row[-1] == pytest.approx(2.0) and row[4] == 4.0  # engine / HF; sampling ms


def test_markdown_table_and_fmt():
    table = common.markdown_table(["a", "bb"], [[1234567, 0.000123456], ["x", None]])
    lines = table.splitlines()
    assert lines[0].startswith("| a ") and set(lines[1]) <= {"|", "-", " "}
    assert "1,234,567" in lines[2] and "0.000123" in lines[2] and "| -" in lines[3]
    assert len({len(line) for line in lines}) == 1  # padded columns
    assert common.fmt(float("nan")) == "-" and common.fmt(12345.6) == "12,346"


def test_sections_keep_other_benchmarks(tmp_path):
    path = tmp_path / "RESULTS.md"
    common.write_section("other", "other numbers", path)
    common.write_section("engine", "first", path)
    common.write_section("engine", "second", path)
    text = path.read_text()
    assert text.startswith("# Benchmark results")
    assert "other numbers" in text and "second" in text and "first" not in text
    assert text.count("<!-- engine:start -->") == 1 and text.index("other") < text.index("second")


def test_merge_summary_keeps_keys(tmp_path):
    path = tmp_path / "out" / "summary.json"
    common.merge_summary({"a": 1, "b": 2}, path)
    common.merge_summary({"b": 3}, path)
    assert json.loads(path.read_text()) == {"a": 1, "b": 3}


def test_machine_info_and_run_all_list():
    m = common.machine_info()
    assert m["nproc"] >= 1 and m["cpu"] and m["date"]
    assert "engine.py" in run_all.BENCHMARKS
    assert all((common.BENCH_DIR / s.split()[0]).is_file() for s in run_all.BENCHMARKS)  # "script [args]"


def test_step_roofline_positions_and_flops_by_hand():
    from bench import step_roofline as sr

    assert sr.positions_for(1024) == [64, 256, 512, 1023]
    assert sr.positions_for(128) == [64, 127]
    # projections 2 * (1152 + 8 * 100) * batch 3, attention 4 * 2 layers * 2 heads * 4 hd * 10 rows * 3
    assert sr.step_flops(TOY, 3, 9) == 2.0 * (1152 + 800) * 3 + 4.0 * 2 * 2 * 4 * 10 * 3
    assert "step_roofline.py" in run_all.BENCHMARKS
