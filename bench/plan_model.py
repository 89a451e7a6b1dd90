"""A discrete-event model of Tandem's request path, on a capacity profile (planner/profile.py).

    arrival -> admission queue (one, shared, FIFO) -> a free prefill pod, busy prefill_seconds(prompt)
            -> ready queue (FIFO, in prefill-completion order) -> a decode pod with a free slot
            -> hand-off (handoff_s; the slot is reserved meanwhile) -> the pod's batch
            -> one token per step (`tokens_per_step` with speculative decoding), the step
               lasting decode_itl(batch) -> finished

A decode pod is simulated event by event, not step by step: between two of its events (a join or
a finish) every request in its batch advances at 1 / decode_itl(batch) steps a second. The pod
keeps a step counter S (real-valued) and each request the S at which it finishes, in a heap, so
each request costs a few heap operations however long its output. Time is continuous: a request
joining mid-step starts stepping at once (the real pod inserts between steps: at most one step
sooner than the real one).

Where the first token comes from (`SimConfig.first_token`):
  * "prefill" (default): the prefill pod's token 0 (what Tandem does: the prefill pod publishes
    the first token, and the planner's TTFT budget is the prefill pod's), so TTFT = queue +
    prefill and the first gap holds the ready wait and the hand-off; the decode pod makes
    `output - 1` tokens;
  * "decode": the first decode step after the join, so TTFT = queue + prefill + ready wait +
    hand-off + one step; the decode pod makes all `output` tokens.
A request's mean ITL is (finish - first token) / (output - 1).

Decode pods with a free slot read the ready queue in turn, one request each (Redis hands entries to
blocked readers in the order they blocked; a pod with slots left reads again, at the back).

KV (`SimConfig.kv`, a planner/kv.py KVCapacity: every decode pod's): a pod runs at most its rows
(and never more than the profile's slots: past them there is no step time). On a paged pool a
request is charged, from its hand-off to its finish, the blocks of its mean footprint, prompt +
output / 2 positions plus the reserve (`KVCapacity.blocks_for`): the mean of what a real pod holds
for it, without simulating its growth and the hand-backs that meet growth past the reserve. A pod
reads the ready queue while it has free blocks and takes the head request only if its charge fits
(an empty pod always takes one, as decode_svc/blocks.py's claim rule); otherwise it waits for one
of its requests to finish. The policies see the capacity in their snapshot (`Snapshot.kv`), as the
planner reads it from the pods' heartbeats. None (the default): rows = the profile's slots, no
block pool, no capacity in the snapshot: the model as before.

Pods start `startup_s` after they are asked for (0 for the ones a run starts with). Scale-down
cancels pods still starting first (newest first), then drains the least busy: a draining pod takes
no new work and leaves when its work is done; a prefill pod's work includes the prefilled results
it holds until a decode pod has pulled them. Nothing is ever dropped. Pod-hours count from the
ask to the exit. Policies (bench/plan_policies.py) are asked every `period_s` for the replicas of
each role, with a `Snapshot` of what the cluster saw since their last tick.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from bench.plan_trace import Trace
from planner.kv import KVCapacity
from planner.profile import Profile

ROLES = ("prefill", "decode")
PREFILL_DONE, HANDOFF_DONE, DECODE_NEXT, POD_READY, TICK, SAMPLE = range(6)
STARTING, ACTIVE, DRAINING, GONE = range(4)


@dataclass(frozen=True)
class SimConfig:
    startup_s: float = 60.0  # ask -> ready (a TPU pod: schedule, pull, load weights, compile)
    first_token: str = "prefill"  # or "decode": see the module's docstring
    prefill_hold: int = 0  # a prefill pod takes no prompt while it holds this many unpulled results (0: no bound)
    sample_s: float = 60.0  # the replica time series' step
    horizon_s: float = 6 * 3600.0  # stop this long after the last arrival even if requests remain
    kv: KVCapacity | None = None  # every decode pod's KV (see the module's docstring); None: the profile's slots
    # tokens a running request gains per decode step on average: 1 without speculative decoding,
    # its mean accepted length with it (decode_svc/speculate.py; a step's time stays decode_itl(batch))
    tokens_per_step: float = 1.0

    def __post_init__(self) -> None:
        if self.first_token not in ("decode", "prefill"):
            raise ValueError(f"first_token: want 'decode' or 'prefill', got {self.first_token!r}")
        if self.tokens_per_step < 1.0:
            raise ValueError(f"tokens_per_step: a step emits at least one token a row, got {self.tokens_per_step}")


@dataclass
class Snapshot:
    """What a policy sees at its tick: the interval's counters and the cluster's state now."""

    t: float
    interval_s: float
    arrivals: int = 0
    prompt_sum: float = 0.0
    finished: int = 0
    output_sum: float = 0.0
    ttft_sum: float = 0.0
    ttft_n: int = 0
    gap_sum: float = 0.0  # the finished requests' gaps between tokens: their sum and count (the
    gap_n: int = 0  # gateway's tandem_itl_seconds mean)
    prefilled: int = 0  # prompts prefilled, and the seconds the pods were busy with them
    prefill_busy_s: float = 0.0
    decoded: float = 0.0  # tokens the decode pods made
    admission: int = 0  # prompts waiting for a prefill pod
    prefilling: int = 0  # prompts in prefill now
    ready: int = 0  # prefilled requests waiting for a decode slot
    decoding: int = 0  # requests in decode slots (hand-offs included)
    current: dict = field(default_factory=dict)  # replicas asked for (starting + active), per role
    ready_pods: dict = field(default_factory=dict)  # pods serving, per role
    kv: KVCapacity | None = None  # the serving decode pods' KV, as their heartbeats would say (None: not modelled, or none serving)


class Pod:
    __slots__ = ("role", "id", "state", "t_request", "t_ready", "t_exit", "busy", "held", "idle",
                 "batch", "reserved", "S", "t_last", "itl", "heap", "version", "reading", "blocks")

    def __init__(self, role: str, pid: int, t: float) -> None:
        self.role, self.id, self.state = role, pid, STARTING
        self.t_request, self.t_ready, self.t_exit = t, math.nan, math.nan
        self.busy, self.held, self.idle = -1, 0, False  # prefill: the prompt in prefill, results held
        self.batch, self.reserved, self.S, self.t_last, self.itl = 0, 0, 0.0, t, 0.0  # decode
        self.heap: list = []
        self.version, self.reading = 0, False  # decode: waiting on the ready queue (has a free slot)
        self.blocks = 0  # decode, paged KV: blocks charged to its requests (hand-offs included)

    def work(self) -> int:
        return (self.busy >= 0) + self.held + self.batch + self.reserved


@dataclass
class SimResult:
    policy: str
    arrival: np.ndarray
    ttft: np.ndarray  # seconds, per request (NaN: unfinished)
    itl: np.ndarray  # mean gap, per request (NaN: one token, or unfinished)
    finish: np.ndarray
    pods: list  # (role, t_request, t_ready, t_exit)
    scale_events: list  # (t, role, from, to)
    series: dict  # t, admission, ready_queue, want_<role>, ready_<role>, alive_<role>
    end_s: float
    wall_s: float
    events: int
    unfinished: int = 0
    log: list = field(default_factory=list)  # the policy's own record (decisions, notes)

    def pod_hours(self, role: str) -> float:
        return sum(e - s for r, s, _, e in self.pods if r == role) / 3600.0


class Cluster:
    """One run of one policy over one trace. `run()` returns a SimResult."""

    def __init__(self, trace: Trace, profile: Profile, policy, cfg: SimConfig = SimConfig()) -> None:
        self.trace, self.profile, self.policy, self.cfg = trace, profile, policy, cfg
        self.prompt, self.output = trace.prompt.tolist(), trace.output.tolist()
        n = len(trace)
        self.first_tok = [math.nan] * n
        self.finish_t = [math.nan] * n
        self.itl = [math.nan] * n
        self.steps = [o - 1 if cfg.first_token == "prefill" else o for o in self.output]
        self.slots, self.handoff = profile.slots, profile.handoff_s
        kv = self.kv = cfg.kv
        self.need: list[int] | None = None  # paged: each request's blocks (its mean footprint + reserve)
        if kv is not None:
            self.slots = min(profile.slots, kv.rows)
            if kv.layout == "paged":
                self.need = [kv.blocks_for(p + o / 2) for p, o in zip(self.prompt, self.output)]
        self.itl_tab = [profile.decode_itl(max(1, b)) for b in range(profile.slots + 1)]
        self._pre: dict[int, float] = {}
        self.heap: list = []
        self.seq = 0
        self.admission: deque = deque()
        self.ready: deque = deque()
        self.idle: list[Pod] = []  # prefill pods free to take a prompt
        self.readers: deque = deque()  # decode pods with a free slot, in the order they asked
        self.pods: dict[str, list[Pod]] = {r: [] for r in ROLES}  # every pod of the run
        self.live: dict[str, list[Pod]] = {r: [] for r in ROLES}  # not gone (pruned at ticks)
        self.active: dict[str, list[Pod]] = {r: [] for r in ROLES}
        self.scale_events: list = []
        self.series: dict[str, list] = {k: [] for k in ("t", "admission", "ready_queue",
                                                        *(f"{w}_{r}" for w in ("want", "ready", "alive") for r in ROLES))}
        self.done = 0
        self.last_t = 0.0
        self.win = Snapshot(0.0, 0.0)
        self.win_start = 0.0
        self.arrival = trace.t.tolist()
        self.n_events = 0

    # -- the event queue -------------------------------------------------------------------
    def push(self, t: float, kind: int, a, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def prefill_s(self, tokens: int) -> float:
        s = self._pre.get(tokens)
        if s is None:
            s = self._pre[tokens] = self.profile.prefill_seconds(tokens)
        return s

    # -- pods --------------------------------------------------------------------------------
    def add_pod(self, role: str, t: float, ready_now: bool = False) -> None:
        pod = Pod(role, len(self.pods[role]), t)
        self.pods[role].append(pod)
        self.live[role].append(pod)
        if ready_now:
            self.pod_ready(t, pod)
        else:
            self.push(t + self.cfg.startup_s, POD_READY, pod)

    def pod_ready(self, t: float, pod: Pod) -> None:
        if pod.state != STARTING:
            return  # cancelled while starting
        pod.state, pod.t_ready, pod.t_last = ACTIVE, t, t
        self.active[pod.role].append(pod)
        if pod.role == "prefill":
            self.make_idle(pod)
            self.dispatch_prefill(t)
        else:
            self.offer(pod)
            self.dispatch_decode(t)

    def make_idle(self, pod: Pod) -> None:
        hold = self.cfg.prefill_hold
        if pod.state == ACTIVE and pod.busy < 0 and not pod.idle and (hold <= 0 or pod.held < hold):
            pod.idle = True
            self.idle.append(pod)

    def offer(self, pod: Pod) -> None:
        """A decode pod with a free slot reads the ready queue (XREADGROUP): it joins the readers."""
        if pod.state == ACTIVE and not pod.reading and pod.batch + pod.reserved < self.slots and self.blocks_left(pod):
            pod.reading = True
            self.readers.append(pod)

    def blocks_left(self, pod: Pod) -> bool:
        return self.need is None or self.kv is None or pod.blocks < self.kv.blocks_total

    def leave_if_done(self, t: float, pod: Pod) -> None:
        if pod.state == DRAINING and pod.work() == 0:
            pod.state, pod.t_exit = GONE, t

    def set_replicas(self, role: str, n: int, t: float) -> None:
        live = [p for p in self.live[role] if p.state in (STARTING, ACTIVE)]
        cur = len(live)
        if n == cur:
            return
        self.scale_events.append((t, role, cur, n))
        if n > cur:
            for _ in range(n - cur):
                self.add_pod(role, t)
            return
        k = cur - n
        starting = [p for p in reversed(live) if p.state == STARTING][:k]
        for p in starting:
            p.state, p.t_exit = GONE, t
        actives = sorted((p for p in live if p.state == ACTIVE), key=Pod.work)[: k - len(starting)]
        for p in actives:
            p.state = DRAINING
            self.active[role].remove(p)
            if p.idle:
                p.idle = False
                self.idle.remove(p)
            self.leave_if_done(t, p)

    # -- the request path ------------------------------------------------------------------
    def arrive(self, r: int, t: float) -> None:
        self.win.arrivals += 1
        self.win.prompt_sum += self.prompt[r]
        self.admission.append(r)
        if self.idle:
            self.dispatch_prefill(t)

    def dispatch_prefill(self, t: float) -> None:
        while self.admission and self.idle:
            pod = self.idle.pop()
            pod.idle = False
            r = self.admission.popleft()
            pod.busy = r
            self.push(t + self.prefill_s(self.prompt[r]), PREFILL_DONE, pod, r)

    def prefill_done(self, t: float, pod: Pod, r: int) -> None:
        pod.busy = -1
        self.win.prefilled += 1
        self.win.prefill_busy_s += self.prefill_s(self.prompt[r])
        if self.cfg.first_token == "prefill":
            self.first_token(r, t)
        if self.steps[r] <= 0:
            self.finished(r, t)
        else:
            pod.held += 1
            self.ready.append((r, pod))
        self.make_idle(pod)
        self.leave_if_done(t, pod)
        self.dispatch_prefill(t)
        self.dispatch_decode(t)

    def dispatch_decode(self, t: float) -> None:
        """Ready requests to the decode pods reading, one each in turn (Redis serves blocked
        readers in the order they blocked; a pod with slots left reads again, at the back)."""
        ready, readers, slots, need = self.ready, self.readers, self.slots, self.need
        total = self.kv.blocks_total if self.kv is not None else 0
        while ready and readers:
            p = readers.popleft()
            if p.state != ACTIVE or p.batch + p.reserved >= slots:
                p.reading = False
                continue
            if need is not None:
                r = ready[0][0]
                if p.batch + p.reserved > 0 and p.blocks + need[r] > total:
                    p.reading = False  # it reads again when one of its requests finishes
                    continue
                p.blocks += need[r]
            p.reserved += 1
            self.push(t + self.handoff, HANDOFF_DONE, p, ready.popleft())
            if p.batch + p.reserved < slots and self.blocks_left(p):
                readers.append(p)
            else:
                p.reading = False

    def handoff_done(self, t: float, pod: Pod, item: tuple) -> None:
        r, source = item
        source.held -= 1
        self.make_idle(source)
        self.leave_if_done(t, source)
        self.advance(pod, t)
        pod.reserved -= 1
        pod.batch += 1
        heapq.heappush(pod.heap, (pod.S + self.steps[r] / self.cfg.tokens_per_step, r))
        if self.cfg.first_token == "decode":
            self.first_token(r, t + self.itl_tab[pod.batch])
        self.reschedule(pod, t)
        if self.admission and self.idle:
            self.dispatch_prefill(t)

    def advance(self, pod: Pod, t: float) -> None:
        if pod.batch:
            steps = (t - pod.t_last) / pod.itl
            pod.S += steps
            self.win.decoded += steps * pod.batch * self.cfg.tokens_per_step
        pod.t_last = t

    def reschedule(self, pod: Pod, t: float) -> None:
        pod.version += 1
        if pod.batch:
            pod.itl = self.itl_tab[pod.batch]
            self.push(t + max(0.0, (pod.heap[0][0] - pod.S) * pod.itl), DECODE_NEXT, pod, pod.version)

    def decode_next(self, t: float, pod: Pod, version: int) -> None:
        if version != pod.version:
            return  # the batch changed since this finish was planned
        self.advance(pod, t)
        h = pod.heap
        while h and h[0][0] <= pod.S + 1e-6:
            _, r = heapq.heappop(h)
            pod.batch -= 1
            if self.need is not None:
                pod.blocks -= self.need[r]
            self.finished(r, t)
        self.reschedule(pod, t)
        self.offer(pod)
        self.dispatch_decode(t)
        self.leave_if_done(t, pod)

    def first_token(self, r: int, t: float) -> None:
        self.first_tok[r] = t
        self.win.ttft_sum += t - self.arrival[r]
        self.win.ttft_n += 1

    def finished(self, r: int, t: float) -> None:
        if not math.isnan(self.finish_t[r]):
            raise AssertionError(f"request {r} finished twice ({self.finish_t[r]} and {t})")
        self.finish_t[r] = t
        self.done += 1
        self.last_t = t
        w = self.win
        w.finished += 1
        w.output_sum += self.output[r]
        if self.output[r] > 1:
            self.itl[r] = (t - self.first_tok[r]) / (self.output[r] - 1)
            w.gap_sum += t - self.first_tok[r]
            w.gap_n += self.output[r] - 1

    # -- policy and sampling ---------------------------------------------------------------
    def snapshot(self, t: float) -> Snapshot:
        s = self.win
        s.t, s.interval_s = t, t - self.win_start
        s.admission, s.ready = len(self.admission), len(self.ready)
        for r in ROLES:
            self.live[r] = [p for p in self.live[r] if p.state != GONE]
        s.prefilling = sum(1 for p in self.live["prefill"] if p.busy >= 0)
        s.decoding = sum(p.batch + p.reserved for p in self.live["decode"])
        s.current = {r: sum(1 for p in self.live[r] if p.state in (STARTING, ACTIVE)) for r in ROLES}
        s.ready_pods = {r: len(self.active[r]) for r in ROLES}
        s.kv = self.kv_seen()
        self.win, self.win_start = Snapshot(0.0, 0.0), t
        return s

    def kv_seen(self) -> KVCapacity | None:
        """The serving decode pods' KV as their heartbeats say it (planner/kv.py): the configured
        capacity with the pods' mean share in use now; None when not modelled or no pod serves."""
        kv, pods = self.kv, self.active["decode"]
        if kv is None or not pods:
            return None
        if self.need is not None:
            used = sum(p.blocks for p in pods) / (kv.blocks_total * len(pods))
        else:
            used = sum(p.batch + p.reserved for p in pods) / (self.slots * len(pods))
        return dataclasses.replace(kv, used=used, pods=len(pods))

    def tick(self, t: float) -> None:
        want = self.policy.decide(t, self.snapshot(t))
        for role, n in (want or {}).items():
            self.set_replicas(role, int(n), t)
        self.push(t + self.policy.period_s, TICK, None)

    def sample(self, t: float) -> None:
        s = self.series
        s["t"].append(t)
        s["admission"].append(len(self.admission))
        s["ready_queue"].append(len(self.ready))
        for r in ROLES:
            self.live[r] = live = [p for p in self.live[r] if p.state != GONE]
            s[f"want_{r}"].append(sum(1 for p in live if p.state in (STARTING, ACTIVE)))
            s[f"ready_{r}"].append(len(self.active[r]))
            s[f"alive_{r}"].append(len(live))
        self.push(t + self.cfg.sample_s, SAMPLE, None)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        t0 = time.perf_counter()
        for role, n in self.policy.initial().items():
            for _ in range(int(n)):
                self.add_pod(role, 0.0, ready_now=True)
        if self.policy.period_s > 0:
            self.push(self.policy.period_s, TICK, None)
        self.sample(0.0)
        arrivals, n = self.arrival, len(self.arrival)
        stop_at = (arrivals[-1] if n else 0.0) + self.cfg.horizon_s
        handlers = {PREFILL_DONE: self.prefill_done, HANDOFF_DONE: self.handoff_done, DECODE_NEXT: self.decode_next}
        i, heap, t = 0, self.heap, 0.0
        while self.done < n:
            if i < n and (not heap or arrivals[i] < heap[0][0]):
                t = arrivals[i]
                self.arrive(i, t)
                i += 1
                continue
            t, _, kind, a, b = heapq.heappop(heap)
            if t > stop_at:
                break
            self.n_events += 1
            if kind in handlers:
                handlers[kind](t, a, b)
            elif kind == POD_READY:
                self.pod_ready(t, a)
            elif kind == TICK:
                self.tick(t)
            else:
                self.sample(t)
        return self.result(max(self.last_t, self.trace.duration_s), time.perf_counter() - t0)

    def result(self, end: float, wall: float) -> SimResult:
        arrival = self.trace.t
        first = np.asarray(self.first_tok)
        pods = [(p.role, p.t_request, p.t_ready, p.t_exit if not math.isnan(p.t_exit) else end)
                for r in ROLES for p in self.pods[r]]
        return SimResult(getattr(self.policy, "name", type(self.policy).__name__), arrival, first - arrival,
                         np.asarray(self.itl), np.asarray(self.finish_t), pods, self.scale_events,
                         {k: np.asarray(v) for k, v in self.series.items()}, end, wall, self.n_events,
                         unfinished=len(arrival) - self.done, log=list(getattr(self.policy, "log", [])))


def simulate(trace: Trace, profile: Profile, policy, cfg: SimConfig = SimConfig()) -> SimResult:
    return Cluster(trace, profile, policy, cfg).run()
