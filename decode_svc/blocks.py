"""A decode pod's KV capacity in blocks: the JetStream rule "pull only when a slot is free" said in
memory.

A row holds only the blocks its sequence has written so far, and the pool (`engine.kv_blocks_total`) is shared by every row, so capacity is two numbers:
free rows (the request table's seats) and free blocks. The rules, in one place:

- **Claim** (decode_svc/claims.py, the event loop): a ready notice or prompt is claimed only while
  the blocks not yet spoken for cover its prompt plus the reserve: free blocks, less the prompt
  blocks of every request claimed and not yet in a row (`RequestTable.promised_blocks`), less the
  reserve of every row running or on its way. A claim reads its entries before their prompt
  lengths are known, so a round claims as many as fit at the largest prompt seen lately
  (`estimate`), and `max_len`'s before any is seen; the next round counts the true lengths. An
  empty pod always claims one (the pool holds at least one `max_len` sequence: EngineConfig).
- **Insert** (decode_svc/loop.py, the engine thread): a claimed request whose blocks are not free
  once it is pulled (the pool moved since the claim: rows grew) waits in the thread's held queue
  and goes in when blocks free up (`fits`); oldest first.
- **Reserve**: `reserve_steps` positions of growth for every running row, in blocks
  (ceil(reserve_steps / block size) each; default the engine's `steps_per_dispatch`, so one more
  dispatched call of every row is always covered). It keeps a new claim from forcing a hand-back
  at the very next call; growth past it is met by handing the newest request back
  (decode_svc/loop.py `_make_room`), so the reserve trades rows admitted against hand-backs (each a
  re-prefill elsewhere), and a larger one only makes hand-backs rarer.

Reads of the engine's free count from the event loop race the engine thread: a count one call old
at worst, which the held queue absorbs.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type only: no JAX import
    from tandem_engine.api import ServingEngine


class BlockBudget:
    def __init__(self, engine: ServingEngine, reserve_steps: int, recent: int = 32) -> None:
        self.engine = engine
        self.block_size = int(engine.kv_block_size)
        self.total = int(engine.kv_blocks_total)
        self.per_row = -(-max(1, int(reserve_steps)) // self.block_size)  # reserve blocks per running row
        self.max_prompt = self.blocks_for(engine.max_len)
        self._recent: deque[int] = deque(maxlen=recent)  # prompt blocks of the latest claims

    @classmethod
    def of(cls, engine: ServingEngine, reserve_steps: int | None = None) -> BlockBudget:
        """The engine's budget. `reserve_steps` None: the engine's steps_per_dispatch."""
        return cls(engine, engine.steps_per_dispatch if reserve_steps is None else reserve_steps)

    def blocks_for(self, length: int) -> int:
        return -(-max(0, int(length)) // self.block_size)

    def free(self) -> int:
        return int(self.engine.kv_blocks_free())

    def reserve(self, rows: int) -> int:
        """The reserve for `rows` rows running or on their way."""
        return self.per_row * max(0, rows)

    def note(self, prompt_blocks: int) -> None:
        """A claimed request's prompt blocks: the next rounds' estimate."""
        self._recent.append(prompt_blocks)

    @property
    def estimate(self) -> int:
        """Blocks a claim is counted at before its entry is read: the largest prompt of the latest
        claims, `max_len`'s before any."""
        return max(self._recent, default=self.max_prompt)

    def claimable(self, rows_held: int, promised: int, in_flight: int) -> int:
        """How many entries one claim may take now: `rows_held` rows running or on their way
        (records of the request table), `promised` the prompt blocks of those not running yet,
        `in_flight` tickets already out (counted at the estimate)."""
        per = self.estimate + self.per_row
        spare = self.free() - promised - self.reserve(rows_held) - in_flight * per
        if rows_held == 0 and in_flight == 0:  # an empty pod takes one whatever its size
            return max(1, spare // per)
        return max(0, spare // per)

    def fits(self, length: int, running: int, have: int = 0) -> bool:
        """Whether a prompt of `length` positions goes into a row now, beside `running` rows, with
        the reserve of each (the new one's too) left free; always when no row runs. `have`: blocks
        of it the request holds already (a match of the pool's block cache, pinned: not free)."""
        need = max(0, self.blocks_for(length) - int(have))
        free = self.free()
        return need <= free if running == 0 else need + self.reserve(running + 1) <= free

    def summary(self) -> dict:
        free = self.free()
        # reserve_blocks: what every running row keeps free (the planner's sequences-per-pod rule reads it)
        out = {"layout": "paged", "block_size": self.block_size, "blocks_total": self.total, "blocks_free": free,
               "blocks_used": self.total - free, "reserve_blocks": self.per_row}
        group = self.engine.window_group_summary()
        if group is not None:  # windowed layers beside global ones: their own blocks, never short
            out["window_group"] = group
        return out
