"""The capacity profile document bench/capacity.py writes, and its RESULTS.md report: pure
functions of measured numbers (unit-tested in tests/unit/test_bench_capacity.py), apart from the
measuring."""
from __future__ import annotations

import datetime as _dt
import json
import math
import re
from typing import Mapping

from bench.common import markdown_table
from planner.profile import FORMAT, parse_profile

CLAIM_NOTE = "the ready-notice claim (one Redis round trip on the decode pod) is not measured"


class CapacityError(ValueError):
    """A measured number that cannot go into a profile; the message says which and why."""


# ---------------------------------------------------------------------------------------------
# the profile document (pure; unit-tested)


def _seconds(x: object, what: str, allow_zero: bool = False) -> float:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and (
        x >= 0 if allow_zero else x > 0)
    if not ok:
        raise CapacityError(f"{what}: {x!r} is not a number of seconds {'>= 0' if allow_zero else '> 0'}")
    return float(x)


def _count(x: object, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise CapacityError(f"{what}: {x!r} is not an integer >= 1")
    return int(x)


def build_profile(*, model: str, machine: str, command: str, prefill: Mapping[int, float],
                  decode: Mapping[int, float], slots: int, handoff_s: float = 0.0, created: str = "",
                  extra: Mapping[str, object] | None = None) -> dict:
    """The profile document from measured numbers: prefill {prompt tokens: seconds per prompt},
    decode {batch: step seconds} (batches within 1..slots), handoff_s per request. `extra` keys
    (engine settings, load average, method) are added beside the format's. Raises CapacityError
    naming the bad number; the result always passes planner.profile.parse_profile."""
    if not isinstance(model, str) or not model:
        raise CapacityError("model: want the preset name or model path the pods serve")
    slots = _count(slots, "decode slots")
    if not prefill:
        raise CapacityError("prefill: no point measured (want {prompt tokens: seconds})")
    if not decode:
        raise CapacityError("decode: no point measured (want {batch: step seconds})")
    pre = sorted((_count(t, "prefill tokens"), _seconds(s, f"prefill at {t} tokens")) for t, s in prefill.items())
    dec = sorted((_count(b, "decode batch"), _seconds(s, f"decode step at batch {b}")) for b, s in decode.items())
    if dec[-1][0] > slots:
        raise CapacityError(f"decode batch {dec[-1][0]} is past the {slots} slots measured")
    doc = {
        "format": FORMAT,
        "model": model,
        "machine": machine,
        "created": created or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "prefill": {"points": [{"tokens": t, "seconds": round(s, 7)} for t, s in pre]},
        "decode": {"slots": slots, "points": [{"batch": b, "itl_s": round(s, 7)} for b, s in dec]},
        "handoff_s": round(_seconds(handoff_s, "handoff_s", allow_zero=True), 7),
    }
    for k, v in (extra or {}).items():
        if k in doc:
            raise CapacityError(f"extra key {k!r} would overwrite a field of the format")
        doc[k] = v
    parse_profile(doc, "built profile")  # the reader's own checks, so no file is written it refuses
    return doc


def dumps(doc: dict) -> str:
    """JSON with two-space indents and every innermost object or list (a point, a bucket list) on
    one line, so a profile reads as a table."""
    def one_line(m: re.Match) -> str:
        try:
            return json.dumps(json.loads(m.group(0)))
        except ValueError:  # a brace inside a string: leave that part as it is
            return m.group(0)

    return re.sub(r"\{[^{}\[\]]*\}|\[[^{}\[\]]*\]", one_line, json.dumps(doc, indent=2)) + "\n"


def capacity_rows(doc: dict) -> tuple[list[list], list[list]]:
    """(prefill rows [tokens, ms, prompts/s, tokens/s], decode rows [batch, ITL ms, tokens/s,
    tokens/s per request]): what one pod of each kind does at each measured point."""
    pre = [[p["tokens"], p["seconds"] * 1e3, 1.0 / p["seconds"], p["tokens"] / p["seconds"]]
           for p in doc["prefill"]["points"]]
    dec = [[p["batch"], p["itl_s"] * 1e3, p["batch"] / p["itl_s"], 1.0 / p["itl_s"]]
           for p in doc["decode"]["points"]]
    return pre, dec


def handoff_total(pull_s: Mapping[int, float], insert_s: Mapping[int, float], tokens: int) -> float:
    """Pull + insert at `tokens` (one of the measured buckets)."""
    if tokens not in pull_s or tokens not in insert_s:
        raise CapacityError(f"--handoff-tokens {tokens}: not a measured bucket (measured: "
                            f"{sorted(set(pull_s) & set(insert_s))})")
    return pull_s[tokens] + insert_s[tokens]


def load_line(start: float | None, end: float | None) -> str:
    if start is None:
        return "load average unknown"
    return f"1-minute load average {start:.2f} at the start, {end:.2f} at the end"


def report(doc: dict, nproc: int | None = None) -> str:
    """The RESULTS.md section for a profile document written by this script."""
    pre, dec = capacity_rows(doc)
    eng, load, hd = doc.get("engine", {}), doc.get("load_avg_1m", {}), doc.get("handoff_detail")
    method = doc.get("method", {})
    settings = ", ".join(f"{k} {v}" for k, v in eng.items() if k not in ("model_name", "params"))
    params = f", {eng['params'] / 1e6:.2f}M params" if isinstance(eng.get("params"), int) else ""
    lines = [
        "## Capacity profile: one prefill pod and one decode pod (the planner's input)", "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {doc['machine']}  ",
        f"Load: {load_line(load.get('start'), load.get('end'))}"
        + (f" ({nproc} CPUs, shared with other work: absolute times are noisy)" if nproc else "") + "  ",
        f"Model: {doc['model']} ({eng.get('model_name', '?')}{params}); engine: {settings}.  ",
        f"Profile written to `{method.get('out', '?')}` (format `{doc['format']}`).", "",
        "### Prefill: one prompt per call",
        (f"From `{doc['prefill_from']['path']}`, measured on {doc['prefill_from']['machine']} "
         f"({doc['prefill_from']['created']}, `{doc['prefill_from']['command']}`)." if doc.get("prefill_from") else
         f"Engine.prefill + export_prefix (the KV to host memory), median of {method.get('prefill_reps', '?')} "
         "timed runs, in rounds over every bucket after a compiling round.")
        + " A prompt costs its bucket's time (a shorter one is padded to it).", "",
        markdown_table(["prompt tokens", "seconds / prompt (ms)", "prompts/s per pod", "prompt tokens/s per pod"], pre), "",
        f"### Decode: {doc['decode']['slots']} slots, the lowest `batch` in use",
        "Step time (= ITL) of the decode pod's pipelined loop over the slots in use, which computes the "
        f"smallest batch bucket that holds them (buckets {method.get('batch_buckets', '?')}: batches in one "
        f"bucket cost about the same); median of {method.get('decode_rounds', '?')} rounds of "
        f"{method.get('decode_steps', '?')} steps, in rounds over every batch after a compiling round; "
        f"{method.get('prompt_tokens', '?')}-token prompts (context {method.get('context', '?')} positions).", "",
        markdown_table(["batch", "ITL ms", "tokens/s per pod", "tokens/s per request"], dec), "",
        "### Hand-off: KV pull over loopback gRPC + import + insert",
    ]
    if hd:
        lines += [
            f"Real KVTransferServicer/KVStore (child process) and KVPuller; median of {hd.get('pull_reps', '?')} "
            f"or more pulls (bench/kv_transfer.py); insert = import_prefix + insert + block, median of "
            f"{hd.get('insert_reps', '?')}. "
            f"`handoff_s` = {doc['handoff_s'] * 1e3:.2f} ms, at {hd['tokens']} tokens; {CLAIM_NOTE}.", "",
            markdown_table(["prompt tokens", "KV KiB", "pull ms", "import + insert ms", "total ms"],
                           [[p["tokens"], p["kv_bytes"] / 1024, p["pull_s"] * 1e3, p["insert_s"] * 1e3,
                             (p["pull_s"] + p["insert_s"]) * 1e3] for p in hd["points"]]),
        ]
    else:
        lines.append(f"Not measured in this run (`handoff_s` = {doc['handoff_s']}).")
    return "\n".join(lines)
