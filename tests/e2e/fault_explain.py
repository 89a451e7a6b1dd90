"""What the cluster knew of the requests a fault lost: their lines in the cluster's log and what
Redis holds for them. A fault that loses a request once in dozens of runs (on a slower CI machine,
say) leaves only its assertion message behind; this puts the evidence into that message.
"""
from __future__ import annotations

import re

LOST = re.compile(r"lost (\S+) after (\d+) tokens")


def lost_ids(notes: str) -> list[str]:
    """The request ids `fault_load.judge` named as lost."""
    return [m.group(1) for m in LOST.finditer(notes)]


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2,5-6' (in stream order; a repeat shows as a new range)."""
    out: list[list[int]] = []
    for i in indices:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in out)


def redis_state(url: str, rid: str) -> str:
    """The request's token stream (indices in entry order, first/last entry ids), the running
    hashes that list it, and whether its admission marker and cancel key exist."""
    import redis

    from tandem_core import keys

    ks = keys.KeySpace(1)  # tandem local: one key shard
    r = redis.Redis.from_url(url, socket_timeout=5)
    try:
        entries = r.xrange(ks.token_stream(rid))
        idx = [int(f[b"i"]) for _id, f in entries]
        fins = [(int(f[b"i"]), f[b"f"].decode()) for _id, f in entries if b"f" in f]
        owners = [k.decode() for k in r.scan_iter(match=keys.RUNNING_PATTERN, count=1000) if r.hexists(k, rid)]
        span = f"{entries[0][0].decode()}..{entries[-1][0].decode()}" if entries else "-"
        info = r.info("server")
        return (f"tokens [{_ranges(idx)}] ids {span} finishes {fins}; running in {owners}; "
                f"marker {bool(r.exists(ks.admitted_key(rid)))}; cancel {bool(r.exists(ks.cancel_key(rid)))}; "
                f"Redis run_id {info.get('run_id')} up {info.get('uptime_in_seconds')} s")
    except Exception as e:  # noqa: BLE001 - a diagnosis must not hide the failure it explains
        return f"(Redis not readable: {e})"
    finally:
        r.close()


def explain(log_lines: list[str], url: str | None, notes: str, max_lines: int = 40) -> str:
    """For each lost request: Redis's state of it and its last `max_lines` log lines."""
    parts = []
    for rid in lost_ids(notes):
        mine = [line.rstrip() for line in log_lines if rid in line]
        parts.append(f"== {rid}: {redis_state(url, rid) if url else '(no Redis url)'}\n"
                     + "\n".join(mine[-max_lines:]))
    return "\n".join(parts)
