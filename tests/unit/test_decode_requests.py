"""The decode pod's request table (decode_svc/requests.py): seats, stages, entries and cancels,
without an engine or Redis. The engine loop's own tests (test_decode_loop.py) drive it with a
real engine; these pin the bookkeeping every stage relies on."""
from __future__ import annotations

from decode_svc.requests import Active, RequestTable, Stage
from tandem_core.types import GenerationRequest, SamplingParams


def _active(rid: str, slot: int) -> Active:
    return Active(GenerationRequest(rid, [1, 2], 8, SamplingParams()), slot, prompt_len=2)


def test_every_stage_holds_its_seat_until_the_request_finishes():
    t = RequestTable(2)
    assert t.reserve(5) == 2 and t.reserve(1) == 0  # tickets: never more than the slots
    a = t.claim("a", ("ready", b"1-0"))
    t.unreserve()  # the claim found one entry: the other ticket goes back
    assert t.reserve(1) == 1 and t.reserve(1) == 0  # the claimed record keeps its seat
    t.unreserve()
    assert t.stages() == {"claimed": 1, "pulling": 0, "queued": 0, "running": 0}
    assert t.advance(a, Stage.PULLING) and t.advance(a, Stage.QUEUED)
    assert t.pending == 1 and t.used == 0
    t.start(a, _active("a", t.free_slot_index()))
    assert (t.used, t.pending, t.rows(), t.free) == (1, 0, 1, 1)
    assert [x.req.request_id for x in t.snapshot()] == ["a"]
    assert t.reserve(2) == 1  # one slot left
    t.unreserve()
    act = t.release(0)
    assert act.done and t.used == 0 and t.stages()["running"] == 0 and t.reserve(2) == 2


def test_an_entry_in_flight_is_not_started_twice_until_it_is_acked():
    t = RequestTable(4)
    t.reserve(2)
    assert t.claim("a", ("ready", b"1-0")) is not None
    assert t.claim("a", ("ready", b"1-0")) is None  # delivered again: its ticket is given back
    assert t.pending == 1 and t.busy_entries("ready") == {b"1-0"} and t.busy_entries("direct") == set()
    t.entry_done(("ready", b"1-0"))
    t.reserve(1)
    assert t.claim("a", ("ready", b"1-0")) is not None  # acked: a new delivery is new work


def test_cancel_reaches_the_engine_only_for_queued_and_running_requests():
    t = RequestTable(4)
    t.reserve(3)
    pulling, queued, running = t.claim("p"), t.claim("q"), t.claim("r")
    t.advance(pulling, Stage.PULLING)
    t.advance(queued, Stage.QUEUED)
    t.advance(running, Stage.QUEUED)
    t.start(running, _active("r", 0))
    assert sorted(t.request_ids()) == ["p", "q", "r"]
    # the cancel watch polls only these: a running request's cancel is read with its tokens' write
    assert sorted(t.request_ids(running=False)) == ["p", "q"]
    assert t.cancel({"p", "q", "r", "gone"}) == {"q", "r"}
    assert t.cancelled(pulling) and not t.advance(pulling, Stage.QUEUED)  # the pull sees the mark
    t.drop(pulling)
    assert not t.cancelled(pulling) and sorted(t.request_ids()) == ["q", "r"]


def test_the_choices_of_a_local_prefill_take_their_parents_seat_then_their_own():
    t = RequestTable(2)
    t.reserve(1)
    parent = t.claim("n3")
    t.advance(parent, Stage.QUEUED)
    choices = [t.queue_choice(f"n3~{i}") for i in range(3)]
    t.drop(parent)
    assert t.stages()["queued"] == 3 and t.reserve(1) == 0  # held choices keep claims out
    t.start(choices[0], _active("n3~0", 0))
    t.start(choices[1], _active("n3~1", 1))
    assert t.free == 0 and t.pending == 1
    t.release(1)
    t.start(choices[2], _active("n3~2", 1))
    t.release(0)
    t.release(1)
    assert t.pending == 0 and t.used == 0 and t.reserve(2) == 2
