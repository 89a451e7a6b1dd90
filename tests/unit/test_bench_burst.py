"""bench/burst.py's pure parts: the first-token timeline of a burst and its section's table. No
servers."""
from __future__ import annotations

import argparse
import math

from bench import burst


def test_timeline_is_the_first_ttft_and_the_cadence_after_it():
    first, cadence = burst.timeline([0.40, 0.10, 0.25, 0.16])  # answered one after another, unsorted
    assert math.isclose(first, 100.0) and math.isclose(cadence, 100.0)
    assert burst.timeline([0.2]) == (200.0, 0.0)
    assert all(math.isnan(x) for x in burst.timeline([]))


def test_section_lists_the_timeline_and_the_ratio_to_a_healthy_vllm():
    a = argparse.Namespace(n=16, prompt_len=512, output_len=16, rounds=2, slots=32, max_len=1024)

    def system(p90, first, cadence, errors=0):
        rounds = [{"p90_ms": p90, "first_ms": first, "cadence_ms": cadence, "errors": errors}] * 2
        return {"rounds": rounds, "p90_ms_median": p90}

    text = burst.section({"disagg": system(500.0, 40.0, 30.0), "vllm": system(400.0, 150.0, 16.0)}, a, ["--quick"])
    row = next(line for line in text.splitlines() if line.startswith("| disagg"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:] == ["40", "30", "0", "1.25"]
    assert "then one every ms" in text and "no ratio is quoted" not in text
    sick = burst.section({"disagg": system(500.0, 40.0, 30.0), "vllm": system(400.0, 150.0, 16.0, errors=1)}, a, [])
    assert "no ratio is quoted" in sick
