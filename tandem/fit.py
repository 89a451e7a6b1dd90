"""`tandem fit`: will this model, at these slots and this context, fit a TPU slice, and how fast
will it decode? Answered by the TPU compiler on this machine, no TPU and no weights needed.

It compiles the engine's real steps (tandem_engine/aot.py) for the slice's chips with the real
shardings: the decode step at `slots` rows, the insert of the longest prefill bucket, the prefill
of the longest bucket (every bucket with --all-buckets). Per chip it reports the weights and KV
Tandem places there, the compiler's arguments, temporaries and peak, whether that fits the chip's
HBM with headroom left for the runtime, and the compiler's cost of one decode step (flops, bytes
accessed; the layer loop counted L times) turned into a step time on the chip's roofline, the
decode tokens/s per chip at that batch, and the host budget: the microseconds of host CPU per
token the decode pod may spend before the chip waits for it.

Needs the `tpu` extra (libtpu). Example:
  tandem fit tools/fit_configs/llama-3.1-8b --tpu v6e --topology 2x2 --tp 4 --slots 64 --max-len 2048
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GiB = 1 << 30


@dataclass(frozen=True)
class Chip:
    """One TPU chip as its vendor publishes it."""

    name: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    topologies: tuple[str, ...]  # single-host slices (GKE tpu-topology values)
    source: str


# Google Cloud's TPU system-architecture pages (per chip), read 2026-12.
CHIPS: dict[str, Chip] = {
    "v5e": Chip("TPU v5e", 16 * GiB, 819e9, 197e12, ("1x1", "2x2", "2x4"),
                "cloud.google.com/tpu/docs/v5e: 16 GiB HBM2, 819 GB/s, 197 TFLOP/s bf16"),
    "v6e": Chip("TPU v6e (Trillium)", 32 * GiB, 1640e9, 918e12, ("1x1", "2x2", "2x4"),
                "cloud.google.com/tpu/docs/v6e: 32 GiB HBM, 1,640 GB/s, 918 TFLOP/s bf16"),
    "v5p": Chip("TPU v5p", 95 * GiB, 2765e9, 459e12, ("2x2x1",),
                "cloud.google.com/tpu/docs/v5p: 95 GiB HBM2e, 2,765 GB/s, 459 TFLOP/s bf16"),
}

# What a decode pod's host spends per token today, measured: its Python threads (event loop,
# engine thread, executors; per-thread CPU from /proc over 128 requests at 32 streams, the built-in
# model on 2 CPUs) spent 132-203 us of CPU per output token in three runs (issue 29's measurement;
# the token publishing alone is 14 us of it, bench/RESULTS.md's token plane). The budget below is
# set against the middle of that range.
MEASURED_HOST_US_PER_TOKEN = 170.0

# Read rates for a cold start's load (bytes per second into the host, one single-host slice reading
# the whole checkpoint once). ASSUMED, not measured here and not looked up per machine type: the
# chart's three documented weight sources at round figures. Hyperdisk ML volumes provision up to
# 1,200,000 MiB/s (cloud.google.com/compute/docs/disks/hd-types/hyperdisk-ml), but what one VM
# reads is capped by its machine type's limit, which was not looked up; Cloud Storage FUSE with
# parallel downloads (cloud.google.com/storage/docs/gcsfuse-performance) depends on the NIC and the
# file sizes. Replace with `bench/load.py`'s raw read rate on the node before relying on a figure.
READ_RATES: dict[str, float] = {"local SSD": 2.0e9, "Hyperdisk ML": 1.5e9, "GCS FUSE": 1.0e9}


def chips_in(topology: str) -> int:
    return math.prod(int(x) for x in topology.split("x"))


def load_info(model: str):
    """A preset, a HF directory, or a bare config.json (copied into a temporary directory)."""
    from tandem_core.models import resolve_model

    p = Path(model)
    if p.is_file() and p.suffix == ".json":
        tmp = Path(tempfile.mkdtemp(prefix="tandem-fit-"))
        (tmp / "config.json").write_text(p.read_text())
        return resolve_model(str(tmp))
    return resolve_model(model)


def _describe(tpu: str, topology: str):
    """Compile-only devices for the slice. libtpu describes slices of whole hosts only (4 chips
    on v5e/v6e), so a 1x1 slice is one chip of a 2x2 description: per-chip figures are the same."""
    from tandem_engine.aot import topology_devices

    n = chips_in(topology)
    if n < 4 and tpu in ("v5e", "v6e"):
        return topology_devices(tpu, "2x2")[:n]
    return topology_devices(tpu, topology)


def fit(model: str, *, tpu: str, topology: str | None = None, tp: int | None = None, slots: int = 8,
        max_len: int = 2048, buckets: tuple[int, ...] = (), dtype: str = "bfloat16", headroom: float = 0.1,
        position: int | None = None, all_buckets: bool = False, cost: bool = True,
        prefill_cost: bool = False, force: bool = False, profile_small: bool = False,
        expert_parallel: bool = False) -> dict:
    """The sizing report as a dict (see `format_report`). When the weights and KV Tandem places on
    a chip already exceed its usable HBM, nothing is compiled (`compiled: False`) unless `force`."""
    import jax
    import numpy as np

    from tandem_engine import aot

    if tpu not in CHIPS:
        raise ValueError(f"unknown TPU type {tpu!r}; known: {', '.join(CHIPS)}")
    chip = CHIPS[tpu]
    info = load_info(model)
    if topology is None:
        need = tp or 1
        topology = next((t for t in chip.topologies if chips_in(t) >= need), chip.topologies[-1])
    n_chips = chips_in(topology)
    tp = n_chips if tp is None else tp
    if tp > n_chips:
        raise ValueError(f"tp={tp} needs {tp} chips; {tpu} {topology} has {n_chips}")
    buckets = tuple(sorted(b for b in (buckets or (16, 32, 64, 128, 256, 512, max_len)) if b <= max_len))
    position = max_len if position is None else min(position, max_len)
    devices = _describe(tpu, topology)

    t0 = time.perf_counter()
    comp = aot.Compiler(info, devices, tp=tp, slots=slots, max_len=max_len, prefill_buckets=buckets, dtype=dtype,
                        expert_parallel=expert_parallel)
    eng = comp.engine
    state = aot.abstract_state(eng)
    weights = aot.shard_bytes(eng.params)
    kv = aot.shard_bytes((state.k, state.v))
    other_state = aot.shard_bytes(state) - kv

    usable = chip.hbm_bytes * (1 - headroom)
    base = {
        "model": info.name, "params": sum(int(np.prod(s.shape, dtype=np.int64)) for s in jax.tree.leaves(eng.params)), "tpu": tpu, "chip": chip.name, "topology": topology,
        "chips": n_chips, "tp": tp, "expert_parallel": expert_parallel, "slots": slots, "max_len": max_len, "dtype": dtype,
        "prefill_buckets": list(eng.buckets), "hbm_per_chip": chip.hbm_bytes, "headroom": headroom,
        "usable_per_chip": usable, "chip_source": chip.source,
        "per_chip": {"weights": weights, "kv": kv, "decode_state_other": other_state},
    }
    if weights + kv > usable and not force:
        # what Tandem places on each chip is already too much: no compile can make it fit
        return {**base, "compiled": False,
                "decode_pod": {"peak": weights + kv + other_state, "fits": False, "steps": []},
                "prefill_pod": {"peak": weights, "fits": weights <= usable, "steps": []},
                "compile_s": time.perf_counter() - t0}

    try:  # memory first (the engine's own compiles), then the cost compiles
        decode = comp.generate(slots, layers=False)
        insert = comp.insert(eng.buckets[-1])
        pre_buckets = eng.buckets if all_buckets else eng.buckets[-1:]
        prefills = [comp.prefill(b, layers=False) for b in pre_buckets]
    except aot.DoesNotFit as e:
        # the compiler's own verdict: this step cannot be laid out in the chip's HBM
        pod = "prefill_pod" if e.step.startswith("prefill") else "decode_pod"
        other = "decode_pod" if pod == "prefill_pod" else "prefill_pod"
        return {**base, "compiled": False, "compiler_refused": {"step": e.step, "message": e.message},
                pod: {"peak": None, "fits": False, "steps": []},
                other: {"peak": None, "fits": None, "steps": []},
                "compile_s": time.perf_counter() - t0}
    sampling = None
    if cost:
        comp.count_layers(decode, "generate", slots)
        sampling = comp.sampling(slots)
    if prefill_cost:
        comp.count_layers(prefills[-1], "prefill", pre_buckets[-1])
    decode_peak = max(decode.peak_bytes, insert.peak_bytes)
    prefill_peak = max(p.peak_bytes for p in prefills)

    report = {**base, "compiled": True,
        "decode_pod": {"peak": decode_peak, "fits": decode_peak <= usable, "steps": [asdict(decode), asdict(insert)]},
        "prefill_pod": {"peak": prefill_peak, "fits": prefill_peak <= usable, "steps": [asdict(p) for p in prefills]},
        "compile_s": time.perf_counter() - t0,
    }
    report["cold_start"] = cold_start(base["params"], dtype, report["compile_s"])
    if cost:
        report["decode"] = decode_projection(decode, info, eng, chip, slots=slots, position=position,
                                             weights=weights, kv=kv, tp=tp, sampling=sampling)
    if cost and profile_small:
        rows = eng.batch_buckets[0]
        if rows < slots:
            step = comp.generate(rows)
            report["decode_small"] = {"rows": rows, **decode_projection(
                step, info, eng, chip, slots=rows, position=position, weights=weights, kv=kv, tp=tp,
                sampling=comp.sampling(rows))}
    if prefill_cost:
        p = prefills[-1]
        secs = max(p.total_flops / chip.bf16_flops_per_s, p.total_bytes / chip.hbm_bytes_per_s)
        report["prefill"] = {"bucket": eng.buckets[-1], "flops": p.total_flops, "bytes": p.total_bytes,
                             "step_s": secs, "tokens_per_s_per_chip": eng.buckets[-1] / secs / tp}
    return report


def cold_start(params: int, dtype: str, compile_s: float, rates: dict[str, float] = READ_RATES) -> dict:
    """A pod's cold start: the checkpoint's bytes (every parameter in `dtype`; a checkpoint stored
    narrower, gpt-oss's MXFP4 experts, reads fewer) read once at each of `rates`, plus
    `compile_s` (measured here with a cold compilation cache on this machine: an upper bound for a
    pod whose cache is warm)."""
    item = 2 if dtype == "bfloat16" else 4
    nbytes = params * item
    return {"checkpoint_bytes": nbytes, "load_s": {k: nbytes / r for k, r in rates.items()},
            "read_rates": dict(rates), "compile_s": compile_s}


def attention_reads(eng, *, slots: int, position: int, tp: int) -> dict:
    """What one decode step's attention does that the cost compiles do not count, per chip: every
    row at `position` reads the blocks holding positions [0, position] (a windowed layer only the
    blocks its window reaches), K and V, each layer, and scores and weighs them (two dots per
    position and head). The cost compiles (aot.Compiler.count_layers) run over a pool of one
    block per row, and count: nothing of the Pallas kernel's reads (the compiler does not see into
    a Mosaic call); on the gather path, one piece of attention.READ_CHUNK positions a layer (a loop
    body is counted once), which is taken off here."""
    from tandem_engine.attention import READ_CHUNK, step_kernel

    c = eng.cfg
    bs = eng.kv_block_size
    kernel = step_kernel(c, eng._kv_jdtype, bs) is not None
    counted = 0 if kernel else READ_CHUNK
    item = 2 if eng.kv_dtype == "bfloat16" else 1 if eng.kv_dtype == "fp8" else 4
    kv_local, h_local = c.num_kv_heads // tp, c.num_heads // tp
    pos = min(int(position), eng.max_len - 1)
    read = extra = 0
    for i in range(c.num_layers):
        w = c.window(i)
        first = max(0, pos - w + 1) // bs * bs if w else 0  # the first block the window reaches
        n = -(-(pos + 1) // bs) * bs - first  # whole blocks
        if not kernel:  # whole pieces of READ_CHUNK positions
            n = -(-n // READ_CHUNK) * READ_CHUNK
        read += n
        extra += max(0, n - counted)
    per_position = 2 * slots * kv_local * c.head_dim * item  # K and V of one position, every row
    return {"path": "pallas kernel" if kernel else "gather", "positions_read": read,
            "bytes": extra * per_position, "flops": extra * 2 * 2 * slots * h_local * c.head_dim,
            "kv_bytes_read": read * per_position}


def decode_projection(step, info, eng, chip: Chip, *, slots: int, position: int, weights: int, kv: int,
                      tp: int, sampling=None) -> dict:
    """One decode step at `slots` rows with every row at `position`: the compiler's flops and
    bytes (layers counted L times, over a pool of one block per row) plus the attention's reads of
    the KV at `position` (`attention_reads`), then `roofline`. `kv`: the pool a chip holds (not
    read whole: the floor counts the KV in use)."""
    att = attention_reads(eng, slots=slots, position=position, tp=tp)
    raw = {
        "position": position, "attention": att["path"],
        "flops": step.total_flops + att["flops"], "bytes": step.total_bytes + att["bytes"],
        "floor_bytes": weights + min(kv, att["kv_bytes_read"]),
        "layer_flops": step.layer_flops, "layer_bytes": step.layer_bytes,
        "outside_layers_flops": step.flops, "outside_layers_bytes": step.bytes_accessed,
        "sampling_flops": None if sampling is None else sampling.flops,
        "sampling_bytes": None if sampling is None else sampling.bytes_accessed,
    }
    return {**raw, **roofline(raw, chip, slots=slots, tp=tp)}


def roofline(raw: dict, chip: Chip, *, slots: int, tp: int) -> dict:
    """Step times from a step's counts on the chip's roofline (the larger of bytes / bandwidth and
    flops / peak): the **floor** (every weight and the KV in use read once), **greedy** (the
    compiler's count less the sampler's, never below the floor: where the compiler's bytes cannot
    be told apart from the floor's, `bytes_below_floor` says so and the floor stands in) and
    **sampled** (greedy plus the sampler: a batch with any slot at temperature > 0). Tokens/s per
    chip = slots / step / tp; the host budget = step / slots."""
    bw, peak = chip.hbm_bytes_per_s, chip.bf16_flops_per_s
    s_flops, s_bytes = raw.get("sampling_flops") or 0.0, raw.get("sampling_bytes") or 0.0
    g_bytes_compiler = raw["bytes"] - s_bytes
    g_flops = max(0.0, raw["flops"] - s_flops)
    g_bytes = max(g_bytes_compiler, raw["floor_bytes"])
    floor_s = raw["floor_bytes"] / bw
    g_s = max(g_flops / peak, g_bytes / bw)
    step_s = max(raw["flops"] / peak, (g_bytes + s_bytes) / bw)
    budget_us = step_s / slots * 1e6
    return {
        "step_s": step_s, "bound": "memory" if (g_bytes + s_bytes) / bw >= raw["flops"] / peak else "compute",
        "tokens_per_s_per_chip": slots / step_s / tp,
        "greedy_step_s": g_s, "greedy_tokens_per_s_per_chip": slots / g_s / tp,
        "greedy_host_budget_us_per_token": g_s / slots * 1e6,
        "floor_step_s": floor_s, "floor_tokens_per_s_per_chip": slots / floor_s / tp,
        "bytes_below_floor": g_bytes_compiler < raw["floor_bytes"],
        "host_budget_us_per_token": budget_us,
        "host_measured_us_per_token": MEASURED_HOST_US_PER_TOKEN,
        "host_keeps_up": budget_us >= MEASURED_HOST_US_PER_TOKEN,
    }


def projected_profile(r: dict, small: dict | None) -> dict:
    """A starting capacity profile for the planner (planner/profile.py's format), labelled
    projected: decode step times at the smallest batch bucket and at `slots` from the compiler's
    cost (a straight line between, as the step's bytes and flops grow with the rows), prefill
    times from the largest bucket's projected time scaled by tokens (compute-bound). The planner's
    live correction (planner/correct.py) then scales it to what the pods measure."""
    d, pf = r["decode"], r.get("prefill")
    if pf is None:
        raise ValueError("a profile needs the prefill's cost: add --prefill-cost")
    points = [{"batch": r["slots"], "itl_s": round(d["step_s"], 7)}]
    if small is not None and small["rows"] < r["slots"]:
        points.insert(0, {"batch": small["rows"], "itl_s": round(small["step_s"], 7)})
    per_token = pf["step_s"] / pf["bucket"]
    prefill = [{"tokens": b, "seconds": round(max(per_token * b, 1e-6), 7)} for b in r["prefill_buckets"]]
    return {
        "format": "tandem-capacity-profile/v1", "model": r["model"], "projected": True,
        "machine": f"projected by tandem fit for {r['chip']} {r['topology']}, tp={r['tp']} (no TPU measured)",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "tandem fit ... --prefill-cost --profile",
        "prefill": {"points": prefill},
        "decode": {"slots": r["slots"], "points": points},
        "handoff_s": 0.0,
        # the planner's scale-up lead time: the load from Hyperdisk ML plus the compile as measured
        # by tandem fit (cold cache: a pod with a warm compilation cache starts sooner)
        **({"cold_start_s": round(r["cold_start"]["load_s"]["Hyperdisk ML"] + r["cold_start"]["compile_s"], 1)}
           if r.get("cold_start") else {}),
        "engine": {"model_name": r["model"], "params": r["params"], "dtype": r["dtype"], "tp": r["tp"],
                   "max_len": r["max_len"], "prefill_buckets": r["prefill_buckets"], "backend": f"tpu {r['tpu']}"},
        "note": ("projected from the TPU compiler's cost analysis on a roofline (HBM bandwidth, peak bf16 "
                 "flops), decode at every slot's position " + str(d["position"]) + "; the KV handoff is "
                 "not projected (0); replace with bench/capacity.py on the pods when they run"),
    }


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 4 else f"{n / 2**20:.1f} MiB"


def format_report(r: dict) -> str:
    pc = r["per_chip"]
    lines = [
        f"{r['model']} ({r['params'] / 1e9:.2f}B params, {r['dtype']}) on {r['chip']} {r['topology']} "
        f"({r['chips']} chips), tp={r['tp']}, {r['slots']} slots x {r['max_len']} positions",
        f"  HBM per chip {_gib(r['hbm_per_chip'])}, usable {_gib(r['usable_per_chip'])} "
        f"({r['headroom']:.0%} kept for the runtime)   [{r['chip_source']}]",
        f"  per chip (Tandem's layout): weights {_gib(pc['weights'])}, KV cache {_gib(pc['kv'])}, "
        f"other decode state {_gib(pc['decode_state_other'])}",
    ]
    refused = r.get("compiler_refused")
    if refused:
        lines.append(f"  DOES NOT FIT: the TPU compiler refused {refused['step']}: {refused['message']}")
    elif not r.get("compiled", True):
        lines.append(f"  DOES NOT FIT: weights + KV per chip {_gib(pc['weights'] + pc['kv'])} exceed the usable "
                     f"{_gib(r['usable_per_chip'])} before any temporaries (not compiled; --force compiles anyway)")
    for pod in ("decode_pod", "prefill_pod"):
        p = r[pod]
        if p["peak"] is None:
            continue
        lines.append(f"  {pod.replace('_', ' ')}: peak {_gib(p['peak'])} per chip -> "
                     f"{'FITS' if p['fits'] else 'DOES NOT FIT'} "
                     f"({_gib(r['usable_per_chip'] - p['peak'])} left)")
        for s in p["steps"]:
            lines.append(f"    {s['name']:<14} compiled in {s['compile_s']:.1f} s: arguments "
                         f"{_gib(s['argument_bytes'])}, temporaries {_gib(s['temp_bytes'])}, outputs "
                         f"{_gib(s['output_bytes'])} ({_gib(s['alias_bytes'])} donated)")
    d = r.get("decode")
    if d:
        lines += [
            f"  decode step at {r['slots']} rows, every slot at position {d['position']}: "
            f"{d['flops'] / 1e9:.1f} GFLOP, {d['bytes'] / GiB:.2f} GiB accessed per chip "
            f"(layers {d['layer_bytes'] * 1.0 / 2**20:.0f} MiB each; outside them "
            f"{d['outside_layers_bytes'] / 2**20:.0f} MiB) -> {d['step_s'] * 1e3:.2f} ms ({d['bound']}-bound)",
            *([f"  of which the sampler (temperature > 0 in the batch): {d['sampling_bytes'] / GiB:.2f} GiB"]
              if d.get("sampling_bytes") else []),
            *(["  the compiler's bytes less the sampler's fall below the floor: the layer loop's bytes could not "
               "be told apart (the 2-layer compile counted no more bytes than the 1-layer one), so the floor stands in"]
              if d["bytes_below_floor"] else []),
            f"  an all-greedy batch: {d['greedy_step_s'] * 1e3:.2f} ms, {d['greedy_tokens_per_s_per_chip']:.0f} tok/s "
            f"per chip",
            f"  projected decode, sampled: {d['tokens_per_s_per_chip']:.0f} tok/s per chip "
            f"({d['tokens_per_s_per_chip'] * r['tp']:.0f} per pod); roofline floor (weights + KV in use "
            f"read once): {d['floor_step_s'] * 1e3:.2f} ms, {d['floor_tokens_per_s_per_chip']:.0f} tok/s per chip",
            f"  host budget: {d['host_budget_us_per_token']:.1f} us of host CPU per token before the chip "
            f"waits (measured today: {d['host_measured_us_per_token']:.0f} us per token, the decode pod's "
            f"Python threads at 32 streams) -> {'keeps up' if d['host_keeps_up'] else 'THE HOST IS THE BOTTLENECK'}",
        ]
    cs = r.get("cold_start")
    if cs:
        loads = ", ".join(f"{k} {v:.0f} s ({cs['read_rates'][k] / 1e9:.1f} GB/s, assumed)" for k, v in cs["load_s"].items())
        lines.append(f"  cold start: load {cs['checkpoint_bytes'] / 1e9:.1f} GB at {loads}; plus the compile "
                     f"({cs['compile_s']:.0f} s here, cold cache)")
    pf = r.get("prefill")
    if pf:
        lines.append(f"  prefill of {pf['bucket']} tokens: {pf['flops'] / 1e12:.2f} TFLOP per chip -> "
                     f"{pf['step_s'] * 1e3:.1f} ms, {pf['tokens_per_s_per_chip']:.0f} prompt tok/s per chip")
    lines.append(f"  compiled in {r['compile_s']:.1f} s on this machine")
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tandem fit",
        description="Compile Tandem's serving steps for a TPU slice (no TPU needed: libtpu, the tpu extra) "
                    "and report HBM per chip, whether it fits, and the projected decode speed.")
    ap.add_argument("model", help="preset name, Hugging Face directory, or a config.json")
    ap.add_argument("--tpu", required=True, choices=sorted(CHIPS))
    ap.add_argument("--topology", help="e.g. 2x2 (default: the smallest single-host slice with tp chips)")
    ap.add_argument("--tp", type=int, help="tensor parallelism (default: every chip of the topology)")
    ap.add_argument("--ep", action="store_true", help="mixture of experts: split whole experts across the tp chips "
                    "(expert parallelism) instead of each expert's hidden units")
    ap.add_argument("--slots", type=int, default=8, help="decode batch (decode pod slots)")
    ap.add_argument("--max-len", type=int, default=2048, help="positions per slot (context)")
    ap.add_argument("--buckets", type=_ints, default=(), help="prefill buckets, comma-separated "
                    "(default: 16..512 and max_len; only the largest compiles unless --all-buckets)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--headroom", type=float, default=0.1, help="fraction of HBM kept free for the runtime")
    ap.add_argument("--position", type=int, help="decode cost with every slot at this position (default max_len)")
    ap.add_argument("--all-buckets", action="store_true", help="compile every prefill bucket")
    ap.add_argument("--no-cost", action="store_true", help="memory only: skip the cost compiles")
    ap.add_argument("--prefill-cost", action="store_true", help="also project the prefill's time")
    ap.add_argument("--force", action="store_true", help="compile even when the weights and KV alone do not fit")
    ap.add_argument("--profile", help="also write a projected planner capacity profile here (needs --prefill-cost)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    if a.profile and (a.no_cost or not a.prefill_cost):
        print("tandem fit: --profile needs the decode and prefill costs: add --prefill-cost (and drop --no-cost)",
              file=sys.stderr)
        return 2
    try:
        r = fit(a.model, tpu=a.tpu, topology=a.topology, tp=a.tp, slots=a.slots, max_len=a.max_len,
                buckets=a.buckets, dtype=a.dtype, headroom=a.headroom, position=a.position,
                all_buckets=a.all_buckets, cost=not a.no_cost, prefill_cost=a.prefill_cost,
                force=a.force, profile_small=bool(a.profile), expert_parallel=a.ep)
        if a.profile and r.get("compiled"):
            Path(a.profile).write_text(json.dumps(projected_profile(r, r.get("decode_small")), indent=2) + "\n")
    except ValueError as e:
        print(f"tandem fit: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # libtpu missing (TPUUnavailable) and compiler errors
        print(f"tandem fit: {e}", file=sys.stderr)
        return 1
    print(json.dumps(r, indent=2) if a.json else format_report(r))
    return 0 if r["decode_pod"]["fits"] and r["prefill_pod"]["fits"] else 3


if __name__ == "__main__":
    sys.exit(main())
