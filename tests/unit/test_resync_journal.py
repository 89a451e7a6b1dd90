"""The decode pod's journal of its own recent writes (decode_svc/resync.py): pruned to the last
`window_s` only when told Redis is the same one, so an outage does not age it out."""
from __future__ import annotations

import asyncio

from decode_svc import resync
from decode_svc.resync import Journal, Resync
from tests.unit.clock import Clock
from tandem_core.keys import KeySpace

KS = KeySpace(1)  # a plain Redis: one key shard (a service builds its own from its settings)



def test_the_journal_keeps_the_last_window_of_writes():
    clock = Clock()
    j = Journal(5.0, clock)
    for i in range(10):
        j.add("ack", ("s", "g", str(i).encode()))
        clock.t += 1.0
    assert len(j.entries) == 10  # nothing goes until Redis is known to be the same one
    clock.t -= 1.0
    j.prune()
    assert [p[2] for _t, _k, p in j.entries] == [str(i).encode() for i in range(4, 10)]


def test_an_outage_does_not_age_the_journal_out():
    clock = Clock()
    j = Journal(5.0, clock)
    j.add("own", ["a"])
    j.add("fenced", {"b"})
    clock.t += 60  # Redis was down for a minute, then writes reach a new one before the reconcile
    j.add("ack", ("s", "g", b"1"))
    assert [k for _t, k, _p in j.entries] == ["own", "fenced", "ack"] and j.fenced_ids() == {"b"}
    j.prune()  # (only once the reconcile is done and a beat finds the same Redis)
    assert [k for _t, k, _p in j.entries] == ["ack"]


def test_the_journal_is_bounded(monkeypatch):
    monkeypatch.setattr(resync, "MAX_ENTRIES", 3)
    j = Journal(5.0, Clock())
    for i in range(5):
        j.add("disown", f"r{i}")
    assert [p for _t, _k, p in j.entries] == ["r2", "r3", "r4"] and j.dropped == 2


async def test_a_write_journaled_while_a_reconcile_replays_is_told_to_write_itself():
    """A decode pod journals the first token of a ready notice it read from the Redis of before;
    if the reconcile with the new one has already taken its copy of the journal, that token would
    never be written again (the relay would wait on index 0 forever), so `missed_since` says so."""
    written, gate = [], asyncio.Event()

    async def write(_kind, payload, _fenced):
        written.append(payload)

    async def resume(_req):
        return "resumed"

    rs = Resync(None, KS, Journal(5.0, Clock()), "decode-0", write, resume, gate.wait)
    await rs.seen("run-a")  # the first Redis: nothing to reconcile
    claimed = rs.started  # a ready notice is claimed from run-a
    assert not rs.missed_since(claimed)
    rs.journal.add("ack", "before")
    reconcile = asyncio.create_task(rs.seen("run-b"))
    await asyncio.sleep(0)  # it has its copy of the journal and waits to load scripts
    rs.journal.add("tokens", "first token")  # the pull ends now
    assert rs.missed_since(claimed)
    gate.set()
    assert await reconcile
    assert written == ["before"]  # the first token was not in the replay: the pod writes it itself
    later = rs.started  # a notice claimed from run-b: the next reconcile (if any) replays it
    rs.journal.add("tokens", "another")
    assert not rs.missed_since(later)
