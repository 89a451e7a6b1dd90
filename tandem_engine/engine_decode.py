"""The Engine's decode side: a `DecodeState` of `slots` sequence rows over one pool of KV blocks,
a `Prefix` inserted into a free row, one step for every row in use, and the row freed (its blocks
back to the pool) when its request finishes.

What a decode pod runs on its engine thread. Steps 3-5 of the request's life in engine.py's
docstring; the states passed in are donated (the KV cache is updated in place).
No I/O, no tokenizer, no settings here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tandem_core.errors import OutOfKVBlocks, PromptTooLong
from tandem_core.types import SamplingParams
from tandem_core.types import KVPayload
from tandem_engine.cores import (CoreCall, DecodeState, begin_core, free_core, generate_core, insert_paged_core,
                                 ragged_core)
from tandem_core.prefix import block_hashes
from tandem_engine.block_cache import PrefixMatch
from tandem_engine.engine_base import EngineBase
from tandem_engine.engine_prefill import Prefix
from tandem_engine.logits import history_arrays, init_slot_logits, mask_rows, slot_logits
from tandem_engine.paged import paged_pool
from tandem_engine.sampling import sampling_arrays


@dataclass
class PendingPrompt:
    """A prompt seated in a row by `begin_prompt`, prefilled a chunk a call by `generate_ragged`."""

    slot: int
    ids: list[int]
    done: int = 0  # prompt tokens whose KV is written


@dataclass
class RaggedOut:
    """What `generate_ragged` returns beside the state: the decode rows' tokens (as `generate`'s,
    on the device), and when the call ended a prompt, its row and first token packed
    [PACKED_WIDTH] (logits.unpack_tokens / unpack_logprobs read it)."""

    tokens: jax.Array
    slot: int | None = None  # the row whose prompt this call ended
    first: jax.Array | None = None


class DecodeSide(EngineBase):
    """Slots: init_state, insert, reserve, generate, free (see engine.Engine for the calling rules).

    The KV: `slots` is the number of sequence rows, and their KV sits in `kv_blocks_total` blocks
    of `kv_block_size` positions shared by all rows (paged.py). The calling rules: insert takes
    `kv_blocks_for(true_length)` free blocks (OutOfKVBlocks when fewer are free: the state is
    then untouched); `reserve(state, steps)` gives every active row the blocks its next `steps`
    positions fall in, oldest first, and says which rows could not get theirs (a service calls it
    before each generate and hands those rows back); generate reserves what a caller did not
    (RuntimeError when the pool is short: the caller must free rows first); free returns a row's
    blocks. The block accounting is the engine's host state, for one DecodeState at a time:
    init_state starts it afresh (every block free), so a state made before is not to be used
    after."""

    def init_state(self) -> DecodeState:
        """An all-free DecodeState; the KV pool is allocated here, once, and every block goes
        back to the free list."""
        c, s, lay = self.cfg, self.slots, self.layout
        dev = None if lay is None else lay.replicated()
        self._reset_kv_host()
        # one pool of blocks, a buffer per layer (paged.py); tp: each chip allocates only its heads
        # (a family with windowed and global layers: the windowed layers' buffers hold their group's blocks)
        layer_blocks = None if self._window is None else [
            self._window.total if w else self.kv_blocks_total for w in self.windowed]
        k, v = paged_pool(c.num_layers, c.num_kv_heads, self.kv_blocks_total, self.kv_block_size, c.head_dim,
                          self._kv_jdtype, None if lay is None else lay.kv_pool(), layer_blocks)
        table = self._table_array()
        state = DecodeState(
            k=k,
            v=v,
            positions=jnp.zeros((s,), jnp.int32, device=dev),
            tokens=jnp.zeros((s,), jnp.int32, device=dev),
            active=jnp.zeros((s,), jnp.bool_, device=dev),
            step=jnp.zeros((s,), jnp.int32, device=dev),
            temperature=jnp.zeros((s,), jnp.float32, device=dev),
            top_k=jnp.zeros((s,), jnp.int32, device=dev),
            top_p=jnp.ones((s,), jnp.float32, device=dev),
            seeds=jnp.zeros((s, 2), jnp.uint32, device=dev),
            history=jnp.zeros((s, c.vocab_size), jnp.int32, device=dev),
            processing=init_slot_logits(s, c.vocab_size, dev),
            block_table=table,
            window_table=self._window_array(),
        )
        if lay is None:  # committed to the device, as every core's outputs are (weights read from a
            # checkpoint are committed): an uncommitted state is another jit cache key for every core
            # it goes through, so a pod compiled inserts, frees and steps again while serving
            # (bench/paged_capacity.py's slot loop: 6 compiles after its warm-up, 8 s of CPU)
            state = jax.device_put(state, jax.devices()[0])
        return state

    def _check_slot(self, slot: int) -> None:
        if not 0 <= int(slot) < self.slots:
            raise ValueError(f"slot {slot} is out of range [0, {self.slots})")

    def insert(self, prefix: Prefix, state: DecodeState, slot: int, sampling: SamplingParams, *,
               first_token: int | None = None, history: Sequence[int] | None = None,
               output_from: int | None = None, start_index: int = 0,
               stop_ids: Sequence[int] = ()) -> DecodeState:
        """Write `prefix` into `slot` (donates `state`) with the request's sampling and processing
        params. `first_token` (default prefix.first_token: choice i inserts its own) is token index
        `start_index`; the slot's next step produces start_index + 1.

        `history`: the prompt ids the prefix holds (len == prefix.true_length), the penalty state:
        repetition sees all of it, presence/frequency count history[output_from:] (the output so
        far; default none) plus the first token. None: nothing seen but the first token."""
        self._check_slot(slot)
        k, v = self._prefix_kv(prefix, state)
        return self._insert(state, k, v, slot, prefix.true_length, prefix.first_token, sampling, first_token,
                            history, output_from, start_index, stop_ids)

    def insert_call(self, prefix: Prefix, state: DecodeState, slot: int, sampling: SamplingParams) -> CoreCall:
        """The one jitted call `insert(prefix, state, slot, sampling)` makes, with its arguments
        (aot.py lowers it). The row takes its blocks here, as `insert` does (run the call, or free
        the slot)."""
        self._check_slot(slot)
        k, v = self._prefix_kv(prefix, state)
        length = k.shape[1]
        args = self._insert_args(length, slot, prefix.true_length, prefix.first_token, sampling, None, None, None,
                                 0, ())
        return self._insert_call(state, k, v, int(slot), length, int(prefix.true_length), args)

    def _prefix_kv(self, prefix: Prefix, state: DecodeState):
        k, v = prefix.k, prefix.v
        if self.layout is not None:  # a prefix from an engine on other chips moves here first
            k, v = self._place_kv(k), self._place_kv(v)
        elif isinstance(k, jax.Array) and len(k.devices()) > 1:  # a sharded prefix handed to an unsharded engine
            k, v = jax.device_put(k, state.positions.sharding), jax.device_put(v, state.positions.sharding)
        return k, v

    def insert_payload(self, payload: KVPayload, state: DecodeState, slot: int, sampling: SamplingParams, *,
                       first_token: int | None = None, history: Sequence[int] | None = None,
                       output_from: int | None = None, start_index: int = 0,
                       stop_ids: Sequence[int] = (), cached: PrefixMatch | None = None) -> DecodeState:
        """`insert(import_prefix(payload), ...)` in one move (donates `state`): what a decode pod
        does with a pulled KV. On one device the host arrays go straight into the insert call
        (its argument transfer; no separate device_put, no jnp.asarray conversion of each: ~80 us
        of host CPU per payload saved); with a layout, import_prefix places them on the chips.

        `cached` (`match_prefix`): the blocks of the prompt's first `cached.length`
        positions, already in the pool; the payload then holds the rest (`payload.start ==
        cached.length`), and the row shares those blocks (no copy). A payload that starts at 0
        anyway (a prefill pod that sent it whole) goes in whole and the match is released.
        Either way the match is used up (unless the insert raises: then it is still the caller's)."""
        if cached is not None or payload.start:
            return self._insert_reused(payload, state, slot, sampling, cached, first_token=first_token,
                                       history=history, output_from=output_from, start_index=start_index,
                                       stop_ids=stop_ids)
        if self.layout is not None:
            return self.insert(self.import_prefix(payload), state, slot, sampling, first_token=first_token,  # type: ignore[attr-defined]
                               history=history, output_from=output_from, start_index=start_index,
                               stop_ids=stop_ids)
        self._check_slot(slot)
        self.check_payload(payload)
        k, v = payload.k, payload.v
        if k.dtype != self._jdtype:  # (on the host: one conversion, then the call's transfer)
            k, v = np.asarray(k, self._jdtype), np.asarray(v, self._jdtype)
        return self._insert(state, k, v, slot, int(payload.true_length), int(payload.first_token), sampling,
                            first_token, history, output_from, start_index, stop_ids)

    def _insert_reused(self, payload: KVPayload, state: DecodeState, slot: int, sampling: SamplingParams,
                       cached: PrefixMatch | None, **kw) -> DecodeState:
        """`insert_payload` of a part (payload.start > 0) over the blocks of a match, or of a
        whole payload with a match not needed."""
        start = int(payload.start)
        if cached is not None and cached.done:
            raise ValueError("this prefix match was inserted or released already")
        if start == 0:  # sent whole: the match is not needed
            if cached is not None:
                self.release_prefix(cached)
            return self.insert_payload(payload, state, slot, sampling, **kw)
        if cached is None or cached.length != start:
            raise ValueError(f"a KV payload from position {start} needs the match of its first {start} positions "
                             f"(got {None if cached is None else cached.length})")
        self._check_slot(slot)
        self.check_payload(payload)
        n = int(payload.true_length)
        # padded to the whole prompt's bucket: the insert's compiled shapes are a full prompt's
        # (its rows past the part go to the null block)
        rows = self.bucket_for(n)
        k = np.zeros((payload.k.shape[0], rows, *payload.k.shape[2:]), self._jdtype)
        v = np.zeros_like(k)
        part = payload.k.shape[1]
        k[:, :part], v[:, :part] = payload.k, payload.v
        if self.layout is not None:  # onto the chips by head, as import_prefix places a whole payload
            k, v = self._place_kv(k), self._place_kv(v)
        return self._insert(state, k, v, slot, n, int(payload.first_token), sampling, kw.get("first_token"),
                            kw.get("history"), kw.get("output_from"), kw.get("start_index", 0),
                            kw.get("stop_ids", ()), cached=cached)

    def _insert(self, state: DecodeState, k, v, slot: int, true_length: int, prefix_first: int,
                sampling: SamplingParams, first_token: int | None, history: Sequence[int] | None,
                output_from: int | None, start_index: int, stop_ids: Sequence[int],
                cached: PrefixMatch | None = None) -> DecodeState:
        """k, v [L, length, KV, hd] (device arrays, or host arrays on one device) into `slot`."""
        length = k.shape[1]
        args = self._insert_args(length, slot, true_length, prefix_first, sampling, first_token, history,
                                 output_from, start_index, stop_ids)
        return self._insert_call(state, k, v, int(slot), length, int(true_length), args, cached)()

    def _insert_call(self, state: DecodeState, k, v, slot: int, length: int, true_length: int, args: tuple,
                     cached: PrefixMatch | None = None) -> CoreCall:
        return self._insert_paged(state, k, v, slot, length, true_length, args, cached)

    def _insert_args(self, length: int, slot: int, true_length: int, prefix_first: int, sampling: SamplingParams,
                     first_token: int | None, history: Sequence[int] | None, output_from: int | None,
                     start_index: int, stop_ids: Sequence[int]) -> tuple:
        """insert_core's arguments after (state, k, v), checked: a prefix of `length` positions."""
        if length > self.max_len:
            raise PromptTooLong(f"prefix has {length} positions; this engine's max_len is {self.max_len}")
        first = int(prefix_first if first_token is None else first_token)
        if not 0 <= first < self.info.vocab_size:
            raise ValueError(f"first token {first} is outside the vocabulary [0, {self.info.vocab_size})")
        s = sampling_arrays(sampling)
        proc = slot_logits(sampling, self.info.vocab_size, stop_ids)
        hist_ids, hist_len, out_from = history_arrays(history, output_from, true_length, length,
                                                      self.info.vocab_size)
        return (np.int32(slot), np.int32(true_length), np.int32(first), np.int32(int(start_index) + 1),
                s["temperature"], s["top_k"], s["top_p"], s["seed"], hist_ids, np.int32(hist_len),
                np.int32(out_from), proc)

    def begin_prompt(self, state: DecodeState, slot: int, ids: Sequence[int], sampling: SamplingParams, *,
                     output_from: int | None = None, start_index: int = 0,
                     stop_ids: Sequence[int] = (), cached: PrefixMatch | None = None) -> DecodeState:
        """Seat prompt `ids` in free row `slot` (donates `state`) to be prefilled by
        `generate_ragged`, a chunk of `prefix_chunk` tokens a call beside the decode rows (vLLM's
        chunked prefill, in the step's own attention: cores.ragged_core). Takes the prompt's blocks
        now (OutOfKVBlocks, state untouched, when they are not free). The row stays out of the
        decode batch until the call that ends its prompt samples its first token (token index
        `start_index`, as `prefill` would with the same params: the penalty state sees the prompt,
        `output_from` on counted). One prompt at a time per row; prompts go in the order begun.
        `cached` (`match_prefix(ids)`): the row's first blocks are the match's (shared, its pins
        pass to the row) and the chunks start after them; without it, or when it does not match
        `ids`' length, the whole prompt is computed (a match of another length is released)."""
        self._check_slot(slot)
        n = len(ids)
        if not 0 < n < self.max_len:
            raise PromptTooLong(f"prompt has {n} tokens; this engine's rows hold max_len {self.max_len} positions "
                                f"(a prompt needs at least one free)")
        if slot in self._pending or self._occupied[slot]:
            raise ValueError(f"slot {slot} holds a sequence already")
        args = list(self._insert_args(self.max_len, slot, n, 0, sampling, None, list(ids), output_from, start_index,
                                      stop_ids))
        args[2] = np.int32(self.info.vocab_size)  # no first token yet: nothing counted for it
        if cached is not None and cached.done:
            raise ValueError("this prefix match was inserted or released already")
        if cached is not None and not 0 < cached.length < n:
            self.release_prefix(cached)
            cached = None
        with self._blocks_lock:
            shared = [] if cached is None else list(cached.blocks)
            need = self.kv_blocks_for(n) - len(shared)
            if need > self.kv_blocks_free():
                raise OutOfKVBlocks(f"this decode engine has {self.kv_blocks_free()} free KV blocks of "
                                    f"{self.kv_block_size} positions; a prompt of {n} positions needs {need}",
                                    retry_after_s=1.0)
            self._release_row(slot)
            if self._window is not None and cached is not None:  # the match's windowed tail
                self._window.place(slot, cached.window_from, cached.window_blocks)
            got = self._alloc_blocks(need)
            assert got is not None
            held = len(shared) + need
            self._table[slot, :held] = shared + got
            self._held[slot] = held
            self._pos[slot] = n
            if cached is not None:
                cached.done = True  # its pins are the row's references now
        self._pending[slot] = PendingPrompt(slot, list(ids), done=0 if cached is None else cached.length)
        state = self._with_tables(state)
        return begin_core(state, *args)

    def generate_ragged(self, state: DecodeState, rows: int | None = None, *,
                        logprobs: bool = False) -> tuple[DecodeState, RaggedOut]:
        """One call (donates `state`): a step of the decode rows, as `generate(state, rows)`, and
        the next chunk of the oldest prompt `begin_prompt` seated, in one ragged batch. No prompt
        pending: `generate`'s step. The row whose prompt this chunk ends joins the decode rows
        (keep it below `rows` from the next call on)."""
        if not self._pending:
            state, tokens = self.generate(state, rows, logprobs=logprobs)
            return state, RaggedOut(tokens)
        if self._short_rows(1):
            state, failed = self.reserve(state, 1)
            if failed:
                raise RuntimeError(f"slots {failed} have no KV blocks for their next position and the pool has too "
                                   f"few free: free some slots and call generate_ragged again")
        p = next(iter(self._pending.values()))
        c = self.prefix_chunk
        n = min(c, len(p.ids) - p.done)
        if self._window is not None:  # the chunk's windowed blocks: its window back to done - W + 1
            with self._blocks_lock:
                if self._window.fit(p.slot, p.done - self._window.window + 1, p.done + n - 1):
                    state = self._with_tables(state)
        chunk = np.zeros(c, np.int32)
        chunk[:n] = p.ids[p.done:p.done + n]
        final = p.done + n == len(p.ids)
        new, tokens, packed, first = ragged_core(self.step_params, state, chunk, np.int32(p.done), np.int32(n),
                                                 np.int32(p.slot), np.bool_(final), np.bool_(logprobs), cfg=self.cfg,
                                                 layout=self.layout, rows=self.rows_for(rows), max_len=self.max_len,
                                                 table_blocks=self.max_blocks_per_seq)
        if logprobs:
            tokens = packed
        self._pos[self._occupied] += 1
        p.done += n
        if not final:
            return new, RaggedOut(tokens)
        del self._pending[p.slot]
        self._occupy(p.slot)
        return new, RaggedOut(tokens, p.slot, first)

    @property
    def prompts_pending(self) -> int:
        """Prompts `begin_prompt` seated that `generate_ragged` has not finished."""
        return len(self._pending)

    def _occupy(self, slot: int) -> None:
        self._occupied[slot] = True
        self._inserted += 1
        self._order[slot] = self._inserted

    def _insert_paged(self, state: DecodeState, k, v, slot: int, length: int, true_length: int,
                      args: tuple, cached: PrefixMatch | None = None) -> CoreCall:
        """Take the prompt's blocks (OutOfKVBlocks before anything changes when too few are
        free; a row still holding blocks gives them back first), write rows [0, length) into
        them (the padding past the last one goes to the null block) and upload the table: the call
        that writes them.
        `cached`: the row's first blocks are the match's (its pins pass to the row) and k, v's
        rows are the positions after them."""
        with self._blocks_lock:
            shared = [] if cached is None else list(cached.blocks)
            need = self.kv_blocks_for(true_length) - len(shared)
            old = self._row_blocks(slot)
            free = self.kv_blocks_free() + self._alloc.exclusive(old)
            if need > free:
                raise OutOfKVBlocks(
                    f"this decode engine has {free} free KV blocks of {self.kv_block_size} positions; a prompt of "
                    f"{true_length} positions needs {need}: free a sequence (or hand this request to another pod) "
                    f"and retry", retry_after_s=1.0)
            self._release_row(slot)
            self._pending.pop(slot, None)  # (a prompt seated there by begin_prompt gives way)
            if self._window is not None and cached is not None:  # the match's windowed tail
                self._window.place(slot, cached.window_from, cached.window_blocks)
            ids = self._alloc_blocks(need)
            assert ids is not None
            held = len(shared) + need
            self._table[slot, :held] = shared + ids
            self._table[slot, held:] = 0
            self._held[slot] = held
            self._pos[slot] = true_length
            if cached is not None:
                cached.done = True  # its pins are the row's references now
            self._occupy(slot)
            write = np.zeros(self.kv_blocks_for(length), np.int32)  # rows past true_length's blocks: null
            write[:need] = ids
            window_write = None
            if self._window is not None:  # the windowed layers: only the blocks the first step's window reaches
                self._window.fit(slot, true_length - self._window.window + 1, true_length - 1)
                # k, v's rows start at the match's end (block len(shared)): the same blocks' windowed ids
                off = len(shared)
                window_write = np.zeros(len(write), np.int32)
                part = self.kv_blocks_for(true_length) - off
                window_write[:part] = self._window.ids_for(slot, off + part)[off:]
        state = self._with_tables(state)
        return CoreCall(insert_paged_core, (state, k, v, write, *args, window_write),
                        dict(layout=self.layout, windowed=self.windowed if window_write is not None else ()))

    def _with_tables(self, state: DecodeState) -> DecodeState:
        """`state` with the host's block tables uploaded (the windowed layers' too, where they
        keep their own: paged.WindowGroup)."""
        return state._replace(block_table=self._table_array(), window_table=self._window_array())

    def _window_array(self) -> jax.Array | None:
        """The windowed layers' table on the device (None: they read the block table)."""
        if self._window is None:
            return None
        return self._table_array(self._window.table)

    def _table_array(self, table: np.ndarray | None = None) -> jax.Array:
        """The host block tables on the device (replicated over the chips under tp: every chip
        reads every row's table). Committed to the device, as the step's outputs are: an
        uncommitted table beside a committed state is another jit cache key, and the step compiled
        again the first time a reserve rebuilt the table mid-decode (a row crossing a block boundary;
        seen in bench/paged_step.py before the warm-up path was taken)."""
        table = self._table if table is None else table
        if self.layout is None:
            return jax.device_put(table, jax.devices()[0])
        return jax.device_put(table, self.layout.replicated())

    def _release_row(self, slot: int, tokens: Sequence[int] | None = None) -> None:
        """The row's blocks back to the pool; with `tokens` (the ids whose KV the row's first
        positions hold) its full blocks are kept for reuse first (block_cache.py)."""
        with self._blocks_lock:
            held = int(self._held[slot])
            if held:
                blocks = self._table[slot, :held].tolist()
                # (a row whose leading blocks a window passed keeps none: a kept chain starts at 0)
                if tokens is not None and self._reuse is not None and blocks[0] != 0:
                    fed = list(tokens)[:int(self._pos[slot])]
                    self._reuse.keep(fed, blocks)
                    if self._window is not None:  # the windowed blocks of the window before the chain's end
                        self._keep_window_tail(slot, fed, len(blocks))
                self._alloc.release([b for b in blocks if b])
            self._table[slot] = 0
            self._held[slot] = 0
            if self._window is not None:
                self._window.release(slot)

    def _keep_window_tail(self, slot: int, fed: list[int], held: int) -> None:
        """Row `slot`'s windowed blocks before its kept chain's end, kept under the chain's last key
        (paged.WindowGroup.keep_tail): a sequence that matches the chain to its end starts on both."""
        assert self._window is not None and self._reuse is not None
        n = min(len(fed) // self.kv_block_size, held)
        if n < 1:
            return
        key = block_hashes(fed, self.kv_block_size, self._reuse.salt, limit=n)[-1]
        if self._reuse.block_of(key) is not None:
            self._window.keep_tail(slot, key, n * self.kv_block_size)

    def _alloc_blocks(self, n: int) -> list[int] | None:
        """`n` blocks from the free list, evicting cached blocks no row holds when it is short."""
        if self._reuse is not None:
            self._reuse.make_room(n)
        return self._alloc.alloc(n)

    def match_prefix(self, ids: Sequence[int]) -> PrefixMatch | None:
        """The blocks of `ids`' longest run of leading full blocks this pool keeps from finished
        rows (with kv_reuse; None otherwise or on a miss), pinned until
        `insert_payload(..., cached=match)` or `release_prefix(match)`. At least the last token
        of `ids` is left out. Callable from another thread than the engine's."""
        if self._reuse is None:
            return None
        with self._blocks_lock:
            if self._window is None:
                return self._reuse.match(ids)
            # windowed layers beside global ones: only a chain's end with its windowed tail kept
            m = self._reuse.match(ids, usable=self._window.usable)
            if m is not None:
                m.window_from, m.window_blocks = self._window.take_tail(m.key)
            return m

    def release_prefix(self, match: PrefixMatch) -> None:
        """Let a match that will not be inserted go (its pull failed, it was cancelled); a used
        or released one is left alone. Callable from another thread than the engine's."""
        if self._reuse is None:
            return
        with self._blocks_lock:
            if self._window is not None and not match.done and match.window_blocks:
                self._window.alloc.release(match.window_blocks)
            self._reuse.release(match)

    def kv_reuse_summary(self) -> dict | None:
        """The block cache's counters (None without one): what a decode pod's heartbeat reports."""
        if self._reuse is None:
            return None
        with self._blocks_lock:
            return self._reuse.summary()

    def window_group_summary(self) -> dict | None:
        """The windowed layers' own blocks (paged.WindowGroup; None without one): what a decode
        pod's heartbeat reports beside the pool's (`extra.kv.window_group`)."""
        if self._window is None:
            return None
        with self._blocks_lock:
            free, tails = self._window.alloc.free_count(), len(self._window._tails)
            held = self._window.total - self._window.free_count()
        # blocks_used: the rows' (and pinned matches'); blocks_kept: not free, held by kept tails only
        return {"layers": sum(self.windowed), "window": self._window.window, "blocks_per_row": self._window.per_row,
                "blocks_total": self._window.total, "blocks_used": held,
                "blocks_kept": self._window.total - free - held, "tails": tails, "tails_taken": self._window.taken}

    def _blocks_needed(self, slot: int, steps: int) -> int:
        """Blocks row `slot` needs for the positions its next `steps` steps write (each clamped
        to max_len - 1, as the step clamps them)."""
        last = min(int(self._pos[slot]) + max(int(steps), 1) - 1, self.max_len - 1)
        return last // self.kv_block_size + 1

    def reserve(self, state: DecodeState, steps: int) -> tuple[DecodeState, list[int]]:
        """Give every active row the blocks its next `steps` steps write, oldest insert first. Returns (the state, the slots that could not get theirs): once one row
        finds too few free blocks, it and every later-inserted row still short go in that list,
        newest last, and none of them gets a partial grant, so handing back the newest frees
        blocks for the older. The caller frees some of them and calls reserve again before
        generate. Does not donate `state` (only its block table changes). With every layer
        windowed (`window_frees`), each row's blocks wholly before the window of its next step go
        back to the pool first (their table entries become the null block, which no step reads:
        the attention reads from the window's first position on)."""
        failed: list[int] = []
        changed = False
        with self._blocks_lock:
            if self.window_frees:
                changed = self._drop_passed_blocks()
            if self._window is not None:  # the windowed layers' blocks follow each row's window
                w = self._window.window
                for slot in np.flatnonzero(self._occupied).tolist():
                    pos = int(self._pos[slot])
                    changed |= self._window.fit(slot, pos - w + 1, min(pos + max(int(steps), 1) - 1, self.max_len - 1))
            for slot in sorted(np.flatnonzero(self._occupied).tolist(), key=lambda s: self._order[s]):
                need = self._blocks_needed(slot, steps)
                extra = need - int(self._held[slot])
                if extra <= 0:
                    continue
                ids = None if failed else self._alloc_blocks(extra)
                if ids is None:
                    failed.append(slot)
                    continue
                self._table[slot, self._held[slot]:need] = ids
                self._held[slot] = need
                changed = True
        if changed:
            state = self._with_tables(state)
        return state, failed

    def can_reserve(self, steps: int) -> bool:
        """Whether `reserve(state, steps)` would give every active row its blocks now (the pool's
        free blocks cover what the rows lack; the windowed group sizes each row's share itself)."""
        with self._blocks_lock:
            lack = sum(max(0, self._blocks_needed(slot, steps) - int(self._held[slot]))
                       for slot in np.flatnonzero(self._occupied).tolist())
            return lack <= self.kv_blocks_free()

    def _drop_passed_blocks(self) -> bool:
        """Every running row's blocks wholly before position `_pos - window_frees + 1` (the first
        its next step attends to) back to the pool. Returns whether a table changed."""
        changed = False
        for slot in np.flatnonzero(self._occupied).tolist():
            first = max(0, int(self._pos[slot]) - self.window_frees + 1) // self.kv_block_size
            passed = [b for b in self._table[slot, :min(first, int(self._held[slot]))].tolist() if b]
            if passed:
                self._alloc.release(passed)
                self._table[slot, :first] = 0
                changed = True
        return changed

    def _row_blocks(self, slot: int) -> list[int]:
        """The blocks row `slot` holds (its table's entries a window has not given back)."""
        return [b for b in self._table[slot, :int(self._held[slot])].tolist() if b]

    def kv_blocks_of(self, slot: int) -> int:
        """Blocks row `slot` holds now (0 when free)."""
        self._check_slot(slot)
        return len(self._row_blocks(slot))

    def generate(self, state: DecodeState, rows: int | None = None, *, logprobs: bool = False,
                 masks: np.ndarray | None = None, steps: int = 1) -> tuple[DecodeState, jax.Array]:
        """One decode step (donates `state`). `rows`: every active slot is below it (None: all
        slots); the step computes the smallest batch bucket >= rows. Returns int32 tokens
        [bucket] still on the device (index by slot): no host round trip here. `logprobs=True`
        (the same compiled step: a traced flag): int32 [bucket, PACKED_WIDTH] instead, tokens and logprobs
        packed (read with logits.unpack_tokens / unpack_logprobs). `masks` (grammars): int32
        [<= bucket, ceil(vocab / 32)] allowed-token bitmasks by slot, all-ones for an
        unconstrained slot (missing rows are padded so); a compiled variant of its own, so a
        batch without masks runs the unmasked step.

        `steps` > 1 (multi-step decode, a compiled variant per count): that many steps in one call,
        tokens [steps, bucket(, PACKED_WIDTH)], row n of a slot the same token its n-th of `steps`
        one-step calls returns. A slot whose position reaches max_len - 1 stays there (its later
        tokens are garbage; nothing past max_len is written); the caller drops a slot's tokens past
        its finish. No `masks` with steps > 1 (a mask needs the token before it)."""
        return self._generate(state, rows, logprobs=logprobs, masks=masks, steps=steps)

    def generate_drafts(self, state: DecodeState, rows: int | None = None, *,
                        steps: int = 1) -> tuple[DecodeState, jax.Array, jax.Array]:
        """`generate` of `steps` steps that also returns, on the device, the distribution each
        token was drawn from: (state, tokens int32 [steps, bucket], q float32 [steps, bucket,
        vocab]) (sampling.distribution; one-hot for a greedy row). What a sampling draft model
        proposes with (draft.py: the verify call needs q). A compiled variant of its own."""
        return self._generate(state, rows, logprobs=False, masks=None, steps=steps, dists=True)

    def _generate(self, state: DecodeState, rows: int | None, *, logprobs: bool, masks: np.ndarray | None,
                  steps: int, table_blocks: int | None = None, dists: bool = False):
        """`generate`; `table_blocks` (warmup) forces the step's table width. Rows a caller did not
        `reserve` for get their blocks here (RuntimeError when the pool cannot give them). With
        `dists`, (state, tokens, q) (`generate_drafts`)."""
        if table_blocks is None:
            if self._short_rows(steps):
                state, failed = self.reserve(state, steps)
                if failed:
                    raise RuntimeError(f"slots {failed} have no KV blocks for their next {steps} positions and the "
                                       f"pool has too few free: free some slots (reserve(state, {steps}) says which) "
                                       f"and call generate again")
            table_blocks = self.max_blocks_per_seq  # checked just now
        call = self.generate_call(state, rows, logprobs=logprobs, masks=masks, steps=steps, table_blocks=table_blocks)
        if dists:
            call = call._replace(static={**call.static, "dists": True})
        new, tokens, packed, *q = call()
        self._pos[self._occupied] += int(steps)
        if dists:
            return new, tokens.reshape(int(steps), -1), q[0].reshape(int(steps), tokens.shape[-1], -1)
        return new, (packed if logprobs else tokens)

    def _short_rows(self, steps: int) -> list[int]:
        """The active rows without the blocks their next `steps` positions fall in."""
        last = np.minimum(self._pos + max(int(steps), 1) - 1, self.max_len - 1)  # as _blocks_needed, every row
        short = self._occupied & (last // self.kv_block_size + 1 > self._held)
        if self._window is not None:  # or without the windowed block its last position falls in
            short |= self._occupied & ~self._window.table[np.arange(self.slots), last // self.kv_block_size].astype(bool)
        return np.flatnonzero(short).tolist()

    def generate_call(self, state: DecodeState, rows: int | None = None, *, logprobs: bool = False,
                      masks: np.ndarray | None = None, steps: int = 1, table_blocks: int | None = None) -> CoreCall:
        """The one jitted call `generate` makes, with its arguments (aot.py lowers it for chips that
        are not here); `table_blocks` forces the step's table width."""
        bucket = self.rows_for(rows)
        steps = int(steps)
        if steps < 1 or (steps > 1 and masks is not None):
            raise ValueError(f"steps must be >= 1, and 1 with grammar masks (got {steps}"
                             f"{' with masks' if masks is not None else ''})")
        m = None if masks is None else mask_rows(masks, bucket, self.info.vocab_size)
        tb = self._table_width(steps) if table_blocks is None else int(table_blocks)
        return CoreCall(generate_core, (self.step_params, state, m if steps == 1 else None, np.bool_(logprobs)),
                        dict(cfg=self.cfg, layout=self.layout, rows=bucket, steps=steps, max_len=self.max_len,
                             table_blocks=tb))

    def _table_width(self, steps: int) -> int:
        """The step's table width: every row's whole table, one compiled width (the step reads
        only the blocks its rows use, attention.paged_attention); RuntimeError when an active row lacks
        the blocks its next `steps` positions fall in (`reserve` first: a step never writes another
        sequence's block, but that row's tokens would be wrong)."""
        short = self._short_rows(steps)
        if short:
            raise RuntimeError(f"slots {short} have no KV blocks for their next {steps} positions: call "
                               f"reserve(state, {steps}) before generate and free the slots it returns")
        return self.max_blocks_per_seq

    def free(self, state: DecodeState, slot: int, tokens: Sequence[int] | None = None) -> DecodeState:
        """Mark `slot` inactive (donates `state`); its blocks go back to the pool (and its table row
        to the null block, so the free row's writes in later steps land there). Only the `active`
        array goes through the call (the pool and the rest of the state are not passed). Freeing a
        free slot does nothing more.

        `tokens` (with kv_reuse): the ids whose KV the row's positions [0, len(tokens))
        hold (the prompt, then every token fed to a step: the output but its last token); its
        full blocks stay in the pool's block cache for a later sequence that starts with them
        (`match_prefix`). Only pass tokens whose KV was written: positions a step wrote past a
        finish hold other tokens' KV."""
        self._check_slot(slot)
        self._occupied[slot] = False
        if self._pending.pop(int(slot), None) is not None:
            tokens = None  # a prompt not finished: its blocks hold a part of it
        self._release_row(int(slot), tokens)
        state = self._with_tables(state)
        return state._replace(active=free_core(state.active, np.int32(slot)))
