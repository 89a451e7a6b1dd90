"""Event-loop CPU of the decode pod's per-request and per-poll Redis operations, in process (issue
29 item 2): what a pulled request's ownership and ack cost as two round trips and as one script
call, what one cancel poll (MGET) costs, and what the publisher spends per step writing a step's
tokens (the decode pod's `DecodeIO` publisher draining its bridge, fed by a thread paced like an
engine thread, `--rows` tokens per step), against a real redis-server started here.

    python bench/loop_ops.py [--n 2000] [--poll-keys 32] [--rows 8,32] [--steps 2000] [--only steps]

Old code against new, back to back: `PYTHONPATH=/tmp/old-main python bench/loop_ops.py` measures
the code of that tree with this script (a PYTHONPATH set says where the code comes from).

CPU time of this thread (`time.thread_time`: the syscalls that wake Redis included), on uvloop as
the decode pod runs it, so it holds on a busy machine better than a whole cluster's run does.
Timings are printed, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not os.environ.get("PYTHONPATH") and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


async def measure(url: str, n: int, poll_keys: int) -> dict[str, float]:
    from tandem_core.bus import cancel, conn, groups, token_stream
    from tandem_core.keys import DECODE_GROUP, KeySpace
    from tandem_core.settings import RedisConfig
    from tandem_core.types import GenerationRequest, SamplingParams

    r = conn.connect(RedisConfig(url=url))
    ks = KeySpace(1)
    pub = token_stream.OwnedPublisher(r, ks, "decode-ops", 600, 1000)
    stream = ks.ready_stream("ops", 0)
    await groups.ensure_group(r, stream, DECODE_GROUP)
    prompt = list(range(3, 131))
    out: dict[str, float] = {}
    for way in ("own, then ack (two round trips)", "own_and_ack (one script call)") * 2:
        ids = []
        for i in range(n):
            ids.append(await r.xadd(stream, {"notice": "x"}))
        await r.xreadgroup(DECODE_GROUP, "decode-ops", {stream: ">"}, count=n)
        reqs = [GenerationRequest(f"ops-{way[:3]}-{i:06d}", prompt, 64, SamplingParams()) for i in range(n)]
        t = time.thread_time()
        for q, eid in zip(reqs, ids):
            if way.startswith("own,"):
                await pub.own(q)
                await groups.ack(r, stream, DECODE_GROUP, eid)
            else:
                await pub.own_and_ack(q, stream, DECODE_GROUP, eid)
        out[way] = (time.thread_time() - t) / n * 1e6  # the second pass of each way is kept (warm)
    rids = [f"ops-poll-{i}" for i in range(poll_keys)]
    names: dict[str, bytes] = {}
    poll = lambda: cancel.cancelled(r, ks, rids, names)  # noqa: E731 - the pod's poll where it has no own
    from decode_svc.io import DecodeIO

    if hasattr(DecodeIO, "_cancelled"):  # the decode pod's poll (DecodeIO.cancel_loop), as it runs it
        from decode_svc.bridge import Bridge
        from decode_svc.requests import RequestTable
        from decode_svc.settings import DecodeSettings

        io = DecodeIO(DecodeSettings(redis=RedisConfig(url=url)), r, ks, RequestTable(2), None, Bridge(2, 8),
                      "decode-ops-poll")
        poll = lambda: io._cancelled(rids, names)  # noqa: E731
    t = time.thread_time()
    for _ in range(n):
        await poll()
    out[f"cancel poll (MGET of {poll_keys})"] = (time.thread_time() - t) / n * 1e6
    await r.aclose()
    return out


async def step_writes(url: str, rows: int, steps: int, pace_s: float = 0.001) -> dict[str, float]:
    """The decode pod's publisher (`DecodeIO`'s, as the pod wires it) writing `steps` steps of
    `rows` tokens each: a thread paced like an engine thread puts each step on the bridge (and
    waits `pace_s` between steps, so the publisher keeps up rather than coalescing). Returns the
    event loop thread's CPU per step and per token, and the producer thread's (the engine side
    of the bridge)."""
    from decode_svc.bridge import Bridge
    from decode_svc.io import DecodeIO
    from decode_svc.items import Emitted
    from decode_svc.requests import RequestTable
    from decode_svc.settings import DecodeSettings
    from tandem_core.bus import conn
    from tandem_core.keys import KeySpace
    from tandem_core.settings import RedisConfig
    from tandem_core.types import GenerationRequest, SamplingParams

    s = DecodeSettings(redis=RedisConfig(url=url), slots=rows)
    r = conn.connect(s.redis)
    ks = KeySpace(s.redis.shard_count())
    bridge = Bridge(rows, s.output_queue_size, asyncio.get_running_loop())
    io = DecodeIO(s, r, ks, RequestTable(rows), None, bridge, f"decode-ops-{rows}")
    await io.owned.load()
    out: dict[str, float] = {}
    for rnd in range(2):  # the second round is kept (warm)
        reqs = [GenerationRequest(f"ops-step-{rows}-{rnd}-{i:04d}", [3, 4, 5], steps + 8, SamplingParams())
                for i in range(rows)]
        await io.owned.own(*reqs)
        rids = [q.request_id for q in reqs]
        producer_cpu = [0.0]

        def produce() -> None:
            t = time.thread_time()
            for k in range(steps):
                bridge.put_output([Emitted(rid, k + 1, (k * 7 + j) % 1000) for j, rid in enumerate(rids)], 30.0)
                time.sleep(pace_s)
            producer_cpu[0] = time.thread_time() - t

        done = asyncio.Event()
        th = threading.Thread(target=produce, name="fake-engine-pacer", daemon=True)
        t0 = time.thread_time()
        task = asyncio.create_task(io.publisher.publish_loop(done))
        th.start()
        while th.is_alive():
            await asyncio.sleep(0.05)
        done.set()
        await task
        loop_cpu = time.thread_time() - t0
        got = await r.xlen(ks.token_stream(rids[-1]))
        if got != steps:
            raise RuntimeError(f"the publisher wrote {got} of {steps} tokens of {rids[-1]}")
        out = {f"step write, {rows} rows: event loop per step": loop_cpu / steps * 1e6,
               f"step write, {rows} rows: event loop per token": loop_cpu / steps / rows * 1e6,
               f"step write, {rows} rows: bridge put per step (engine side)": producer_cpu[0] / steps * 1e6}
    await r.aclose()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--poll-keys", type=int, default=32)
    p.add_argument("--rows", default="8,32", help="tokens per step of the step-write runs")
    p.add_argument("--steps", type=int, default=2000, help="steps of each step-write run")
    p.add_argument("--only", default="", help="'steps' or 'ops': one half")
    a = p.parse_args(argv)
    from tandem.redis_proc import RedisProcess

    try:
        import uvloop
        new_loop = uvloop.new_event_loop
    except ImportError:  # the decode pod runs plain asyncio then too
        new_loop = asyncio.new_event_loop
    red = RedisProcess().start()
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            got = {}
            if a.only != "steps":
                got |= runner.run(measure(red.url, a.n, a.poll_keys))
            if a.only != "ops":
                for rows in (int(x) for x in a.rows.split(",") if x):
                    got |= runner.run(step_writes(red.url, rows, a.steps))
    finally:
        red.stop()
    for what, us in got.items():
        print(f"{what:58s} {us:7.1f} µs of CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
