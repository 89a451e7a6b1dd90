"""bench/token_plane.py's pure parts: checking each stream (exactly once, in order), joining the
publishers' send times with the gateways' arrival times, per-window rates and latencies, the
Redis INFO deltas per token, key -> cluster node placement, and the live latency histogram.
No sockets, no processes: unit-tested in tests/unit/test_bench_token_plane.py."""
from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping

import numpy as np

# Commands the benchmark itself sends to Redis (INFO and CLIENT LIST snapshots): left out of the
# per-token counts, reported apart.
OWN_COMMANDS = ("info", "client", "client|list", "cluster", "cluster|slots", "dbsize", "ping", "config",
                "config|get", "config|set", "flushall", "memory", "memory|usage")

# The live histogram: lag buckets in ms, the upper edge of bucket b is LAG_EDGES_MS[b]
LAG_EDGES_MS = np.array([0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                         1024, 1536, 2048, 4096, 8192, 1e9])


def check_stream(index: np.ndarray, token: np.ndarray, finish: np.ndarray, length: int,
                 expected_token: Callable[[int], int] | None = None) -> str | None:
    """What is wrong with one delivered stream (None: every index 0..length-1 once, in order, the
    expected tokens, and the finish on the last entry only)."""
    index, finish = np.asarray(index), np.asarray(finish)
    n = len(index)
    if n == 0:
        return "nothing delivered"
    if n != length or not np.array_equal(index, np.arange(length)):
        seen, dup = set(), []
        for i in index.tolist():
            if i in seen:
                dup.append(i)
            seen.add(i)
        if dup:
            return f"duplicate index {dup[0]} ({len(dup)} duplicates in {n} entries)"
        missing = sorted(set(range(length)) - seen)
        if missing:
            return f"gap: index {missing[0]} missing ({len(missing)} of {length} missing)"
        if len(seen) != n or max(seen) >= length:
            return f"unexpected index {max(seen)} (want 0..{length - 1})"
        bad = next(k for k, i in enumerate(index.tolist()) if i != k)
        return f"out of order: index {index[bad]} at position {bad}"
    if expected_token is not None:
        want = np.array([expected_token(i) for i in range(length)])
        wrong = np.nonzero(np.asarray(token) != want)[0]
        if len(wrong):
            return f"wrong token at index {wrong[0]}: {token[wrong[0]]} (want {want[wrong[0]]})"
    if not finish[-1]:
        return "no finish on the last entry"
    if finish[:-1].any():
        return f"finish before the end, at index {int(np.argmax(finish[:-1]))}"
    return None


def join(publishers: list[dict], gateways: list[dict], length_of: Callable[[int, int], int],
         token_of: Callable[[int, int, int], int], max_errors: int = 20) -> dict:
    """Check every stream a publisher began against what the gateways delivered; the send and
    arrival time of every delivered token (monotonic seconds).

    `publishers[i]`: `step_times` (one per step), `starts` rows (slot, gen, step of index 0).
    `gateways[i]`: `req` rows (slot, gen), `counts`, and the concatenated `index`, `token`,
    `finish`, `arrival` of each request in `req` order."""
    got: dict[tuple[int, int], tuple[int, int, int]] = {}
    for g, gw in enumerate(gateways):
        offs = np.concatenate([[0], np.cumsum(gw["counts"])])
        for k, (slot, gen) in enumerate(np.asarray(gw["req"]).tolist()):
            if gw["counts"][k]:
                got[(slot, gen)] = (g, int(offs[k]), int(gw["counts"][k]))
    errors: list[str] = []
    n_err = 0
    sends, arrivals = [], []
    begun = set()
    for pub in publishers:
        times = np.asarray(pub["step_times"])
        for slot, gen, step in np.asarray(pub["starts"]).tolist():
            begun.add((slot, gen))
            length = length_of(slot, gen)
            where = got.get((slot, gen))
            if where is None:
                n_err += 1
                if len(errors) < max_errors:
                    errors.append(f"slot {slot} gen {gen}: nothing delivered")
                continue
            g, off, n = where
            gw = gateways[g]
            err = check_stream(gw["index"][off:off + n], gw["token"][off:off + n], gw["finish"][off:off + n],
                               length, lambda i, s=slot, q=gen: token_of(s, q, i))
            if err:
                n_err += 1
                if len(errors) < max_errors:
                    errors.append(f"slot {slot} gen {gen}: {err}")
                continue
            sends.append(times[step:step + length])
            arrivals.append(gw["arrival"][off:off + n])
    extra = [k for k in got if k not in begun]  # delivered entries of a stream nobody wrote
    for slot, gen in extra[:max(0, max_errors - len(errors))]:
        errors.append(f"slot {slot} gen {gen}: delivered but never written")
    n_err += len(extra)
    send = np.concatenate(sends) if sends else np.zeros(0)
    arrival = np.concatenate(arrivals) if arrivals else np.zeros(0)
    return {"streams": len(begun), "streams_ok": len(begun) - n_err + len(extra), "errors": n_err,
            "error_examples": errors, "tokens": int(len(send)), "send": send, "arrival": arrival}


def window_stats(send: np.ndarray, arrival: np.ndarray, t0: float, t1: float) -> dict:
    """Tokens written and delivered per second in [t0, t1), and the latency (ms) of those written in it."""
    dur = max(t1 - t0, 1e-9)
    sent = (send >= t0) & (send < t1)
    lat = (arrival[sent] - send[sent]) * 1000.0
    return {"seconds": dur, "written": int(sent.sum()), "delivered": int(((arrival >= t0) & (arrival < t1)).sum()),
            "written_per_s": sent.sum() / dur, "delivered_per_s": ((arrival >= t0) & (arrival < t1)).sum() / dur,
            "latency_ms": {q: _pct(lat, v) for q, v in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))}}


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else math.nan


def commandstats_delta(before: Mapping[str, Mapping], after: Mapping[str, Mapping]) -> dict[str, dict]:
    """{command: {calls, usec}} run between two INFO commandstats replies (redis-py's parsed form:
    `cmdstat_xadd: {calls, usec, ...}`)."""
    out = {}
    for key, a in after.items():
        if not key.startswith("cmdstat_"):
            continue
        b = before.get(key, {})
        calls = int(a.get("calls", 0)) - int(b.get("calls", 0))
        if calls:
            out[key[len("cmdstat_"):]] = {"calls": calls, "usec": int(a.get("usec", 0)) - int(b.get("usec", 0))}
    return out


def split_own(cmds: Mapping[str, dict]) -> tuple[dict, dict]:
    """(the system's commands, the benchmark's own INFO/CLIENT calls)."""
    mine = {c: v for c, v in cmds.items() if c.lower() in OWN_COMMANDS}
    return {c: v for c, v in cmds.items() if c not in mine}, mine


def redis_cost(info0: Mapping, info1: Mapping, seconds: float, tokens: int) -> dict:
    """Redis's side of a window from two merged INFO replies (commandstats, stats, cpu), per token.
    Commands called inside a script count in commandstats too (HEXISTS, XADD, EXPIRE of the fenced
    write), besides the EVALSHA itself: `calls_per_token` counts every one of them."""
    cmds, own = split_own(commandstats_delta(info0, info1))
    tok = max(tokens, 1)
    cpu = (float(info1["used_cpu_sys"]) + float(info1["used_cpu_user"])
           - float(info0["used_cpu_sys"]) - float(info0["used_cpu_user"]))
    bytes_in = int(info1["total_net_input_bytes"]) - int(info0["total_net_input_bytes"])
    bytes_out = int(info1["total_net_output_bytes"]) - int(info0["total_net_output_bytes"])
    calls = sum(v["calls"] for v in cmds.values())
    return {
        "commands": cmds, "own_commands": own, "calls": calls, "calls_per_token": calls / tok,
        "calls_per_token_by_command": {c: v["calls"] / tok for c, v in sorted(cmds.items())},
        "usec_per_token_by_command": {c: v["usec"] / tok for c, v in sorted(cmds.items())},
        "bytes_in_per_token": bytes_in / tok, "bytes_out_per_token": bytes_out / tok,
        "cpu_s": cpu, "cpu_us_per_token": cpu * 1e6 / tok, "cpu_util": cpu / max(seconds, 1e-9),
        "ops_per_s": calls / max(seconds, 1e-9),
    }


def flatten_info(sections: Iterable[Mapping]) -> dict:
    out: dict = {}
    for s in sections:
        out.update(s)
    return out


def per_key_fit(runs: list[dict], cost: str) -> dict | None:
    """Least squares `cost = per_key * keys named by all XREADs + per_token * tokens` over runs
    ({xread_keys, tokens, cost}), or None with fewer than 2 runs or a degenerate system: how much
    of a cost grows with the streams each XREAD names rather than with the tokens it returns."""
    if len(runs) < 2:
        return None
    a = np.array([[r["xread_keys"], r["tokens"]] for r in runs], dtype=float)
    y = np.array([r[cost] for r in runs], dtype=float)
    if np.linalg.matrix_rank(a) < 2:
        return None
    (per_key, per_token), *_ = np.linalg.lstsq(a, y, rcond=None)
    return {"per_key": float(per_key), "per_token": float(per_token)}


# ---------------------------------------------------------------------------------------------
# the live latency histogram (entry id ms -> arrival, ms resolution), for deciding saturation


def lag_bucket(lag_ms: float) -> int:
    return int(np.searchsorted(LAG_EDGES_MS, lag_ms, side="left"))


def hist_quantile(counts: np.ndarray, q: float) -> float:
    """The upper edge (ms) of the bucket holding quantile q (0..1) of a lag histogram."""
    total = counts.sum()
    if total <= 0:
        return math.nan
    b = int(np.searchsorted(np.cumsum(counts), q * total, side="left"))
    return float(LAG_EDGES_MS[min(b, len(LAG_EDGES_MS) - 1)])


def saturated(rows: list[dict], p99_bound_ms: float, keep_up: float = 0.9, rise: float = 1.05) -> str:
    """Why the last load step is past saturation ('' = not yet): the p99 latency passed its bound,
    the gateways delivered less than was written, the publishers wrote less than was asked (the
    machine's CPUs ran out), or delivered tokens/s stopped rising."""
    last = rows[-1]
    if last["p99_ms"] > p99_bound_ms:
        return f"p99 {last['p99_ms']:.0f} ms > {p99_bound_ms:g} ms"
    if last["delivered_per_s"] < keep_up * last["written_per_s"]:
        return f"delivered {last['delivered_per_s']:.0f} < {keep_up:g} x written {last['written_per_s']:.0f} tok/s"
    if last["written_per_s"] < keep_up * last["target_per_s"]:
        return f"publishers wrote {last['written_per_s']:.0f} < {keep_up:g} x asked {last['target_per_s']:.0f} tok/s"
    best = max((r["delivered_per_s"] for r in rows[:-1]), default=0.0)
    if best and last["delivered_per_s"] < rise * best:
        return f"delivered {last['delivered_per_s']:.0f} tok/s did not rise over {best:.0f}"
    return ""


# ---------------------------------------------------------------------------------------------
# Redis Cluster placement


def slot_owner(slot_ranges: list[tuple[int, int, str]]) -> Callable[[int], str]:
    """slot -> node name, from CLUSTER SLOTS ranges (start, end, node)."""
    starts = np.array([a for a, _, _ in sorted(slot_ranges)])
    ranges = sorted(slot_ranges)

    def owner(slot: int) -> str:
        i = int(np.searchsorted(starts, slot, side="right")) - 1
        a, b, node = ranges[i]
        if not a <= slot <= b:
            raise KeyError(f"slot {slot} is not served")
        return node

    return owner


def placement(key_ops: Mapping[str, float], key_slot: Callable[[str], int], owner: Callable[[int], str]) -> dict:
    """Keys and operations per node for {key: ops on it}; the slots used and the busiest node's share."""
    nodes: dict[str, dict] = {}
    slots: dict[str, set] = {}
    for key, ops in key_ops.items():
        slot = key_slot(key)
        node = owner(slot)
        d = nodes.setdefault(node, {"keys": 0, "ops": 0.0})
        d["keys"] += 1
        d["ops"] += ops
        slots.setdefault(node, set()).add(slot)
    total = sum(d["ops"] for d in nodes.values()) or 1.0
    for node, d in nodes.items():
        d["slots_used"] = len(slots[node])
        d["ops_share"] = d["ops"] / total
    return {"nodes": dict(sorted(nodes.items())), "distinct_slots": len(set().union(*slots.values()) if slots else ()),
            "max_ops_share": max((d["ops_share"] for d in nodes.values()), default=0.0)}
