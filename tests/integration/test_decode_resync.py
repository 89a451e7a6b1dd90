"""A decode pod meeting a Redis that came back without its last writes (decode_svc/resync.py),
with a real redis-server restarted without persistence (every write of before is gone): a step
whose tokens the fence refused while the reconcile was still putting the pod's running fields
back is written again once it has, so the relay gets no gap to wait on."""
from __future__ import annotations

import asyncio
import queue

import redis.asyncio as aioredis

from decode_svc.io import DecodeIO
from decode_svc.loop import Emitted
from decode_svc.settings import DecodeSettings
from decode_svc.slots import SlotTable
from tandem.redis_proc import RedisProcess
from tandem_core import keys
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest


async def _indices(r: aioredis.Redis, rid: str) -> list[int]:
    return sorted({int(f[b"i"]) for _id, f in await r.xrange(keys.token_stream(rid))})


async def test_a_step_refused_while_the_reconcile_replays_is_written_again():
    proc = RedisProcess(appendonly=False).start()
    r = aioredis.Redis.from_url(proc.url)
    s = DecodeSettings(redis=RedisConfig(url=proc.url), engine=EngineConfig(model="tiny", max_len=64),
                       pool="resync", slots=2)
    io = DecodeIO(s, r, SlotTable(2), None, queue.Queue(2), queue.Queue(8), "decode-r")
    try:
        await io.owned.load()
        assert not await io.resync.current()  # the first Redis: learnt, nothing to reconcile
        req = GenerationRequest("req-r", [256, 65], 8)
        await io.owned.own(req)
        io.journal.add("own", [req])
        assert await io._publish_fenced([Emitted("req-r", 1, 70)]) == set()

        proc.stop()
        proc.start()  # a new run_id, and the running hash is gone with the rest
        await r.connection_pool.disconnect()
        load = io.resync._before

        async def slow_load():  # the reconcile takes a while before it writes the journal again
            await asyncio.sleep(0.3)
            await load()

        io.resync._before = slow_load
        reconcile = asyncio.create_task(io.resync.current())
        while io.resync.started == 0:  # it has taken its copy of the journal
            await asyncio.sleep(0.005)
        # This step reaches Redis before the running field is back: the fence refuses it at
        # first; it is not another pod's, so it must end up written, not dropped.
        assert await io._publish_fenced([Emitted("req-r", 2, 71)]) == set()
        assert await reconcile
        assert await _indices(r, "req-r") == [1, 2]

        # A refusal on the same Redis, with no reconcile since, is a real fence: reported.
        await io.owned.disown("req-r")
        assert await io._publish_fenced([Emitted("req-r", 3, 72)]) == {"req-r"}
        assert await _indices(r, "req-r") == [1, 2]
    finally:
        await io.puller.close()
        await r.aclose()
        proc.stop()
