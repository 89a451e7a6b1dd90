"""The two roles of bench/token_plane.py, each run as its own process (multiprocessing, spawn):

* `publisher_main`: stands in for decode pods. Each of its `pods` owns `batch` slots; a slot runs
  requests one after another. A new request is owned first (`OwnedPublisher.own`: the HSET of the
  pod's running hash, as `decode_svc/claims.py` does for every request it takes), then every step writes
  one token per running request with ONE `OwnedPublisher.add_batch` per pod on a pipeline (the
  decode pod's fenced script: HEXISTS + XADD + EXPIRE per token, HDEL on the finish), the last
  token with finish `length`. Like the decode pod's cancel loop it MGETs its requests' cancel keys
  every `cancel_poll_s`. It records the monotonic time of each step's send.
* `gateway_main`: one `gateway.tokens.TokenMux` (the real gateway's token reader) and one relay task
  per request (`subscribe`, `get` until the finish entry), which records each entry's index, token
  and arrival time. It subscribes each slot's NEXT request too, before that request's first token,
  as the real gateway subscribes before it enqueues.

Request ids are `cmpl-` + 32 hex digits, like the gateway's, and encode (run, slot, generation), so
both sides derive the same ids, lengths and token values (`rid`, `length_of`, `token_of`) with no
coordination. Time is `time.monotonic()`: one clock for every process of a Linux machine.
Results go to `<out_dir>/<role><index>.npz`; control is a few shared Values.
Nothing here knows about windows, percentiles or reports (bench/token_plane_stats.py).
"""
from __future__ import annotations

import asyncio
import bisect
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.token_plane_stats import LAG_EDGES_MS

RUN, DRAIN, STOP = 0, 1, 2  # Control.phase: publish (new requests start), finish running ones, end


@dataclass
class PlaneConfig:
    redis_url: str
    out_dir: str
    run_id: int  # part of every request id: runs against one Redis never share a stream
    publishers: int = 1
    pods: int = 1  # decode pods per publisher process, each its own OwnedPublisher and pipeline
    batch: int = 16  # slots per pod
    tokens: int = 16  # tokens per request; 0: 8..16 chosen per request
    gateways: int = 1
    one_request_per_slot: bool = False  # the streams mode: every slot runs exactly one request
    idle_streams: int = 0  # the streams mode: more subscriptions whose stream no one writes (queued requests)
    stagger: bool = True  # slots start their first request spread over one request's length
    block_ms: int = 1000  # TokenMux XREAD BLOCK (the gateway's relay_block_ms default)
    max_connections: int = 64  # the gateway's Redis pool bound
    cancel_poll_s: float = 0.05  # the decode pod's cancel_poll_s (0: no cancel polls)
    ttl_s: int = 600  # decode defaults: token_ttl_s, token_maxlen, token_finished_ttl_s
    maxlen: int = 8192
    finished_ttl_s: int = 60
    prompt_len: int = 64  # prompt ids in each request's JSON (the running hash's value)
    shards: int = 1  # key shards (RedisConfig.shards: hash tags), where tandem_core.keys has them
    inject: str = ""  # a fault for the benchmark's own tests: "duplicate" or "gap" at index 2 of slot 0's first request

    @property
    def slots(self) -> int:
        return self.publishers * self.pods * self.batch

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def rid(run_id: int, slot: int, gen: int) -> str:
    return f"cmpl-{run_id & 0xFFFFFFFF:08x}{slot:012x}{gen:012x}"


def parse_rid(request_id: str) -> tuple[int, int, int]:
    h = request_id[5:]
    return int(h[:8], 16), int(h[8:20], 16), int(h[20:], 16)


def length_of(cfg: PlaneConfig, slot: int, gen: int) -> int:
    if cfg.tokens:
        return cfg.tokens
    return 8 + (slot * 2654435761 + gen * 40503) % 9  # 8..16, spread over slots


def token_of(slot: int, gen: int, index: int) -> int:
    """A token id (< 32,000, like a real vocabulary's) the gateway can check."""
    return (slot * 7919 + gen * 104729 + index * 31337) % 32000


def gateway_of(cfg: PlaneConfig, slot: int) -> int:
    return slot % cfg.gateways


class Control:
    """Shared between the controller and every role process (multiprocessing Values)."""

    def __init__(self, ctx, n_pub: int, n_gw: int) -> None:
        self.phase = ctx.Value("i", RUN)
        self.steps_per_s = ctx.Value("d", 0.0)  # 0: publishers wait; < 0: back to back
        self.started = [ctx.Value("q", 0) for _ in range(n_pub)]  # requests owned and begun
        self.finished = [ctx.Value("q", 0) for _ in range(n_pub)]  # finishes written
        self.written = [ctx.Value("q", 0) for _ in range(n_pub)]  # token entries written
        self.done = [ctx.Value("i", 0) for _ in range(n_pub)]  # drained: every begun request finished
        self.subscribed = [ctx.Value("q", 0) for _ in range(n_gw)]
        self.completed = [ctx.Value("q", 0) for _ in range(n_gw)]  # relays that saw their finish
        # live lag histogram per gateway (Redis entry id ms -> arrival), buckets LAG_EDGES_MS
        self.lag = [ctx.RawArray("q", len(LAG_EDGES_MS)) for _ in range(n_gw)]


def _loop_factory():
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:
        return None


def _setup(cfg: PlaneConfig, cpus: list[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def _key_space(cfg: PlaneConfig):
    """The key shards (hash tags) of the deployment this plane stands for."""
    from tandem_core.keys import KeySpace

    return KeySpace(cfg.shards)


# ---------------------------------------------------------------------------------------------
# publisher


def publisher_main(cfg_json: str, index: int, ctl: Control, cpus: list[int] | None = None) -> None:
    cfg = PlaneConfig(**json.loads(cfg_json))
    _setup(cfg, cpus)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_publish(cfg, index, ctl))


async def _publish(cfg: PlaneConfig, index: int, ctl: Control) -> None:
    import array

    import redis.asyncio as aioredis

    from tandem_core.bus import cancel
    from tandem_core.bus.token_stream import OwnedPublisher, TokenEntry
    from tandem_core.types import GenerationRequest

    r = aioredis.Redis.from_url(cfg.redis_url, max_connections=cfg.pods + 8, client_name=f"tp-pub{index}")
    ks = _key_space(cfg)
    pods = [OwnedPublisher(r, ks, f"tp{cfg.run_id:x}-decode-{index}-{k}", cfg.ttl_s, cfg.maxlen, cfg.finished_ttl_s)
            for k in range(cfg.pods)]
    await pods[0].load()
    first = index * cfg.pods * cfg.batch
    # per slot: [gen of its current (or last) request (-1: none yet), next index, length (0: idle),
    # the step its first request may begin at]
    state = []
    for k in range(cfg.pods):
        for s in range(cfg.batch):
            slot = first + k * cfg.batch + s
            begin = (s * length_of(cfg, slot, 0)) // cfg.batch if cfg.stagger else 0
            state.append([-1, 0, 0, begin])
    step_times = array.array("d")
    starts = array.array("q")  # (slot, gen, step of its index 0) triples
    fenced = 0
    prompt = list(range(3, 3 + cfg.prompt_len))
    next_cancel = time.monotonic()
    step = 0
    while ctl.steps_per_s.value == 0.0 and ctl.phase.value == RUN:
        await asyncio.sleep(0.005)
    next_t = time.monotonic()
    while ctl.phase.value != STOP:
        draining = ctl.phase.value == DRAIN
        batches: list[list] = [[] for _ in pods]
        for j, st in enumerate(state):
            k, slot = j // cfg.batch, first + j
            if st[1] >= st[2]:  # idle, or its request's finish went out last step: a new request
                if draining or step < st[3] or (cfg.one_request_per_slot and st[0] >= 0):
                    continue
                gen = st[0] + 1
                req = GenerationRequest(request_id=rid(cfg.run_id, slot, gen), prompt_ids=prompt,
                                        max_tokens=length_of(cfg, slot, gen), ignore_eos=True)
                await pods[k].own(req)
                st[0], st[1], st[2] = gen, 0, length_of(cfg, slot, gen)
                starts.extend((slot, gen, len(step_times)))
                ctl.started[index].value += 1
            gen, i = st[0], st[1]
            last = i == st[2] - 1
            item = TokenEntry(rid(cfg.run_id, slot, gen), i, token_of(slot, gen, i), "length" if last else None)
            faulty = cfg.inject and slot == 0 and gen == 0 and i == 2
            if not (faulty and cfg.inject == "gap"):
                batches[k].append(item)
            if faulty and cfg.inject == "duplicate":
                batches[k].append(item)
            st[1] += 1
        if not any(batches):
            if draining or cfg.one_request_per_slot and all(st[0] >= 0 for st in state):
                break
            await asyncio.sleep(0.002)
            step += 1
            continue
        t_send = time.monotonic()
        step_times.append(t_send)
        replies = await asyncio.gather(*(_write(r, pod, items) for pod, items in zip(pods, batches) if items))
        for flags in replies:
            fenced += sum(1 for f in flags if f != 1)
        ctl.finished[index].value += sum(1 for items in batches for it in items if it.finish)
        ctl.written[index].value += sum(len(items) for items in batches)
        step += 1
        if cfg.cancel_poll_s and t_send >= next_cancel:  # the decode pod's cancel loop
            next_cancel = t_send + cfg.cancel_poll_s
            running = [rid(cfg.run_id, first + j, st[0]) for j, st in enumerate(state) if st[1] < st[2]]
            if running:
                await cancel.cancelled(r, ks, running)
        rate = ctl.steps_per_s.value
        if rate > 0:
            next_t = max(next_t + 1.0 / rate, time.monotonic() - 1.0 / rate)  # no catch-up burst
            delay = next_t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        else:
            await asyncio.sleep(0)
    ctl.done[index].value = 1
    _save(cfg, f"publisher{index}", step_times=np.frombuffer(step_times, dtype=np.float64),
          starts=np.frombuffer(starts, dtype=np.int64).reshape(-1, 3), fenced=np.int64(fenced))
    await r.aclose()


async def _write(r, pod, items: list) -> list:
    pipe = r.pipeline(transaction=False)
    pod.add_batch(pipe, items)
    replies = await pipe.execute()
    # add_batch queues one script call per pod today; if it ever splits a batch (per shard), each
    # reply is a list of flags in item order
    return [f for rep in replies for f in (rep if isinstance(rep, list) else [rep])]


# ---------------------------------------------------------------------------------------------
# gateway


def gateway_main(cfg_json: str, index: int, ctl: Control, cpus: list[int] | None = None) -> None:
    cfg = PlaneConfig(**json.loads(cfg_json))
    _setup(cfg, cpus)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_relay_all(cfg, index, ctl))


async def _relay_all(cfg: PlaneConfig, index: int, ctl: Control) -> None:
    import array

    import redis.asyncio as aioredis

    from gateway.tokens import TokenMux

    lag, edges = ctl.lag[index], LAG_EDGES_MS.tolist()
    r = aioredis.Redis.from_url(cfg.redis_url, max_connections=cfg.max_connections, client_name=f"tp-gw{index}",
                                socket_timeout=10.0)
    xreads = _count_xreads(r)
    mux = TokenMux(r, _key_space(cfg), block_ms=cfg.block_ms)
    mux.start()
    records: dict[tuple[int, int], tuple] = {}  # (slot, gen) -> index, token, finish, arrival arrays
    tasks: set[asyncio.Task] = set()
    cpu0 = time.process_time()

    def relay(slot: int, gen: int) -> None:
        t = asyncio.get_running_loop().create_task(_relay_one(slot, gen))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def _relay_one(slot: int, gen: int) -> None:
        sub = mux.subscribe(rid(cfg.run_id, slot, gen))
        ctl.subscribed[index].value += 1
        idx, tok, fin, arr = array.array("i"), array.array("i"), array.array("b"), array.array("d")
        records[(slot, gen)] = (idx, tok, fin, arr)
        try:
            while True:
                events = await sub.get(cfg.block_ms / 1000)  # as gateway/relay.py: relay_block_ms
                now = time.monotonic()
                now_ms = time.time() * 1000.0
                for e in events:
                    idx.append(e.index)
                    tok.append(e.token_id)
                    fin.append(1 if e.finish_reason else 0)
                    arr.append(now)
                    lag[bisect.bisect_left(edges, now_ms - int(e.entry_id[:e.entry_id.index(b"-")]))] += 1
                if events and events[-1].finish_reason:
                    ctl.completed[index].value += 1
                    if not cfg.one_request_per_slot and ctl.phase.value == RUN:
                        relay(slot, gen + 2)  # the one after next: subscribed before its first token
                    return
                if ctl.phase.value == STOP:
                    return
        finally:
            mux.unsubscribe(sub)

    for slot in range(cfg.slots + cfg.idle_streams):  # slots past cfg.slots: no publisher writes them
        if gateway_of(cfg, slot) == index:
            relay(slot, 0)
            if not cfg.one_request_per_slot:
                relay(slot, 1)
    while ctl.phase.value != STOP:
        await asyncio.sleep(0.05)
    await asyncio.gather(*list(tasks), return_exceptions=True)
    cpu_s = time.process_time() - cpu0
    await mux.stop()
    keys = sorted(records)
    cols = [np.concatenate([np.frombuffer(records[k][c], dtype=dt) for k in keys]) if keys else np.zeros(0, dt)
            for c, dt in enumerate((np.int32, np.int32, np.int8, np.float64))]
    _save(cfg, f"gateway{index}", req=np.array(keys, dtype=np.int64).reshape(-1, 2),
          counts=np.array([len(records[k][0]) for k in keys], dtype=np.int64),
          index=cols[0], token=cols[1], finish=cols[2], arrival=cols[3],
          reads=np.int64(mux.reads), cpu_s=np.float64(cpu_s), xread_calls=np.int64(xreads["calls"]),
          xread_keys=np.int64(xreads["keys"]), xread_entries=np.int64(xreads["entries"]),
          xread_bytes=np.int64(xreads["bytes"]))
    await r.aclose()


def _count_xreads(r) -> dict:
    """Count the XREADs the token reader sends through `r`, the keys they name and the entries
    they return (a bench-side wrapper of the client's method; the reader itself is untouched)."""
    counts = {"calls": 0, "keys": 0, "entries": 0, "bytes": 0}
    orig = r.xread

    async def xread(streams, *args, **kw):
        counts["calls"] += 1
        counts["keys"] += len(streams)
        # the command's size on the wire: RESP bulk strings for every key and id ($len\r\n...\r\n)
        counts["bytes"] += sum(len(k) + len(i if isinstance(i, (str, bytes)) else str(i)) + 12
                               for k, i in streams.items()) + 40
        resp = await orig(streams, *args, **kw)
        counts["entries"] += sum(len(e) for _, e in resp or [])
        return resp

    r.xread = xread
    return counts


def _save(cfg: PlaneConfig, name: str, **arrays) -> None:
    path = Path(cfg.out_dir) / f"{name}.npz"
    tmp = Path(cfg.out_dir) / f"{name}.tmp.npz"
    np.savez(tmp, **arrays)
    tmp.replace(path)
