"""When a worker may read a peer's missing heartbeat as its death (tandem_core.lifecycle.PeerJudge):
only after a whole heartbeat TTL of unbroken contact with the same Redis."""
from __future__ import annotations

from tandem_core.lifecycle import PeerJudge, heartbeat_ttl_s
from tests.unit.clock import Clock



def test_a_fresh_worker_waits_a_ttl_before_judging_peers():
    clock = Clock()
    j = PeerJudge(3.0, clock)
    assert not j.trusted  # no beat yet
    j.beat_ok("r1")
    clock.t += 2.9
    j.beat_ok("r1")
    assert not j.trusted
    clock.t += 0.2
    assert j.trusted


def test_an_outage_restarts_the_wait():
    clock = Clock()
    j = PeerJudge(3.0, clock)
    j.beat_ok("r1")
    clock.t += 10
    assert j.trusted
    j.beat_failed()  # Redis did not answer: every peer's entry may expire meanwhile
    assert not j.trusted
    clock.t += 5
    j.beat_ok("r1")  # back: the peers beat again within a TTL
    assert not j.trusted
    clock.t += 3
    assert j.trusted


def test_a_restart_between_two_beats_is_seen_by_its_run_id():
    clock = Clock()
    j = PeerJudge(3.0, clock)
    j.beat_ok("r1")
    clock.t += 10
    j.beat_ok("r2")  # restarted (or failed over) faster than a beat: entries may have been lost
    assert not j.trusted
    clock.t += 3
    j.beat_ok("r2")
    assert j.trusted


def test_ttl_follows_the_interval():
    assert heartbeat_ttl_s(0.5) == 3 and heartbeat_ttl_s(2.0) == 10
