"""bench/burst.py's pure parts: the first-token timeline of a burst, its section's table, and the
CPU per prompt by role (read from a real child process). No servers."""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

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
    assert cells[3:7] == ["40", "30", "0", "1.25"]
    assert "then one every ms" in text and "no ratio is quoted" not in text
    sick = burst.section({"disagg": system(500.0, 40.0, 30.0), "vllm": system(400.0, 150.0, 16.0, errors=1)}, a, [])
    assert "no ratio is quoted" in sick


def test_cpu_per_prompt_by_role_from_real_processes():
    """A child whose command line names a Tandem module is counted under its role; the numbers
    are its CPU time, so a child that burns CPU shows it, one that sleeps does not."""
    busy = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
            "while time.process_time() - t < 0.4: pass\ntime.sleep(60)  # prefill_svc")
    idle = "import time; time.sleep(60)  # gateway"
    kids = [subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE, text=True),
            subprocess.Popen([sys.executable, "-c", idle])]
    try:
        before = burst.cpu_by_role(os.getpid())
        assert {"prefill", "gateway", "server"} <= set(before)  # this process (pytest) is "server"
        kids[0].stdin.write("go\n")
        kids[0].stdin.flush()
        t0 = time.monotonic()  # a deadline, not a timing under test
        while burst.cpu_by_role(os.getpid())["prefill"] - before["prefill"] < 0.4 and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        after = burst.cpu_by_role(os.getpid())
    finally:
        for k in kids:
            k.kill()
            k.wait()
    per = burst.cpu_per_prompt(before, after, prompts=2)
    assert per["prefill"] >= 0.4 * 1e3 / 2 - 1e-6, per  # its CPU seconds over 2 prompts, in ms
    assert per["gateway"] < 50, per  # asleep all along
    assert burst.cpu_cell({"prefill": 30.4, "decode": 25.0, "gateway": 5.2}) == "61: prefill 30, decode 25, gateway 5"
    assert burst.cpu_cell({"server": 44.0}) == "44"
    assert burst.cpu_cell(None) is None
