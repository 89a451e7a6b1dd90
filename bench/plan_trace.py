"""Load traces for bench/plan_sim.py: a seeded synthetic day (a diurnal curve with bursts) or a
recorded trace read from JSON lines.

A trace is three parallel numpy arrays sorted by arrival: `t` (seconds from the start),
`prompt` and `output` (tokens, integers >= 1). The synthetic one is a non-homogeneous Poisson
process (thinning of a homogeneous one at the curve's maximum) whose rate is

    rate(t) = (low + (peak - low) * bump(t)) * burst(t) * noise(t)

  * bump: a compressed day, 0 at the start and the end (night), 1 at the middle, shaped
    (0.5 - 0.5 cos(2 pi t / T)) ** shape (shape > 1: a longer night, a sharper afternoon);
  * burst: 1, or a burst's multiplier inside one of `bursts_per_hour * T / 3600` bursts placed
    uniformly (each lasting `burst_s` drawn in its range, multiplier in its range);
  * noise: a multiplicative random walk, one step a minute, sd `noise` per step, kept in [0.8, 1.25].

Prompt and output lengths are log-normal around their medians, clipped to their bounds (the
shape of ShareGPT-like chat, as bench/loadgen.py's chat_lengths). Everything is drawn from one
numpy Generator seeded with `seed`: the same spec gives the same trace.

A recorded trace: one JSON object a line, {"t": s, "prompt_tokens": n, "output_tokens": m}
(aliases: arrival_s / arrival, prompt / prompt_len, output / output_len / max_tokens); lines
that are blank or start with '#' are skipped.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Trace:
    t: np.ndarray  # arrival seconds, ascending
    prompt: np.ndarray  # tokens
    output: np.ndarray  # tokens
    name: str = ""

    def __len__(self) -> int:
        return len(self.t)

    @property
    def duration_s(self) -> float:
        return float(self.t[-1]) if len(self.t) else 0.0

    def rate_per_bin(self, bin_s: float, duration_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(bin starts, arrivals per second in each bin)."""
        end = duration_s if duration_s is not None else self.duration_s
        n = max(1, math.ceil(end / bin_s))
        counts = np.bincount(np.minimum((self.t // bin_s).astype(int), n - 1), minlength=n)
        return np.arange(n) * bin_s, counts / bin_s


@dataclass(frozen=True)
class TraceSpec:
    duration_s: float = 4 * 3600.0  # a day compressed to 4 h: its ramps are 6x steeper than a real day's
    low_rpm: float = 600.0  # requests a minute at night
    peak_rpm: float = 3600.0  # at the top of the day, before bursts
    shape: float = 1.5
    bursts_per_hour: float = 1.5
    burst_mult: tuple[float, float] = (1.5, 2.5)
    burst_s: tuple[float, float] = (60.0, 300.0)
    noise: float = 0.03
    prompt_median: float = 256
    prompt_sigma: float = 0.8
    prompt_bounds: tuple[int, int] = (8, 2048)
    output_median: float = 128
    output_sigma: float = 0.7
    output_bounds: tuple[int, int] = (4, 1024)
    seed: int = 0

    @property
    def max_rate(self) -> float:
        """An upper bound of rate(t), requests/s."""
        return self.peak_rpm / 60.0 * self.burst_mult[1] * 1.25


def rate_curve(spec: TraceSpec, rng: np.random.Generator, step_s: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    """(grid times, rate at each, requests/s) on a `step_s` grid: the day, the bursts, the noise."""
    grid = np.arange(0.0, spec.duration_s + step_s, step_s)
    bump = (0.5 - 0.5 * np.cos(2 * math.pi * grid / spec.duration_s)) ** spec.shape
    rate = (spec.low_rpm + (spec.peak_rpm - spec.low_rpm) * bump) / 60.0
    n_bursts = rng.poisson(spec.bursts_per_hour * spec.duration_s / 3600.0)
    for _ in range(n_bursts):
        start = rng.uniform(0, spec.duration_s)
        length = rng.uniform(*spec.burst_s)
        mult = rng.uniform(*spec.burst_mult)
        inside = (grid >= start) & (grid < start + length)
        rate[inside] *= mult
    steps = max(1, math.ceil(spec.duration_s / 60.0)) + 1
    walk = np.clip(np.exp(np.cumsum(rng.normal(0.0, spec.noise, steps))), 0.8, 1.25)
    rate *= walk[np.minimum((grid // 60.0).astype(int), steps - 1)]
    return grid, np.minimum(rate, spec.max_rate)


def _lengths(rng: np.random.Generator, n: int, median: float, sigma: float, bounds: tuple[int, int]) -> np.ndarray:
    x = np.round(rng.lognormal(math.log(median), sigma, n))
    return np.clip(x, bounds[0], bounds[1]).astype(np.int64)


def synthetic(spec: TraceSpec) -> Trace:
    """The seeded synthetic day of `spec`."""
    rng = np.random.default_rng(spec.seed)
    grid, rate = rate_curve(spec, rng)
    top = float(rate.max()) if len(rate) else 0.0
    if top <= 0:
        empty = np.zeros(0)
        return Trace(empty, empty.astype(np.int64), empty.astype(np.int64), "synthetic (empty)")
    n = rng.poisson(top * spec.duration_s)
    t = np.sort(rng.uniform(0.0, spec.duration_s, n))
    keep = rng.uniform(0.0, top, n) < np.interp(t, grid, rate)
    t = t[keep]
    prompt = _lengths(rng, len(t), spec.prompt_median, spec.prompt_sigma, spec.prompt_bounds)
    output = _lengths(rng, len(t), spec.output_median, spec.output_sigma, spec.output_bounds)
    name = (f"synthetic day: {spec.duration_s / 3600:g} h, {spec.low_rpm:g}..{spec.peak_rpm:g} req/min "
            f"+ bursts x{spec.burst_mult[0]:g}..{spec.burst_mult[1]:g}, prompt median {spec.prompt_median:g}, "
            f"output median {spec.output_median:g}, seed {spec.seed}")
    return Trace(t, prompt, output, name)


def poisson_slice(rate: float, duration_s: float, lengths: list[tuple[int, int]], seed: int = 0) -> Trace:
    """Poisson arrivals at `rate` for `duration_s`, each request one of `lengths` (prompt, output)
    chosen uniformly: the small trace slice that --validate runs on a real cluster."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, int(rate * duration_s * 1.5) + 16)
    t = np.cumsum(gaps)
    t = t[t < duration_s]
    pick = rng.integers(0, len(lengths), len(t))
    lens = np.asarray(lengths, dtype=np.int64)
    return Trace(t, lens[pick, 0], lens[pick, 1], f"Poisson {rate:g} req/s for {duration_s:g} s, lengths {lengths}")


_KEYS = {"t": ("t", "arrival_s", "arrival"), "prompt": ("prompt_tokens", "prompt", "prompt_len"),
         "output": ("output_tokens", "output", "output_len", "max_tokens")}


def _field(obj: dict, what: str, where: str) -> float:
    for k in _KEYS[what]:
        if k in obj:
            return obj[k]
    raise ValueError(f"{where}: no {what!r} field (want one of {', '.join(_KEYS[what])})")


def read_jsonl(path: str | Path) -> Trace:
    """A recorded trace; sorted by arrival, shifted to start at 0."""
    ts, ps, os_ = [], [], []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{i}"
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: want a JSON object a line")
        t, p, o = float(_field(obj, "t", where)), int(_field(obj, "prompt", where)), int(_field(obj, "output", where))
        if not math.isfinite(t) or p < 1 or o < 1:
            raise ValueError(f"{where}: want a finite time and token counts >= 1, got {obj}")
        ts.append(t), ps.append(p), os_.append(o)
    order = np.argsort(np.asarray(ts), kind="stable")
    t = np.asarray(ts, dtype=float)[order]
    if len(t):
        t = t - t[0]
    return Trace(t, np.asarray(ps, dtype=np.int64)[order], np.asarray(os_, dtype=np.int64)[order], f"recorded {path}")


def write_jsonl(trace: Trace, path: str | Path) -> None:
    with open(path, "w") as f:
        for t, p, o in zip(trace.t.tolist(), trace.prompt.tolist(), trace.output.tolist()):
            f.write(json.dumps({"t": round(t, 6), "prompt_tokens": p, "output_tokens": o}) + "\n")
