"""Failover of the one Redis shard mid-load, with real processes: `tandem local` (1 prefill,
2 decode pods of 2 slots, the fault tests' fast heartbeats) against a primary, a replica and three
sentinels on loopback (tandem.redis_proc.SentinelGroup). 8 greedy, resumable, streamed requests;
when half of them have 5 tokens the primary is SIGKILLed; the sentinels promote the replica, every
service follows them there, and every request must finish with the unbroken run's text, no token
index missing or repeated. The requests, the trigger and the verdict are bench/faults.py's.

With asynchronous replication the replica may lack the primary's last writes; the verdict is not
loosened for that. The run's evidence (cluster log, sentinel and Redis logs, each stream's
indices) is kept in the test's temporary directory for whoever has to explain a failure.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from bench import faults
from tandem.redis_proc import SentinelGroup
from tests.e2e.conftest import start_local, stop_local

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
FAULT = "SIGKILL the Redis primary; Sentinel promotes the replica"
WANT = {"prefill": 1, "decode": 2}  # this test's cluster shape (bench/faults.py's may differ)


@pytest.fixture(scope="module")
def failover_cluster(tmp_path_factory):
    where = tmp_path_factory.mktemp("sentinel-failover")
    group = SentinelGroup(dir=str(where)).start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in faults.FAST_HEARTBEAT.items():
                mp.setenv(k, v)
            c = start_local(faults.MODEL, prefill=WANT["prefill"], decode=WANT["decode"], slots=2,
                            extra=["--redis-sentinel", ",".join(group.hosts), "--redis-master", group.master_name])
        try:
            yield c, group, where
        finally:
            stop_local(c.proc)
            (where / "cluster.log").write_text("".join(c.log))
    finally:
        group.stop()


@pytest.mark.timeout(600)  # cluster start, the reference run and the faulted run, on 2 cores
def test_primary_sigkill_mid_stream_loses_and_duplicates_nothing(failover_cluster):
    c, group, where = failover_cluster
    result, promoted_s, got = asyncio.run(_run(c, group))
    (where / "result.json").write_text(json.dumps(
        {"result": result.__dict__, "promoted_s": promoted_s, "replication_at_kill": group.last_kill,
         "streams": [{"indices": g.indices, "finish": g.finish, "error": g.error, "resumes": g.resumes} for g in got]},
        indent=1))
    print(f"{result}; promoted after {promoted_s}s; replication at the kill {group.last_kill}; evidence in {where}")
    assert promoted_s is not None, f"no replica was promoted; logs in {where}"
    assert result.finished == result.sent, (result, str(where))
    assert (result.lost, result.duplicated, result.missing, result.wrong_text) == (0, 0, 0, 0), (result, str(where))
    log = "".join(c.log)
    assert "redis through sentinels" in log and "redis pid=" not in log  # no embedded Redis was started


async def _run(c, group: SentinelGroup):
    await faults.wait_healthy(c.base_url, WANT)
    ps = faults.prompts(8)
    ref, _ = await faults.run_batch(c.base_url, ps, 400)
    promoted: dict[str, float] = {}

    async def inject() -> float:
        old = group.kill_primary()
        struck = time.monotonic()

        def watch() -> None:
            group.wait_promoted(old, timeout_s=60)
            promoted["s"] = time.monotonic() - struck

        threading.Thread(target=watch, daemon=True).start()
        return struck

    got, fault_at = await faults.run_batch(c.base_url, ps, 400, inject, faults.tokens_at_least(5))
    result = faults.judge(FAULT, ref, got, 400, fault_at)
    promoted_s = round(promoted["s"], 2) if "s" in promoted else None
    return result, promoted_s, got
