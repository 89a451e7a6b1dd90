"""Failover of the one Redis shard mid-load, with real processes: `tandem local` (1 prefill,
2 decode pods of 2 slots, the fault tests' fast heartbeats) against a primary, a replica and three
sentinels on loopback (tandem.redis_sentinel.SentinelGroup). 8 greedy, resumable, streamed requests;
when half of them have 5 tokens the primary is SIGKILLed; the sentinels promote the replica, every
service follows them there, and every request must finish with the unbroken run's text, no token
index missing or repeated. The requests, the trigger and the verdict are tests/e2e/faults.py's.

With asynchronous replication the replica may lack the primary's last writes; the verdict is not
loosened for that. The run's evidence (cluster log, sentinel and Redis logs, each stream's
indices) is kept in the test's temporary directory for whoever has to explain a failure.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.e2e import faults
from tests.e2e.conftest import stop_local

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def failover_cluster(tmp_path_factory):
    where = tmp_path_factory.mktemp("sentinel-failover")
    with pytest.MonkeyPatch.context() as mp:  # the fault tests' fast heartbeats, for this cluster only
        for k in faults.FAST_HEARTBEAT:
            mp.delenv(k, raising=False)
        group, c = faults.start_sentinel_cluster(str(where))
    try:
        yield c, group, where
    finally:
        stop_local(c.proc)
        (where / "cluster.log").write_text("".join(c.log))
        group.stop()


@pytest.mark.timeout(600)  # cluster start, the reference run and the faulted run, on 2 cores
def test_primary_sigkill_mid_stream_loses_and_duplicates_nothing(failover_cluster):
    c, group, where = failover_cluster
    result, promoted_s, got = asyncio.run(faults.run_sentinel_failover(c, group))
    (where / "result.json").write_text(json.dumps(
        {"result": result.__dict__, "promoted_s": promoted_s, "replication_at_kill": group.last_kill,
         "streams": [{"indices": g.indices, "finish": g.finish, "error": g.error, "resumes": g.resumes} for g in got]},
        indent=1))
    print(f"{result}; replication at the kill {group.last_kill}; evidence in {where}")
    assert promoted_s is not None, f"no replica was promoted; logs in {where}"
    assert result.finished == result.sent, (result, str(where))
    assert (result.lost, result.duplicated, result.missing, result.wrong_text) == (0, 0, 0, 0), (result, str(where))
    log = "".join(c.log)
    assert "redis through sentinels" in log and "redis pid=" not in log  # no embedded Redis was started
