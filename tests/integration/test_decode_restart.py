"""A decode pod restarted under the same id (after its engine thread died, say) takes over what its
previous incarnation left pending: real Redis, real gRPC KV server, real engines.

The previous incarnation can leave more entries pending than the new one has rows free: a pull
per row, and entries whose ack was owed with a hand-back (docs/reliability.md). The startup
reclaim takes as many as there are rows; before, the rest waited for the stale reclaim
(`stale_pending_s`, 60 s), by when the prefill pod's KV lease (`kv_lease_s`, 60 s) had run out
as well, and a client that had streamed part of its answer waited more than a minute (the fault
test at every await lost a request so once: "ReadTimeout" after its first tokens). Now the rest
are taken as rows free.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from decode_svc.recover import reclaim_pending
from prefill_svc.kv_store import KVStore
from tandem_core import keys
from tandem_core.bus import groups, reclaim
from tandem_engine import load_engine
from tests.integration.test_decode_affinity import ROWS, _all_finished, _offer, _paged, _settings
from tests.integration.test_decode_blocks import BUCKETS, KS, MAX_LEN, _kv_server, _Pod


@pytest.fixture(scope="module")
def prefiller():
    """The prefill pod's engine (the ready notices' KV)."""
    return load_engine("tiny", slots=1, max_len=MAX_LEN, prefill_buckets=BUCKETS)


class _Restarted(_Pod):
    """A decode pod's start as decode_svc/app.py orders it: its previous incarnation's leftovers
    reclaimed before its claim loop runs (which would hold the free rows' tickets meanwhile)."""

    async def __aenter__(self):
        await self.io.claims.ensure_own_groups()
        self.eloop.start()
        self.taken = await reclaim_pending(self.io, include_self=True)
        self.tasks = [asyncio.create_task(self.io.claims.claim_loop(self.stop)),
                      asyncio.create_task(self.io.publisher.publish_loop(self.done))]
        return self


async def test_a_restart_takes_every_entry_its_previous_life_left_as_rows_free(redis_url, redis_client, prefiller):
    r, pool, me, n = redis_client, "restart-left", "dec-again", 2 * ROWS + 1
    await groups.ensure_groups(r, KS, pool)
    store = KVStore(1 << 30, 60)
    server, address = await _kv_server(store)
    stream = KS.ready_stream(pool, 0)
    try:
        rids = [f"left-{i}" for i in range(n)]
        for i, rid in enumerate(rids):
            await _offer(r, pool, store, address, prefiller, rid, None, i)
        # the previous incarnation read every notice, then died before it acked any
        assert len(await groups.claim(r, [stream], keys.DECODE_GROUP, me, n, None)) == n
        s = _settings(redis_url, pool, 30_000)
        assert s.stale_pending_s >= 60
        t0 = time.monotonic()
        async with _Restarted(s, r, _paged(), me) as pod:
            assert pod.taken == ROWS, pod.taken  # a row each
            await _all_finished(r, rids, timeout_s=30)  # not 60 s later, with every KV lease gone
            assert time.monotonic() - t0 < 30
            assert pod.io.claims.pulled == n
        assert (await r.xpending(stream, keys.DECODE_GROUP))["pending"] == 0
    finally:
        await server.stop(None)
    assert store.held_bytes == 0


async def test_a_reclaim_that_fails_gives_its_rows_back(redis_url, redis_client, monkeypatch):
    """The rows a reclaim reserved for the entries it found are given back when its XCLAIM fails
    (a Redis blip): before, they stayed reserved, and the pod claimed that much less for good."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    r, pool, me = redis_client, "restart-blip", "dec-blip"
    await groups.ensure_groups(r, KS, pool)
    stream = KS.ready_stream(pool, 0)
    for i in range(2):
        await r.xadd(stream, {"rid": f"blip-{i}", "notice": "{}"})
    assert len(await groups.claim(r, [stream], keys.DECODE_GROUP, me, 2, None)) == 2
    pod = _Pod(_settings(redis_url, pool, 30_000), r, _paged(), me)  # (never started: its reclaim alone)

    async def down(*_a, **_k):
        raise RedisConnectionError("Redis went away mid-reclaim")

    monkeypatch.setattr(reclaim, "claim_ids", down)
    with pytest.raises(RedisConnectionError):
        await reclaim_pending(pod.io, include_self=True)
    assert pod.table.room == ROWS, f"rows still reserved by a failed reclaim: {ROWS - pod.table.room}"
