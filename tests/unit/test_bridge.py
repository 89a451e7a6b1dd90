"""The decode pod's bridge (decode_svc/bridge.py): the engine thread wakes the event loop only when
the publisher (or the claim loop) is parked, and no step is ever left waiting for the wait's
timeout, whichever side gets there first; batches come out whole and in order."""
from __future__ import annotations

import asyncio
import threading

from decode_svc.bridge import Bridge

HOUR = 3600.0  # a wait that only a wake can end here


async def test_a_parked_publisher_is_woken_and_a_busy_one_is_not():
    bridge = Bridge(4, 8, asyncio.get_running_loop())
    waiting = asyncio.create_task(bridge.wait_output(HOUR))
    await asyncio.sleep(0)  # parked
    bridge.put_output([1], 1.0)
    await asyncio.wait_for(waiting, 30)  # (a deadline on a hang, not a timing)
    assert bridge._output.woken == 1
    bridge.put_output([2], 1.0)  # nobody parked (the publisher is writing): no wake sent
    assert bridge._output.woken == 0 + 1
    await asyncio.wait_for(bridge.wait_output(HOUR), 30)  # queued already: returns at once
    assert bridge.take_outputs(8) == [1, 2]
    assert bridge.take_outputs(8) == []


async def test_take_outputs_keeps_order_and_its_bound():
    bridge = Bridge(4, 8)
    for k in range(5):
        bridge.put_output([(k, 0), (k, 1)], 1.0)
    assert bridge.take_outputs(1) == [(0, 0), (0, 1)]
    assert bridge.take_outputs(3) == [(k, j) for k in (1, 2, 3) for j in (0, 1)]
    assert bridge.take_outputs(3) == [(4, 0), (4, 1)]


async def test_an_engine_thread_racing_the_publisher_never_strands_a_step():
    """Thousands of steps put from a thread while the loop takes and parks: every one is taken,
    none waits for the hour-long timeout (a lost wake would hang here until the deadline)."""
    bridge = Bridge(4, 64, asyncio.get_running_loop())
    steps = 3000

    def engine() -> None:
        for k in range(steps):
            bridge.put_output([k], 30.0)

    got: list[int] = []

    async def publisher() -> None:
        while len(got) < steps:
            batch = bridge.take_outputs(4)
            if not batch:
                await bridge.wait_output(HOUR)
                continue
            got.extend(batch)
            if len(got) % 7 == 0:
                await asyncio.sleep(0)  # a write's round trip, now and then

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    await asyncio.wait_for(publisher(), 60)
    th.join(10)
    assert got == list(range(steps))


async def test_a_freed_slot_wakes_the_parked_claim_loop_only():
    bridge = Bridge(4, 8, asyncio.get_running_loop())
    bridge.wake_claims()  # nobody parked: nothing sent
    assert bridge._freed.woken == 0
    waiting = asyncio.create_task(bridge.wait_slot_freed(HOUR))
    await asyncio.sleep(0)
    threading.Thread(target=bridge.wake_claims).start()
    await asyncio.wait_for(waiting, 30)
    assert bridge._freed.woken == 1


def test_a_hand_back_comes_alone_and_after_the_tokens_queued_before_it():
    """A `Preempted` (requests freed for KV blocks, decode_svc/loop.py `_make_room`) is taken only
    once every batch before it is, and alone: the publisher writes those tokens first, then resumes
    the requests from them."""
    from decode_svc.items import Preempted

    bridge = Bridge(4, 8)
    hb = Preempted([], "KV blocks ran out")
    for batch in ([1], [2], hb, [3]):
        bridge.put_output(batch, 1.0)
    assert bridge.take_outputs(8) == [1, 2]
    assert bridge.take_outputs(8) is hb
    assert bridge.take_outputs(8) == [3]
    bridge.put_output(hb, 1.0)
    assert bridge.take_outputs(1) is hb
