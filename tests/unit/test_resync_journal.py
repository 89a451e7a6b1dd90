"""The decode pod's journal of its own recent writes (decode_svc/resync.py): pruned to the last
`window_s` only when told Redis is the same one, so an outage does not age it out."""
from __future__ import annotations

from decode_svc import resync
from decode_svc.resync import Journal
from tests.unit.clock import Clock



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
