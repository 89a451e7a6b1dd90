"""A decode pod meeting a Redis that came back without its last writes (decode_svc/resync.py),
with a real redis-server restarted without persistence (every write of before is gone): a step
whose tokens the fence refused while the reconcile was still putting the pod's running fields
back is written again once it has, so the relay gets no gap to wait on."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from decode_svc.io import DecodeIO
from decode_svc.bridge import Bridge
from decode_svc.items import Emitted
from decode_svc.requests import RequestTable
from decode_svc.settings import DecodeSettings
from tandem.redis_proc import RedisProcess
from tandem_core import keys
from tandem_core.bus.token_stream import TokenEntry
from tandem_core.settings import EngineConfig, RedisConfig
from tandem_core.types import GenerationRequest

KS = keys.KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)


async def _indices(r: aioredis.Redis, rid: str) -> list[int]:
    return sorted({int(f[b"i"]) for _id, f in await r.xrange(KS.token_stream(rid))})


async def test_a_step_refused_while_the_reconcile_replays_is_written_again():
    proc = RedisProcess(appendonly=False).start()
    r = aioredis.Redis.from_url(proc.url)
    s = DecodeSettings(redis=RedisConfig(url=proc.url), engine=EngineConfig(model="tiny", max_len=64),
                       pool="resync", slots=2)
    io = DecodeIO(s, r, KS, RequestTable(2), None, Bridge(2, 8), "decode-r")
    try:
        await io.owned.load()
        assert not await io.resync.current()  # the first Redis: learnt, nothing to reconcile
        req = GenerationRequest("req-r", [256, 65], 8)
        await io.owned.own(req)
        io.journal.add("own", [req])
        assert await io.publisher.publish_fenced([Emitted("req-r", 1, 70)]) == set()

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
        assert await io.publisher.publish_fenced([Emitted("req-r", 2, 71)]) == set()
        assert await reconcile
        assert await _indices(r, "req-r") == [1, 2]

        # A refusal on the same Redis, with no reconcile since, is a real fence: reported.
        await io.owned.disown("req-r")
        assert await io.publisher.publish_fenced([Emitted("req-r", 3, 72)]) == {"req-r"}
        assert await _indices(r, "req-r") == [1, 2]
    finally:
        await io.puller.close()
        await r.aclose()
        proc.close()


async def _restarted_mid_replay(proc, r, io, req_id: str):
    """Journal own + tokens 1..3 of one request, restart Redis empty, and start a reconcile that
    pauses just after it has put the running field back (before the tokens). Returns the
    reconcile task and the event that lets it go on."""
    await io.owned.load()
    assert not await io.resync.current()
    req = GenerationRequest(req_id, [256, 65], 5)
    await io.owned.own(req)
    io.journal.add("own", [req])
    assert await io.publisher.publish_fenced([Emitted(req_id, i, 70 + i) for i in (1, 2, 3)]) == set()
    proc.stop()
    proc.start()
    await r.connection_pool.disconnect()
    write, owned_back, go_on = io.resync._write, asyncio.Event(), asyncio.Event()

    async def paused_write(kind, payload, fenced):
        await write(kind, payload, fenced)
        if kind == "own":
            owned_back.set()
            await go_on.wait()

    io.resync._write = paused_write
    reconcile = asyncio.create_task(io.resync.current())
    await owned_back.wait()
    return reconcile, go_on


def _io(proc, r, pool: str) -> DecodeIO:
    s = DecodeSettings(redis=RedisConfig(url=proc.url), engine=EngineConfig(model="tiny", max_len=64),
                       pool=pool, slots=2)
    return DecodeIO(s, r, KS, RequestTable(2), None, Bridge(2, 8), "decode-r")


async def test_a_finish_waits_for_the_replay_so_earlier_tokens_are_not_refused():
    """The field is back, the tokens not yet: a finishing step written now would remove the field
    and leave the replayed tokens 1..3 refused, a gap the relay waits on forever. The publish
    waits for the replay instead."""
    proc = RedisProcess(appendonly=False).start()
    r = aioredis.Redis.from_url(proc.url)
    io = _io(proc, r, "resync-finish")
    try:
        reconcile, go_on = await _restarted_mid_replay(proc, r, io, "req-f")
        publish = asyncio.create_task(io.publisher.publish_fenced([Emitted("req-f", 4, 74, "length")]))
        await asyncio.sleep(0.2)
        assert not publish.done()  # held until the replay is over
        go_on.set()
        assert await reconcile
        assert await publish == set()
        assert await _indices(r, "req-f") == [1, 2, 3, 4]
    finally:
        await io.puller.close()
        await r.aclose()
        proc.close()


async def test_tokens_refused_in_a_replay_of_a_request_finished_here_are_written_unfenced():
    """A finish that reached Redis while the replay ran (a write in flight as it began) removed
    the field; the replay's rewrites of that request's earlier tokens are refused, then written
    without the fence because this pod itself finished it. Another pod's request stays fenced."""
    proc = RedisProcess(appendonly=False).start()
    r = aioredis.Redis.from_url(proc.url)
    io = _io(proc, r, "resync-unfenced")
    try:
        reconcile, go_on = await _restarted_mid_replay(proc, r, io, "req-u")
        finish = [TokenEntry("req-u", 4, 74, "length")]
        io.publisher.note_finished(finish, await io.publisher.write_tokens(finish))  # the write in flight
        assert "req-u" in io.publisher.finished_here and not await r.hexists(KS.running_key("decode-r", 0), "req-u")
        go_on.set()
        assert await reconcile
        assert await _indices(r, "req-u") == [1, 2, 3, 4]

        # Refused tokens of a request this pod did not finish are not forced in.
        io.publisher.replay_refused = [TokenEntry("req-x", 1, 71)]
        await io.publisher.after_replay()
        assert await _indices(r, "req-x") == []
    finally:
        await io.puller.close()
        await r.aclose()
        proc.close()
