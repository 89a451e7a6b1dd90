"""Host CPU of the decode pod's engine thread and of its publisher, per step and per token, in
process (issue 29 item 2): no Redis, no gRPC, no gateway, so it runs on a busy machine.

    python bench/engine_thread.py [--rows 32] [--steps 200] [--profile]

A real `EngineLoop` (decode_svc/loop.py) with the built-in model and `--rows` requests inserted
at once (short prompts, `ignore_eos`), run for `--steps` full steps. Measured in CPU time, not
wall time (the machine may be shared):
  * engine thread: its whole CPU (`pthread_getcpuclockid`) over the window where every row runs,
    and apart the part spent in `EngineLoop._process` (the per-step Python around the step) and in
    `engine.generate` (the dispatch);
  * event loop's per-step work on the step's tokens: `OwnedPublisher.add_batch` onto a redis-py
    pipeline, the pipeline's packing of those commands (what `execute` does before it sends),
    the replies turned into results, the acks and finishes looked over (as `Publisher._publish`).
`--profile` runs cProfile on the engine thread over the measured window and prints its top functions too.
`--steps-per-dispatch K`: multi-step decode, K steps per generate call (a step counts each of them).
`--arrive-every S` (insert-heavy, the prefill-starved decode pod of bench/host_path.py): one new
request every S engine steps (counted by the loop, so old and new code see the same arrivals
whatever the machine's load) instead of one as soon as a slot frees, each of `--output` tokens
exactly (e.g. `--output 32 --arrive-every 4`: ~8 rows running); also reports the engine thread's
CPU per insert (in `EngineLoop._apply_inserts`: import, insert, bookkeeping) and the share of
generate calls that ran a single step while multi-step decode was on.
`--code DIR`: import decode_svc / tandem_engine from another tree (an old export, e.g.
/tmp/old-main) to compare back to back with this script's own measurements.
Timings are printed, never asserted.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--code" in sys.argv:  # before any import of the project: the other tree's code is measured
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve()))
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model", default="builtin")
    p.add_argument("--output", type=int, default=64, help="tokens per request: finished ones are replaced at once")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--max-len", type=int, default=1024, help="the engine's context (bench/host_path.py's)")
    p.add_argument("--steps-per-dispatch", type=int, default=None,
                   help="multi-step decode: steps per generate call (default: the engine's setting)")
    p.add_argument("--arrive-every", type=int, default=0,
                   help="insert-heavy: a new request every this many engine steps (0: refill at once)")
    p.add_argument("--code", default="", help="import the project from this tree (e.g. /tmp/old-main)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sort", default="tottime", help="cProfile order: tottime or cumulative")
    a = p.parse_args(argv)

    import redis.asyncio as aioredis
    from redis.asyncio.connection import Connection

    from decode_svc.bridge import Bridge
    from decode_svc.items import Insert
    from decode_svc.loop import EngineLoop
    from decode_svc.requests import RequestTable
    from tandem_core.bus import token_stream
    from tandem_core.keys import KeySpace
    from tandem_core.types import GenerationRequest, SamplingParams
    from tandem_engine import load_engine

    max_tokens = a.output
    engine = load_engine(a.model, slots=a.rows, max_len=max(a.max_len, a.prompt + a.output + 32), prefill_buckets=(a.prompt,),
                         cpu_threads=1)
    table = RequestTable(a.rows)
    bridge = Bridge(a.rows, 1 << 16)
    kw = {} if a.steps_per_dispatch is None else {"steps_per_dispatch": a.steps_per_dispatch}
    if kw:
        engine.steps_per_dispatch = a.steps_per_dispatch  # warmup compiles its variant
    loop = EngineLoop(engine, table, bridge, **kw)  # (an old tree's EngineLoop takes no steps_per_dispatch)
    t_proc = [0.0]
    t_gen = [0.0]
    t_ins = [0.0]
    single = [0]  # generate calls of one step
    inserted = [0]
    orig_process, orig_generate, orig_apply = loop._process, engine.generate, loop._apply_inserts

    profiling = threading.Event()  # set over the measured window: the engine thread profiles itself then
    prof_on = [False]

    def process(step, state):
        if prof is not None and profiling.is_set() != prof_on[0]:
            prof_on[0] = not prof_on[0]
            (prof.enable if prof_on[0] else prof.disable)()
        t = time.thread_time()
        try:
            return orig_process(step, state)
        finally:
            t_proc[0] += time.thread_time() - t

    def apply_inserts(state, block_s):
        t = time.thread_time()
        n = table.used
        try:
            return orig_apply(state, block_s)
        finally:
            t_ins[0] += time.thread_time() - t
            inserted[0] += table.used - n  # (a slot freed inside is freed by _process, not here)

    def generate(*args, **kw):
        single[0] += kw.get("steps", 1) == 1
        t = time.thread_time()
        try:
            return orig_generate(*args, **kw)
        finally:
            t_gen[0] += time.thread_time() - t

    loop._process = process  # type: ignore[method-assign]
    loop._apply_inserts = apply_inserts  # type: ignore[method-assign]
    engine.generate = generate  # type: ignore[method-assign]
    prof = cProfile.Profile(time.thread_time) if a.profile else None

    prompts = [[256] + [70 + (i * 7 + j) % 50 for j in range(a.prompt - 1)] for i in range(4)]
    prefixes = [engine.export_prefix(engine.prefill(pr, SamplingParams())) for pr in prompts]
    engine.warmup(prefill=False, logprobs=False)
    stop = threading.Event()

    def feeder() -> None:  # the claims loop's part: a new request as soon as a slot is free
        n = 0
        due = 0  # (--arrive-every) the loop's step count at which the next request arrives
        while not stop.is_set():
            if a.arrive_every and loop.stats.steps < due:
                time.sleep(0.0005)
                continue
            if table.reserve(1) == 0:
                time.sleep(0.0005)
                continue
            due += a.arrive_every
            rid = f"req-{n:06d}-{'x' * 24}"
            key = table.claim(rid)
            assert key is not None
            bridge.put_insert(Insert(prefixes[n % len(prefixes)],
                                     GenerationRequest(rid, prompts[n % len(prompts)],
                                                       max_tokens if a.arrive_every else max_tokens - 16 + n % 33,
                                                       SamplingParams(),
                                                       ignore_eos=True), key))
            n += 1

    feed = threading.Thread(target=feeder, daemon=True)
    feed.start()
    loop.start()
    while table.used < (1 if a.arrive_every else a.rows):
        time.sleep(0.01)
    clock = time.pthread_getcpuclockid(loop.thread.ident)  # type: ignore[arg-type]
    batches: list = []
    # skip the first steps (compiles, the pipeline filling)
    while loop.stats.steps < (5 + 2 * a.output if a.arrive_every else 5):  # (arrivals: to the steady state)
        time.sleep(0.01)
    while not bridge.outputs.empty():
        bridge.outputs.get_nowait()
    n0 = getattr(loop.stats, "calls", 0)
    s0, c0, p0, g0 = loop.stats.steps, time.clock_gettime(clock), t_proc[0], t_gen[0]
    i0, n1_0, ins0 = t_ins[0], single[0], inserted[0]
    w0 = time.perf_counter()
    profiling.set()
    want = a.steps - 20
    while loop.stats.steps - s0 < want:
        batches.append(bridge.outputs.get(timeout=60))
    s1, c1, p1, g1 = loop.stats.steps, time.clock_gettime(clock), t_proc[0], t_gen[0]
    i1, n1_1, ins1 = t_ins[0], single[0], inserted[0]
    wall = time.perf_counter() - w0
    calls = getattr(loop.stats, "calls", 0) - n0
    profiling.clear()
    stop.set()
    feed.join(10)
    loop.stop(30)
    assert loop.error is None, loop.error
    steps = s1 - s0
    tokens = sum(1 for b in batches for e in b if e.token >= 0)

    # the event loop's side, on the same batches
    r = aioredis.Redis()
    owned = token_stream.OwnedPublisher(r, KeySpace(shards=1), "decode-bench", 600, 10000, 60)
    conn = Connection()
    t = time.thread_time()
    for batch in batches:
        pipe = r.pipeline(transaction=False)
        placed = owned.add_batch(pipe, batch)
        conn.pack_commands([c[0] for c in pipe.command_stack])
        placed.results([[1] * len(pos) for pos in placed.calls])
        acks = [e.ack for e in batch if e.ack]
        for e in batch:
            if e.finish:
                pass
        del acks
    ev_tokens = sum(len(b) for b in batches)
    ev = time.thread_time() - t

    # and the same batches written to a real Redis through the publisher's one round trip per step
    # (`Publisher._execute_tokens`: add_batch, redis-py's packing, the send and the parsing of replies)
    import asyncio

    from tandem.redis_proc import RedisProcess
    red = RedisProcess().start()
    try:
        async def publish() -> float:
            rr = aioredis.from_url(red.url)
            pub = token_stream.OwnedPublisher(rr, KeySpace(shards=1), "decode-bench", 600, 10000, 60)
            await pub.load()
            rids = {e.request_id for b in batches for e in b}
            await rr.hset(pub.running_of(0).decode(), mapping={rid: "1" for rid in rids})
            t = time.thread_time()
            for batch in batches:
                pipe = rr.pipeline(transaction=False)
                placed = pub.add_batch(pipe, batch)
                placed.results(await pipe.execute())
            spent = time.thread_time() - t
            await rr.aclose()
            return spent
        ev_redis = asyncio.run(publish())
    finally:
        red.stop()

    us = 1e6
    print(f"rows {a.rows}, {steps} steps in {calls or steps} generate calls, {tokens} tokens, "
          f"wall {wall / steps * 1e3:.1f} ms/step")
    print(f"engine thread CPU : {(c1 - c0) / steps * 1e3:.3f} ms/step  {(c1 - c0) / tokens * us:.1f} us/token")
    print(f"  _process        : {(p1 - p0) / steps * 1e3:.3f} ms/step  {(p1 - p0) / tokens * us:.1f} us/token")
    print(f"  engine.generate : {(g1 - g0) / steps * 1e3:.3f} ms/step  {(g1 - g0) / tokens * us:.1f} us/token")
    inserts = ins1 - ins0
    print(f"  _apply_inserts  : {(i1 - i0) / steps * 1e3:.3f} ms/step  {(i1 - i0) / tokens * us:.1f} us/token  "
          f"{(i1 - i0) / max(1, inserts) * us:.0f} us/insert over {inserts} inserts "
          f"({tokens / steps:.1f} rows a step)")
    print(f"  single-step calls: {n1_1 - n1_0} of {calls or steps} "
          f"({(n1_1 - n1_0) / max(1, calls or steps):.0%}; multi-step K={engine.steps_per_dispatch})")
    rest = (c1 - c0) - (p1 - p0) - (g1 - g0) - (i1 - i0)
    print(f"  the rest        : {rest / steps * 1e3:.3f} ms/step  {rest / tokens * us:.1f} us/token")
    print(f"publisher (event loop) add_batch+pack: {ev / len(batches) * 1e3:.3f} ms/batch  "
          f"{ev / ev_tokens * us:.1f} us/token over {len(batches)} batches")
    print(f"publisher to Redis (client CPU): {ev_redis / len(batches) * 1e3:.3f} ms/batch  "
          f"{ev_redis / ev_tokens * us:.1f} us/token")
    if prof is not None:
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out).sort_stats(a.sort)
        st.print_stats(25)
        areas: dict[str, float] = {}
        for (file, _line, fn), (_cc, _nc, tt, _ct, callers) in st.stats.items():  # type: ignore[attr-defined]
            # a builtin (numpy, locks) is charged to the area of its first caller
            where = file if file != "~" else next(iter(callers), ("?",))[0]
            area = next((k for k in ("decode_svc", "tandem_engine", "jax", "numpy", "queue", "threading", "bench")
                         if f"/{k}/" in where or where.endswith(f"/{k}.py")), "other")
            areas[area] = areas.get(area, 0.0) + tt
        total = sum(areas.values())
        print("engine thread CPU by where the time was spent (profiled, the measured window):")
        for k, v in sorted(areas.items(), key=lambda kv: -kv[1]):
            print(f"  {k:14s} {v * 1e3:8.1f} ms  {v / total:5.1%}")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
