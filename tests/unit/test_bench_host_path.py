"""bench/host_path.py's pure parts: which threads run Python (from a real `py-spy dump`'s text
format), the Python/native split of a process's CPU, and the host-only projection."""
from __future__ import annotations

import math

from bench import host_path

DUMP = '''Process 14693: /work/main/.venv/bin/python -m decode_svc
Python v3.11.7 (/root/.pyenv/versions/3.11.7/bin/python3.11)

Thread 14693 (idle): "MainThread"
    select (selectors.py:468)
Thread 14695 (active): "decode-engine"
    _loop (loop.py:120)
Thread 14701 (idle): "ThreadPoolExecutor-0_3"
    _worker (thread.py:81)
Thread 0x7F0012345678 (idle): "no-os-id"
    run (threading.py:982)
'''


def test_python_threads_are_the_ones_py_spy_lists_by_os_id():
    assert host_path.python_tids(DUMP) == {14693: "MainThread", 14695: "decode-engine",
                                           14701: "ThreadPoolExecutor-0"}


def test_split_counts_python_threads_apart_from_the_rest():
    before = {14693: 100, 14695: 50, 200: 1000}
    after = {14693: 130, 14695: 60, 200: 1400, 201: 7}  # 201: a native thread started meanwhile
    py, native = host_path.split_ms(before, after, host_path.python_tids(DUMP), tck=100)
    assert (py, native) == (400.0, 4070.0)
    by = host_path.by_name(before, after, host_path.python_tids(DUMP), tck=100)
    assert by == {"MainThread": 300.0, "decode-engine": 100.0}  # (14701 did not run in between)


def test_projection_is_one_gil_worth_of_python_per_step():
    p = host_path.projection(py_ms=500.0, steps=100, tokens=25_600)
    assert p["host_us_per_step"] == 5000.0 and p["rows_per_step"] == 256.0
    assert p["host_steps_per_s"] == 200.0 and p["host_tokens_per_s"] == 51_200.0
    assert p["host_us_per_token"] == 500.0 * 1000 / 25_600
    assert math.isnan(host_path.projection(1.0, 0, 0)["host_steps_per_s"])
