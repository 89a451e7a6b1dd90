"""Cache-aware routing to decode pods (gateway/decode_route.py): a conversation's next turn goes to
the decode pod that decoded its last one, while that pod has room; cold prompts spread by room."""
from __future__ import annotations

from gateway.cluster_view import ClusterView, DecodeRoom
from gateway.decode_route import DecodeRouter


def _rooms(**free: int) -> tuple[DecodeRoom, ...]:
    """Steerable paged pods with `free` rows each and blocks to spare."""
    return tuple(DecodeRoom(n, 1000, 16, worker_id=pod, affinity=True) for pod, n in free.items())


TURN1 = list(range(100, 164))  # 4 blocks of 16


def test_the_next_turn_goes_to_the_pod_of_the_last():
    router = DecodeRouter(block_size=16)
    first = router.choose(TURN1, _rooms(a=4, b=4))
    assert first.pod is not None and first.reason == "roomiest"
    other = "b" if first.pod == "a" else "a"
    turn2 = TURN1 + list(range(500, 540))
    # a fresh read of the rooms, where the other pod has more room now: the match still wins
    again = router.choose(turn2, _rooms(**{first.pod: 1, other: 4}))
    assert (again.pod, again.reason, again.matched_blocks) == (first.pod, "prefix_hit", 4)


def test_a_full_pod_loses_the_turn_to_the_roomiest_and_the_index_follows():
    router = DecodeRouter(block_size=16)
    assert router.choose(TURN1, _rooms(a=4, b=0)).pod == "a"
    turn2 = TURN1 + list(range(500, 540))
    moved = router.choose(turn2, _rooms(a=0, b=3))
    assert (moved.pod, moved.reason) == ("b", "roomiest")
    turn3 = turn2 + list(range(700, 720))
    assert router.choose(turn3, _rooms(a=4, b=4)).pod == "b"  # the blocks are b's now


def test_a_burst_of_cold_prompts_spreads_by_room_until_none_is_left():
    router = DecodeRouter(block_size=16)
    rooms = _rooms(a=2, b=1)  # one read of the registry for the whole burst
    pods = [router.choose([i] * 32, rooms).pod for i in range(4)]
    assert sorted(p for p in pods if p) == ["a", "a", "b"], pods
    assert pods[-1] is None
    assert router.choose([9] * 32, rooms).reason == "busy"


def test_only_pods_that_read_their_own_ready_stream_are_steered_to():
    router = DecodeRouter(block_size=16)
    mixed = (DecodeRoom(4, 1000, 16, worker_id="old", affinity=False),) + _rooms(a=1)
    assert router.choose(TURN1, mixed).reason == "single_pod"
    assert router.choose(TURN1, mixed + _rooms(b=1)).pod in ("a", "b")
    assert DecodeRouter(enabled=False).choose(TURN1, _rooms(a=1, b=1)).reason == "off"
    assert router.choose([1, 2, 3], _rooms(a=1, b=1)).reason == "short"  # not one whole block


def test_the_cluster_view_reads_who_is_steerable_from_the_heartbeat():
    def pod(wid: str, affinity) -> dict:
        extra = {"kv": {"layout": "paged", "blocks_free": 64, "block_size": 16}}
        if affinity is not None:
            extra["ready_affinity"] = affinity
        return {"id": wid, "role": "decode", "free_slots": 2, "extra": extra}

    view = ClusterView.of([pod("d1", True), pod("d2", False), pod("d3", None)])
    assert [(r.worker_id, r.affinity) for r in view.decode_rooms] == [("d1", True), ("d2", False), ("d3", False)]
