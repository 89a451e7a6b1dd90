"""Dead letters: a claimed stream entry (admission, direct or ready) that no request can be read
from. Left pending it would be taken again and fail again for ever; acked silently, its client
waits out its timeout. So the reader acks it AND ends its request with a clear error: every entry
names its request (`rid`, written beside the request's JSON by every writer), and whatever of the
JSON still reads says which token streams its client reads (each choice's) and from which index.
One log line names the entry and its stream. Issue 42: a bad entry costs one request, never a
reader, never a silent wait.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from tandem_core.types import choice_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeadLetter:
    """What ends the request of an unreadable entry: an `error` finish without a token on each
    of `token_streams` (request ids) at `index`, saying `error`. `token_streams` is empty when
    the entry names no request (nothing to answer: only acked)."""

    token_streams: list[str]
    index: int
    error: str


def read(stream: str, entry_id: bytes | str, fields: dict, cause: BaseException) -> DeadLetter:
    """The dead letter of an entry of `stream` that failed to read with `cause`, logged once."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    error = (f"the request's entry {eid} in {stream} cannot be read ({type(cause).__name__}: {cause}); "
             "it was dropped: send the request again")
    rid = _text(_field(fields, "rid"))
    n, index = 1, 0
    body = _field(fields, "req") or _field(fields, "notice")
    try:  # best effort: whatever of the request's JSON still reads
        d = json.loads(body) if body is not None else {}
        d = d.get("request", d) if isinstance(d, dict) else {}
        rid = rid or (d.get("request_id") if isinstance(d.get("request_id"), str) else None)
        n = d["n"] if isinstance(d.get("n"), int) and 1 <= d["n"] <= 128 else 1
        index = d["start_index"] if isinstance(d.get("start_index"), int) and d["start_index"] >= 0 else 0
    except Exception:  # noqa: BLE001 - the JSON itself is what is broken
        pass
    streams = choice_ids(rid, n) if rid else []
    log.error("dead letter: %s entry %s cannot be read as a request (%s: %s); acking it%s. Its fields: %.2000r",
              stream, eid, type(cause).__name__, cause,
              f" and failing request_id={rid}" if rid else " (it names no request to fail)", fields)
    return DeadLetter(streams, index, error)


def _field(fields: dict, name: str):
    got = fields.get(name)
    return fields.get(name.encode()) if got is None else got


def _text(x) -> str | None:
    if x is None:
        return None
    try:
        return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)
    except UnicodeDecodeError:
        return None
