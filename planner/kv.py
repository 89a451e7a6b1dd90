"""What a decode pod's KV holds, as its heartbeat says: how many sequences of a given length one
pod can run at once, whatever its step time would allow.

A decode pod's batch is bounded twice: by the ITL target (the profile's step time, planner/decide.py)
and by its KV. On the slot layout every row had `max_len` positions set aside when the engine was
built, so the KV holds `rows` sequences of any length. On the paged layout the rows share a pool of
`blocks_total` blocks of `block_size` positions, and decode_svc/blocks.py (`BlockBudget`) admits a
sequence while its blocks, ceil(positions / block_size), plus a reserve of `reserve_blocks` for
every running row are free. So at a mean of L positions a sequence, the pool holds
    blocks_total // (ceil(L / block_size) + reserve_blocks)
sequences, never more than its rows, and never fewer than one (an empty pod always takes one: the
pool holds at least one `max_len` sequence).

Where it comes from: each decode pod's registry entry (decode_svc/app.py) has `slots` (its rows)
and `free_slots`; a paged pod's `extra.kv` is `BlockBudget.summary()`: layout, block_size,
blocks_total, blocks_free, blocks_used and (pods from this change on) reserve_blocks. An older
paged pod without reserve_blocks is read at one block a row, the least `BlockBudget` ever keeps.

It knows nothing of Redis or of the decision: signals.py hands it the heartbeats, decide.py asks it
how many sequences fit. Pure.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

LAYOUTS = ("slots", "paged")


@dataclass(frozen=True)
class KVCapacity:
    """The KV of one decode pod of a pool (the smallest, see `pool_capacity`), and how full the
    pool's KV is now.

    `used` is for the record and the gauges only: the sizing reads the capacity, not the usage (a
    full pool is what the planner is trying to size away, not a sign that it needs less)."""

    layout: str  # "slots" | "paged"
    rows: int  # sequences the pod runs at most (its request table's rows)
    block_size: int = 0  # positions a block (paged; 0 on the slot layout)
    blocks_total: int = 0  # blocks of the pod's pool (paged)
    reserve_blocks: int = 0  # blocks kept free for every running row's growth (paged)
    used: float | None = None  # the pool's pods' mean share of their KV in use now (blocks; rows on slot pods)
    pods: int = 1  # decode pods it was read from

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"KV layout {self.layout!r}: want one of {LAYOUTS}")
        if self.rows < 1:
            raise ValueError(f"KV capacity of {self.rows} rows: want at least 1")
        if self.layout == "paged" and (self.block_size < 1 or self.blocks_total < 1 or self.reserve_blocks < 0):
            raise ValueError(f"paged KV with block_size {self.block_size}, blocks_total {self.blocks_total}, "
                             f"reserve_blocks {self.reserve_blocks}: want sizes >= 1 and a reserve >= 0")

    def blocks_for(self, positions: float) -> int:
        """Blocks one sequence of `positions` positions holds, its reserve included (paged)."""
        return math.ceil(max(0.0, positions) / self.block_size - 1e-9) + self.reserve_blocks

    def sequences(self, positions: float) -> int:
        """How many sequences of `positions` positions one pod runs at once (>= 1)."""
        if self.layout == "slots":
            return self.rows
        return max(1, min(self.rows, self.blocks_total // max(1, self.blocks_for(positions))))


def pod_capacity(slots: int, free_slots: int, extra: Mapping) -> KVCapacity | None:
    """One decode pod's capacity from its registry entry (`slots`, `free_slots`, `extra`); None
    when it says nothing usable (no rows, or a malformed `kv`)."""
    if slots < 1:
        return None
    kv = extra.get("kv")
    if not isinstance(kv, Mapping) or kv.get("layout") != "paged":
        return KVCapacity("slots", rows=slots, used=max(0, slots - free_slots) / slots)
    try:
        total, size = int(kv["blocks_total"]), int(kv["block_size"])
        free = int(kv.get("blocks_free", total))
        reserve = int(kv.get("reserve_blocks", 1))
        return KVCapacity("paged", rows=slots, block_size=size, blocks_total=total, reserve_blocks=reserve,
                          used=max(0, total - free) / total)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def pool_capacity(pods: Iterable[KVCapacity]) -> KVCapacity | None:
    """The capacity the planner sizes a pool's decode pods with: the smallest pod's.

    A pool's decode pods come from one Deployment, so they are alike but during a rollout (a new
    slot count, block pool or layout). The planner multiplies one pod's rate by a pod count, and the
    pods it adds are of whichever spec the Deployment has now, so the mean would count on KV that a
    pod it is sizing may not have; the smallest never does, and at worst asks for a pod too many
    while a rollout lasts. So: the fewest rows of any pod, and if any pod is paged, the paged pool
    with the fewest positions (blocks_total x block_size) with its block size and reserve. The two
    minima come from two different pods only during such a rollout; then the result is below every
    pod's capacity, which is the safe side. None: no pod said anything."""
    pods = list(pods)
    if not pods:
        return None
    rows = min(p.rows for p in pods)
    used = [p.used for p in pods if p.used is not None]
    mean_used = sum(used) / len(used) if used else None
    paged = [p for p in pods if p.layout == "paged"]
    if not paged:
        return KVCapacity("slots", rows=rows, used=mean_used, pods=len(pods))
    small = min(paged, key=lambda p: (p.blocks_total * p.block_size, -p.reserve_blocks))
    return KVCapacity("paged", rows=rows, block_size=small.block_size, blocks_total=small.blocks_total,
                      reserve_blocks=small.reserve_blocks, used=mean_used, pods=len(pods))
