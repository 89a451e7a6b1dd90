"""Capacity profile: what one prefill pod and one decode pod can do, measured, for the planner.

    python bench/capacity.py [--quick] [--model builtin] [--slots 8] [--out PATH]

Loads the model with the engine settings the pods get by default from `tandem local` (one XLA CPU
thread, max_len 512, prefill buckets 16..512, float32) and measures, on this machine:

  * prefill: for every bucket, the seconds one prompt of that many tokens takes on a prefill pod:
    `Engine.prefill` (blocks on the first token) and `export_prefix` (the KV to host memory, which
    the pod does for every prompt); bench/engine.py's `bench_prefill`. --reps rounds over all the
    buckets after a compiling round; the median.
  * decode: for batch = 1..slots (or --batches), the step time (= the gap between a request's
    tokens) on an engine with `slots` slots of which the lowest `batch` hold a request, stepped
    over the slots in use as the decode pod steps them (`generate(state, rows=batch)`, so batch 3
    of 8 runs the 4-row step) in the pipelined loop (step n+1 dispatched before step n's tokens
    are copied and book-kept; bench/engine.py's `run_steps`). --rounds rounds over all the
    batches after a compiling round; in each, fresh 64-token prompts, one untimed step, --steps
    timed ones; the median round.
  Rounds go over every point in turn, so a burst of other work on a shared machine lands on all
  the points a little instead of on one a lot.
  * handoff: per bucket, the pull of one prompt's KV bytes over loopback gRPC (the real
    `KVTransferServicer` + `KVStore` in a child process, the real `KVPuller` here:
    bench/kv_transfer.py's `measure`) plus `import_prefix` + `insert` of that KV into a decode
    slot. `handoff_s` is the sum at --handoff-tokens (default: the largest bucket, the dearest).
    Not measured: the ready-notice claim (one Redis round trip on the decode pod).

Writes the profile (format `tandem-capacity-profile/v1`, read by planner/profile.py) to --out,
loads it back with `planner.profile.load_profile` to check it, and writes the `capacity` section of
bench/RESULTS.md with the points and the per-pod capacities they imply. The machine's 1-minute
load average at the start and the end goes into both: on a shared machine the numbers are only
as good as the quiet they were measured in. On a TPU node pool run the same script in the worker
image on the pool's node with the real model, dtype and slots (docs/planner.md). Progress goes to
stderr; stdout gets the RESULTS section.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_info, machine_line, write_section
from planner.profile import BUILTIN_PROFILE, load_profile

SECTION = "capacity"
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)  # tandem/local.py's, cut at --max-len
from bench.capacity_doc import (  # noqa: F401 - the document half, re-exported
    CLAIM_NOTE, CapacityError, build_profile, capacity_rows, dumps, handoff_total, load_line, report,
)



# ---------------------------------------------------------------------------------------------
# measuring


@dataclass(frozen=True)
class Plan:
    prefill_reps: int
    decode_rounds: int
    decode_steps: int
    handoff_reps: int


# A full run of the built-in model takes about 2 minutes on 2 shared cores; prefill repetitions are
# cheap (15 of the 512-token prompt: ~2 s) and short prompts are the noisiest, so there are many.
QUICK = Plan(prefill_reps=5, decode_rounds=3, decode_steps=8, handoff_reps=3)
FULL = Plan(prefill_reps=15, decode_rounds=7, decode_steps=32, handoff_reps=5)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _PrefillPod:
    """`bench_prefill`'s view of the engine as a prefill pod uses it: prefill, then the KV to the host."""

    def __init__(self, engine):
        self.engine, self.info = engine, engine.info

    def prefill(self, ids, sampling):
        prefix = self.engine.prefill(ids, sampling)
        self.engine.export_prefix(prefix)
        return prefix


class _Batch:
    """`run_steps`' view of the engine with its lowest `batch` slots in use: it steps over them as
    the decode pod does (`generate(state, rows=batch)`: the smallest batch bucket >= batch)."""

    def __init__(self, engine, batch: int):
        self.engine, self.rows = engine, batch

    def generate(self, state):
        return self.engine.generate(state, self.rows)


def measure_prefill(engine, buckets, plan: Plan) -> dict[int, float]:
    """{bucket: median seconds of one prompt}. The repetitions go round every bucket (each round
    one `bench_prefill` per bucket: an untimed run, then a timed one), so a burst of other work on
    a shared machine touches every bucket a little rather than one a lot; round 0 compiles and
    is not counted."""
    from bench.engine import bench_prefill

    pod = _PrefillPod(engine)
    samples: dict[int, list[float]] = {n: [] for n in buckets}
    for r in range(plan.prefill_reps + 1):
        for n in buckets:
            t = bench_prefill(pod, n, 1)
            if r:
                samples[n].append(t)
    out = {n: statistics.median(v) for n, v in samples.items()}
    for n, v in samples.items():
        say(f"  prefill {n:4d} tokens: {out[n] * 1e3:8.2f} ms (runs {min(v) * 1e3:.2f}..{max(v) * 1e3:.2f} ms)")
    return out


def occupy(engine, state, prefix, batch: int, used: int):
    """`state` with slots [0, batch) holding `prefix` afresh (positions back at its length) and
    the slots [batch, used) that held one before freed."""
    from tandem_core.types import SamplingParams

    for slot in range(batch):
        state = engine.insert(prefix, state, slot, SamplingParams())
    for slot in range(batch, used):
        state = engine.free(state, slot)
    return state


def measure_decode(engine, plan: Plan, batches) -> tuple[dict[int, float], int]:
    """{batch: median step seconds}, and the mean context (positions per slot) of the timed steps.
    One DecodeState; each round goes over every batch: the lowest `batch` slots get a fresh
    PROMPT_LEN-token prompt, one untimed step, then `decode_steps` timed ones; round 0 compiles
    every step bucket and is not counted."""
    import numpy as np

    from bench.engine import PROMPT_LEN, run_steps
    from tandem_core.types import SamplingParams

    if PROMPT_LEN + 1 + plan.decode_steps >= engine.max_len:
        raise CapacityError(f"{plan.decode_steps} decode steps after a {PROMPT_LEN}-token prompt do not fit "
                            f"max_len {engine.max_len} (fewer --steps)")
    ids = np.random.default_rng(0).integers(3, engine.info.vocab_size, PROMPT_LEN).tolist()
    prefix = engine.prefill(ids, SamplingParams())
    state, used = engine.init_state(), 0
    samples: dict[int, list[float]] = {b: [] for b in batches}
    for r in range(plan.decode_rounds + 1):
        for b in batches:
            state, used = occupy(engine, state, prefix, b, used), b
            view = _Batch(engine, b)
            state, _ = run_steps(view, state, 1, "pipelined")  # blocks: the inserts are done
            state, per_step = run_steps(view, state, plan.decode_steps, "pipelined")
            if r:
                samples[b].append(per_step)
    del state
    out = {b: statistics.median(v) for b, v in samples.items()}
    for b, v in samples.items():
        say(f"  decode batch {b:3d} (step rows {engine.rows_for(b)}): {out[b] * 1e3:7.3f} ms/step, "
            f"{b / out[b]:8.1f} tokens/s (rounds {min(v) * 1e3:.3f}..{max(v) * 1e3:.3f} ms)")
    return out, PROMPT_LEN + 1 + plan.decode_steps // 2


def measure_insert(engine, buckets, reps: int) -> tuple[dict[int, float], dict[int, int]]:
    """{bucket: median seconds of import_prefix + insert into a decode slot}, {bucket: KV bytes}."""
    import jax
    import numpy as np

    from tandem_core.types import SamplingParams

    state = engine.init_state()
    times, nbytes = {}, {}
    for n in buckets:
        ids = np.random.default_rng(n).integers(3, engine.info.vocab_size, n).tolist()
        payload = engine.export_prefix(engine.prefill(ids, SamplingParams()))
        nbytes[n] = payload.nbytes
        got = []
        for i in range(reps + 1):  # the first compiles this bucket's insert
            t0 = time.perf_counter()
            state = engine.insert(engine.import_prefix(payload), state, 0, SamplingParams())
            jax.block_until_ready(state)
            if i:
                got.append(time.perf_counter() - t0)
        times[n] = statistics.median(got)
    return times, nbytes


def measure_pull(nbytes: dict[int, int], reps: int) -> dict[int, float]:
    """{bucket: median seconds of one gRPC KV pull of that many bytes} (bench/kv_transfer.py)."""
    from bench import kv_transfer

    with contextlib.redirect_stdout(sys.stderr):  # its per-size progress lines
        rows = asyncio.run(kv_transfer.measure(sorted(set(nbytes.values())), reps))
    by_size = {r["bytes"]: r["grpc_s"] for r in rows}
    out = {}
    for n, size in nbytes.items():
        got = by_size.get(size)
        if got is None:  # kv_transfer rounds a payload to whole positions of its own layout
            got = min(by_size.items(), key=lambda kv: abs(kv[0] - size))[1]
        out[n] = got
    return out


def read_prefill_from(path: str, model: str) -> dict:
    """The prefill points of another profile of the same model, and where they came from:
    {"points": {tokens: seconds}, "path", "machine", "created", "command"}."""
    prof = load_profile(path)
    doc = json.loads(Path(path).read_text())
    if prof.model != model:
        raise CapacityError(f"--prefill-from {path}: its model is {prof.model!r}, this run measures {model!r}")
    return {"points": dict(prof.prefill_points), "path": str(path), "machine": doc.get("machine", ""),
            "created": doc.get("created", ""), "command": doc.get("command", ""), "engine": doc.get("engine", {})}


def effective_cpu_threads(wanted: int, jax_platforms: str) -> int:
    """`wanted`, or 0 (leave XLA's CPU pool alone) where JAX_PLATFORMS leaves the CPU backend out:
    limiting the pool starts that backend, which such an image does not allow."""
    names = {p.strip() for p in jax_platforms.split(",") if p.strip()}
    return wanted if not names or "cpu" in names else 0


def pull_reps(reps: int, sizes) -> int:
    """The fewest timed pulls of a size in bench/kv_transfer.py's `measure` (at least 9 below 64 MiB)."""
    return reps if max(sizes) >= 64 << 20 else max(reps, 9)


def parse_batches(spec: str, slots: int) -> tuple[int, ...]:
    if not spec:
        return tuple(range(1, slots + 1))
    try:
        got = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise CapacityError(f"--batches {spec!r}: want comma-separated integers, e.g. 1,2,4,8") from None
    if not got or got[0] < 1 or got[-1] > slots:
        raise CapacityError(f"--batches {spec!r}: want integers in 1..slots ({slots})")
    return tuple(got)


def parse_buckets(spec: str, max_len: int) -> tuple[int, ...]:
    if not spec:
        return tuple(b for b in DEFAULT_BUCKETS if b <= max_len) or (max_len,)
    try:
        got = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise CapacityError(f"--buckets {spec!r}: want comma-separated integers, e.g. 16,64,256") from None
    if not got or got[0] < 1 or got[-1] > max_len:
        raise CapacityError(f"--buckets {spec!r}: want integers in 1..max_len ({max_len})")
    return tuple(got)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python bench/capacity.py",
        description="Measure a capacity profile (prefill seconds per prompt length, decode step time per "
        "batch, KV hand-off time) for the planner, write it as JSON, and write the capacity section of "
        "bench/RESULTS.md. Defaults: the engine settings of a `tandem local` pod (one XLA CPU thread, "
        "max_len 512, buckets 16..512, float32). On a TPU pool, run it on the pool's node in the worker "
        "image with the served model, dtype, tp and slots (docs/planner.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="builtin", help="preset name (builtin, tiny, small-100m) or a Hugging Face "
                   "Llama directory: the model the pods serve")
    p.add_argument("--slots", type=int, default=8, help="decode slots per decode pod (decode points for batch 1..slots)")
    p.add_argument("--batches", default="", help="decode batches to measure, comma-separated (default: every "
                   "batch 1..slots; the planner interpolates between the ones measured)")
    p.add_argument("--max-len", type=int, default=512, help="positions per sequence (the pods' engine.max_len)")
    p.add_argument("--buckets", default="", help="prefill buckets, comma-separated (default: 16..512 cut at "
                   "--max-len, as tandem local sets them)")
    p.add_argument("--dtype", default="float32", help="the pods' engine.dtype (bfloat16 on TPU)")
    p.add_argument("--tp", type=int, default=1, help="the pods' engine.tp (chips per pod; 0: all local chips)")
    p.add_argument("--cpu-threads", type=int, default=1, help="XLA CPU compute threads (the pods' "
                   "engine.cpu_threads; 0: one per core). Taken as 0 when JAX_PLATFORMS names no cpu (a TPU image)")
    p.add_argument("--out", default="", help="where to write the profile JSON (default: planner/profiles/"
                   "builtin-cpu.json in this checkout, the profile shipped for the built-in model)")
    p.add_argument("--quick", action="store_true", help=f"a short run: {QUICK.prefill_reps} prefill repetitions, "
                   f"{QUICK.decode_rounds} decode rounds of {QUICK.decode_steps} steps, {QUICK.handoff_reps} "
                   "hand-off repetitions")
    p.add_argument("--reps", type=int, default=0, help="timed prefill runs per bucket "
                   f"(default {FULL.prefill_reps}; {QUICK.prefill_reps} with --quick)")
    p.add_argument("--rounds", type=int, default=0, help="decode rounds per batch "
                   f"(default {FULL.decode_rounds}; {QUICK.decode_rounds} with --quick)")
    p.add_argument("--steps", type=int, default=0, help="decode steps per round "
                   f"(default {FULL.decode_steps}; {QUICK.decode_steps} with --quick)")
    p.add_argument("--prefill-from", default="", metavar="PROFILE",
                   help="take the prefill points from this profile (measured on the prefill pool's node) "
                   "instead of measuring them here: for prefill and decode pools on different hardware")
    p.add_argument("--no-handoff", action="store_true", help="skip the hand-off measurement (handoff_s 0)")
    p.add_argument("--handoff-tokens", type=int, default=0, help="the prompt length whose KV pull + insert "
                   "becomes handoff_s (default: the largest bucket)")
    p.add_argument("--no-write", action="store_true", help="leave bench/RESULTS.md alone (the profile is still written)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parser().parse_args(argv)
    base = QUICK if a.quick else FULL
    plan = Plan(a.reps or base.prefill_reps, a.rounds or base.decode_rounds, a.steps or base.decode_steps,
                base.handoff_reps)
    if a.slots < 1:
        raise SystemExit("--slots: want an integer >= 1")
    try:
        buckets = parse_buckets(a.buckets, a.max_len)
        batches = parse_batches(a.batches, a.slots)
    except CapacityError as e:
        raise SystemExit(str(e)) from None
    handoff_tokens = a.handoff_tokens or buckets[-1]
    if not a.no_handoff and handoff_tokens not in buckets:
        raise SystemExit(f"--handoff-tokens {handoff_tokens}: not one of the buckets {list(buckets)}")
    if not a.out and a.model != "builtin":
        raise SystemExit(f"--out: required for --model {a.model} (the default, planner/profiles/"
                         f"{BUILTIN_PROFILE.name}, is the built-in model's shipped profile)")
    out = Path(a.out).resolve() if a.out else ROOT / "planner" / "profiles" / BUILTIN_PROFILE.name
    prefill_from = None
    if a.prefill_from:
        try:
            prefill_from = read_prefill_from(a.prefill_from, a.model)
        except (CapacityError, ValueError) as e:
            raise SystemExit(str(e)) from None
    machine = machine_info()
    load_start = machine.get("load_avg_1m")
    command = "python bench/capacity.py" + ("" if not argv else " " + shlex.join(argv))
    t_start = time.perf_counter()

    from tandem_engine import load_engine  # starts the backend: cpu_threads first

    cpu_threads = effective_cpu_threads(a.cpu_threads, os.environ.get("JAX_PLATFORMS", ""))

    say(f"loading {a.model} (slots {a.slots}, max_len {a.max_len}, buckets {list(buckets)}, dtype {a.dtype}, "
        f"tp {a.tp}, cpu_threads {cpu_threads}); {machine_line(machine)}")
    engine = load_engine(a.model, slots=a.slots, max_len=a.max_len, prefill_buckets=buckets, dtype=a.dtype,
                         tp=a.tp, cpu_threads=cpu_threads)
    machine_text = f"{machine_line(machine)}; {_devices()}"
    if prefill_from is None:
        say("prefill (one prompt per call, prefill + KV export):")
        prefill = measure_prefill(engine, buckets, plan)
    else:
        prefill = prefill_from.pop("points")
        say(f"prefill: {len(prefill)} points from {a.prefill_from} ({prefill_from['machine']})")
    say("decode (pipelined loop over the slots in use):")
    decode, context = measure_decode(engine, plan, batches)
    handoff_s, detail = 0.0, None
    if not a.no_handoff:
        say("hand-off (import + insert, then the gRPC KV pull):")
        insert_reps = max(plan.handoff_reps, 5)
        insert_s, nbytes = measure_insert(engine, buckets, insert_reps)
        pull_s = measure_pull(nbytes, plan.handoff_reps)
        handoff_s = handoff_total(pull_s, insert_s, handoff_tokens)
        detail = {"tokens": handoff_tokens, "note": CLAIM_NOTE, "insert_reps": insert_reps,
                  "pull_reps": pull_reps(plan.handoff_reps, nbytes.values()),
                  "points": [{"tokens": n, "kv_bytes": nbytes[n], "pull_s": round(pull_s[n], 7),
                              "insert_s": round(insert_s[n], 7)} for n in buckets]}
        for p in detail["points"]:
            say(f"  {p['tokens']:4d} tokens, {p['kv_bytes'] / 1024:7.0f} KiB: pull {p['pull_s'] * 1e3:6.2f} ms, "
                f"import + insert {p['insert_s'] * 1e3:6.2f} ms")
    load_end = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    info = engine.info
    extra = {
        "engine": {"model_name": info.name, "params": info.num_params, "dtype": a.dtype, "tp": engine.tp,
                   "cpu_threads": cpu_threads, "max_len": a.max_len, "prefill_buckets": list(buckets),
                   "backend": _backend()},
        "load_avg_1m": {"start": load_start, "end": load_end},
        "method": {"prefill_reps": plan.prefill_reps, "decode_rounds": plan.decode_rounds,
                   "decode_steps": plan.decode_steps, "prompt_tokens": _prompt_len(), "context": context,
                   "batch_buckets": list(engine.batch_buckets), "statistic": "median",
                   "seconds": round(time.perf_counter() - t_start, 1), "out": _shown(out)},
    }
    if detail:
        extra["handoff_detail"] = detail
    if prefill_from is not None:
        extra["prefill_from"] = prefill_from
    doc = build_profile(model=a.model, machine=machine_text, command=command, prefill=prefill,
                        decode=decode, slots=a.slots, handoff_s=handoff_s, extra=extra)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(doc))
    prof = load_profile(out)  # the planner's reader accepts it, or this exits non-zero
    say(f"wrote {out} ({len(prof.prefill_points)} prefill points, {len(prof.decode_points)} decode points, "
        f"handoff {prof.handoff_s * 1e3:.2f} ms) in {extra['method']['seconds']:.0f}s; {load_line(load_start, load_end)}")
    md = report(doc, machine.get("nproc"))
    print(md)
    if not a.no_write:
        write_section(SECTION, md)
    return 0


def _backend() -> str:
    import jax

    return jax.default_backend()


def _devices() -> str:
    """The accelerator the engine ran on, e.g. "JAX tpu: 4 x TPU v6 lite"."""
    import jax

    devs = jax.devices()
    return f"JAX {jax.default_backend()}: {len(devs)} x {devs[0].device_kind}"


def _prompt_len() -> int:
    from bench.engine import PROMPT_LEN

    return PROMPT_LEN


def _shown(p: Path) -> str:
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


if __name__ == "__main__":
    raise SystemExit(main())
