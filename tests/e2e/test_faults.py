"""Fault tests: processes on loopback, real Redis, bounded in time and count. For each fault a
set of greedy streamed requests runs with the fault injected mid-flight; every request must
finish, with no token index missing or repeated, and the text of an unbroken reference run.
The scenarios live in bench/faults.py, which also writes docs/reliability.md from a real run."""
from __future__ import annotations

import asyncio

import pytest

from bench import faults
from tests.e2e.conftest import stop_local

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def fault_cluster():
    c = faults.start_cluster()
    try:
        yield c
    finally:
        stop_local(c.proc)


@pytest.mark.parametrize("name", list(faults.SCENARIOS))
def test_fault_loses_and_duplicates_nothing(fault_cluster, name):
    r = asyncio.run(faults.run_fault(fault_cluster, name))
    assert r.finished == r.sent, r
    assert (r.duplicated, r.missing, r.wrong_text) == (0, 0, 0), r


def test_supervisor_restarted_the_killed_workers(fault_cluster):
    workers = asyncio.run(faults.wait_healthy(fault_cluster.base_url, faults.WANT))
    assert sorted(w["id"] for w in workers) == ["decode-0", "decode-1", "prefill-0"]
    log = "".join(fault_cluster.log)
    assert "exited with code -9; restarting" in log
