"""A capacity profile: what one prefill pod and one decode pod of a deployment can do, measured.

`bench/capacity.py` writes it (for the built-in model on this machine; on a TPU pool the same
script runs on the pool's node, see docs/planner.md); the planner and the simulator read it.

    {"format": "tandem-capacity-profile/v1", "model": "builtin", "machine": "...", "created": "...",
     "prefill": {"points": [{"tokens": 16, "seconds": 0.004}, ...]},
     "decode": {"slots": 8, "points": [{"batch": 1, "itl_s": 0.004}, ...]},
     "handoff_s": 0.01, "cold_start_s": 95.0}

- prefill.points: seconds one pod spends on one prompt of `tokens` tokens (it prefills one prompt
  per call), at several lengths; between two points the time is interpolated linearly, past the
  last it grows in proportion to the length.
- decode.points: the step time (= the gap between a request's tokens) with `batch` requests
  decoding at once, up to `slots`; interpolated linearly, never extrapolated past `slots`.
- handoff_s: ready-notice claim + KV pull + insert, once per request (part of its first gap).
- cold_start_s (optional, 0 when absent): from a pod's start to its first served request, the
  weights' load plus the compiles with a warm compilation cache (`tandem fit` projects it from
  the checkpoint's bytes and a read rate; docs/deploy-gke.md). The planner sizes a scale-up for
  the load this far ahead (planner/decide.py), since a pod asked for now serves only after it.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

FORMAT = "tandem-capacity-profile/v1"
BUILTIN_PROFILE = Path(__file__).resolve().parent / "profiles" / "builtin-cpu.json"


class ProfileError(ValueError):
    """The profile file is missing or malformed; the message says which field and how to fix it."""


@dataclass(frozen=True)
class Profile:
    model: str
    prefill_points: tuple[tuple[int, float], ...]  # (tokens, seconds), tokens ascending
    decode_points: tuple[tuple[int, float], ...]  # (batch, itl seconds), batch ascending
    slots: int
    handoff_s: float = 0.0
    source: str = ""
    cold_start_s: float = 0.0  # a new pod's load + compile before it serves (the scale-up lead time)

    def prefill_seconds(self, tokens: float) -> float:
        """One pod's busy time for one prompt of `tokens` tokens."""
        xs = [p[0] for p in self.prefill_points]
        ys = [p[1] for p in self.prefill_points]
        tokens = max(1.0, float(tokens))
        if tokens <= xs[0]:
            return ys[0]
        if tokens >= xs[-1]:
            return ys[-1] * tokens / xs[-1]
        i = bisect.bisect_right(xs, tokens)
        return _lerp(xs[i - 1], ys[i - 1], xs[i], ys[i], tokens)

    def decode_itl(self, batch: float) -> float:
        """Step time with `batch` requests decoding on one pod (batch clamped to [1, slots])."""
        xs = [p[0] for p in self.decode_points]
        ys = [p[1] for p in self.decode_points]
        b = min(max(1.0, float(batch)), float(self.slots))
        if b <= xs[0]:
            return ys[0]
        if b >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, b)
        return _lerp(xs[i - 1], ys[i - 1], xs[i], ys[i], b)

    def decode_batch_for_itl(self, itl_s: float) -> int:
        """The largest batch (<= slots) whose step time meets `itl_s`; 0 when not even one does."""
        best = 0
        for b in range(1, self.slots + 1):
            if self.decode_itl(b) <= itl_s:
                best = b
        return best


def _lerp(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _points(raw: object, where: str, xkey: str, ykey: str) -> tuple[tuple[int, float], ...]:
    if not isinstance(raw, list) or not raw:
        raise ProfileError(f"{where}: want a non-empty list of {{{xkey!r}: int, {ykey!r}: seconds}}")
    out = []
    for i, p in enumerate(raw):
        if not isinstance(p, dict) or xkey not in p or ykey not in p:
            raise ProfileError(f"{where}[{i}]: want {{{xkey!r}: int, {ykey!r}: seconds}}, got {p!r}")
        x, y = p[xkey], p[ykey]
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ProfileError(f"{where}[{i}].{xkey}: want an integer >= 1, got {x!r}")
        if not isinstance(y, (int, float)) or isinstance(y, bool) or not math.isfinite(y) or y <= 0:
            raise ProfileError(f"{where}[{i}].{ykey}: want seconds > 0, got {y!r}")
        out.append((x, float(y)))
    out.sort()
    if len({x for x, _ in out}) != len(out):
        raise ProfileError(f"{where}: two points share one {xkey}")
    return tuple(out)


def parse_profile(doc: object, source: str = "") -> Profile:
    """Validate a profile document (a dict from JSON); every error names the field to fix."""
    if not isinstance(doc, dict):
        raise ProfileError(f"{source or 'profile'}: want a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ProfileError(f"{source or 'profile'}: format {doc.get('format')!r}, want {FORMAT!r} "
                           "(make one with python bench/capacity.py)")
    pre, dec = doc.get("prefill"), doc.get("decode")
    if not isinstance(pre, dict):
        raise ProfileError("prefill: missing (want {'points': [...]})")
    if not isinstance(dec, dict):
        raise ProfileError("decode: missing (want {'slots': N, 'points': [...]})")
    slots = dec.get("slots")
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise ProfileError(f"decode.slots: want an integer >= 1, got {slots!r}")
    dpoints = _points(dec.get("points"), "decode.points", "batch", "itl_s")
    if dpoints[-1][0] > slots:
        raise ProfileError(f"decode.points: batch {dpoints[-1][0]} is past decode.slots {slots}")
    handoff = doc.get("handoff_s", 0.0)
    if not isinstance(handoff, (int, float)) or isinstance(handoff, bool) or not math.isfinite(handoff) or handoff < 0:
        raise ProfileError(f"handoff_s: want seconds >= 0, got {handoff!r}")
    cold = doc.get("cold_start_s", 0.0)
    if not isinstance(cold, (int, float)) or isinstance(cold, bool) or not math.isfinite(cold) or cold < 0:
        raise ProfileError(f"cold_start_s: want seconds >= 0 (a new pod's load + compile), got {cold!r}")
    return Profile(model=str(doc.get("model", "")), prefill_points=_points(pre.get("points"), "prefill.points", "tokens", "seconds"),
                   decode_points=dpoints, slots=slots, handoff_s=float(handoff), source=source,
                   cold_start_s=float(cold))


def load_profile(path: str | Path = "") -> Profile:
    """The profile at `path` ("" = the built-in model's, shipped with the planner)."""
    p = Path(path) if path else BUILTIN_PROFILE
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"capacity profile {p}: no such file (make one with python bench/capacity.py "
                           "--out PATH, or leave profile_path empty for the built-in model's)") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"capacity profile {p}: not JSON ({e})") from None
    return parse_profile(doc, str(p))
