"""Event-loop CPU of the decode pod's per-request and per-poll Redis operations, in process (issue
29 item 2): what a pulled request's ownership and ack cost as two round trips and as one script
call, and what one cancel poll (MGET) costs, against a real redis-server started here.

    python bench/loop_ops.py [--n 2000] [--poll-keys 32]

CPU time of this thread (`time.thread_time`: the syscalls that wake Redis included), on uvloop as
the decode pod runs it, so it holds on a busy machine better than a whole cluster's run does.
Timings are printed, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
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
    t = time.thread_time()
    for _ in range(n):
        await cancel.cancelled(r, ks, rids, names)
    out[f"cancel poll (MGET of {poll_keys})"] = (time.thread_time() - t) / n * 1e6
    await r.aclose()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--poll-keys", type=int, default=32)
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
            got = runner.run(measure(red.url, a.n, a.poll_keys))
    finally:
        red.stop()
    for what, us in got.items():
        print(f"{what:40s} {us:7.1f} µs of event-loop CPU each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
