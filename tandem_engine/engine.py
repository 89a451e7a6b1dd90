"""The Engine: the JetStream-shaped slot API the prefill and decode services drive.

Life of a request through the engine:
  1. prefill pod: `prefill(prompt_ids, sampling)` pads the prompt to a length bucket, runs it, and
     samples the first token (index `start_index`, 0 for a new request) from the last prompt
     position -> `Prefix` (device KV + first token; with `choices`, one first token per choice
     from the same logits; with logprobs on, their logprobs).
  2. `export_prefix` copies the KV to host numpy (`KVPayload`); the transport moves only bytes.
  3. decode pod: `import_prefix(payload)` puts it back on the device; `insert(prefix, state, slot,
     sampling, history=...)` writes it into a free slot of the `DecodeState` with that request's
     sampling params and penalty state (the prompt it holds; the output in it, if resumed).
     `insert_payload(payload, state, slot, ...)` does both in one move (a decode pod's pulled KV:
     on one device the host arrays go straight into the insert call).
  4. `generate(state, rows)` runs ONE step for the slots in use (the smallest batch bucket that
     holds slots [0, rows)) and returns tokens still on the device, so the caller can dispatch the
     next step before copying them (pipelining); `logprobs=True` returns them packed with their
     logprobs (logits.py), still one device -> host copy. The token a slot returns at its n-th
     step is token index start_index + n. `generate(state, rows, steps=K)` runs K steps in one
     call (multi-step decode; tokens [K, bucket]): the same tokens as K one-step calls.
  5. `free(state, slot)` marks the slot inactive when the request finishes.

Public methods do host work (validation, padding, seeds); the jitted cores (cores.py) do device
work and donate the `DecodeState` so the KV cache is updated in place. Logits processing
(penalties, logit_bias, min_tokens) and logprobs live in logits.py, in the contract's order.

Positions: a slot's position must stay below `max_len`; the caller finishes a request (reason
"length") before its position reaches `max_len`. Past that, writes clamp to the last cache row
and that slot's tokens are garbage (other slots are unaffected).

The Engine is put together from its sides: engine_base.py (the model, placed weights, compiled
shapes), engine_prefill.py (steps 1-2), engine_decode.py (steps 3-5); this module adds the
warm-up that compiles both ahead of the first request.
No I/O, no tokenizer, no settings here.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tandem_core.types import SamplingParams
from tandem_engine.cores import DecodeState
from tandem_engine.engine_base import DEFAULT_BUCKETS
from tandem_engine.api import PrefillCall, StepVariant
from tandem_engine.engine_prefill import PrefillSide, Prefix
from tandem_engine.engine_spec import SpeculativeSide

__all__ = ["DEFAULT_BUCKETS", "DecodeState", "Engine", "PrefillCall", "Prefix"]


class Engine(PrefillSide, SpeculativeSide):
    """Device work only: token ids in, token ids out. One thread MUST own an Engine and its
    DecodeState (calls are not thread-safe; states passed to insert/generate/free are donated
    and MUST NOT be used again).

    With tp > 1 (or a mesh) the weights and the KV are split across chips by head (see
    sharding.py); every method behaves the same and prefixes cross engines of any tp."""

    def warmup_prefill(self) -> None:
        """Compile every bucket's prefill (one choice): what a prefill pod runs, before it reports
        ready, so no request pays for a compilation (with the persistent compilation cache a
        restart loads them: 1.7 s for the built-in model's six buckets on 2 CPU cores, 9.7 s cold)."""
        for b in self.buckets:
            self.prefill([0] * b, SamplingParams())

    def warm_steps(self, logprobs: bool = True, masks: bool = False) -> list[StepVariant]:
        """The decode step variants `warmup` compiles, in its order: (rows, table width, steps,
        logprobs, masked) for every batch bucket (the table width: the one width every step has,
        each row's whole table, since the step reads only the blocks in use:
        attention.paged_attention), one step and `steps_per_dispatch` of them, with `masks` the
        grammar-masked step. `logprobs` adds none: a step with logprobs is the same compiled step
        (its flag is traced: cores.generate_core), so `logprobs` is False in every variant."""
        multi = (1, self.steps_per_dispatch) if self.steps_per_dispatch > 1 else (1,)
        width = self.max_blocks_per_seq
        out: list[StepVariant] = []
        for rows in self.batch_buckets:
            for steps in multi:  # multi-step decode: its own compiled variants
                out.append(StepVariant(rows, width, steps, False, False))
            if masks:
                out.append(StepVariant(rows, width, 1, False, True))
        return out

    def warm_step(self, state, variant: StepVariant):
        """Run one of `warm_steps`' variants over `state`, every row free (a step over free rows
        writes only the null block): compiled on its first run. Returns the state, the step done.
        Donates `state`. (A decode pod's engine thread runs the variants its warm-up left, e.g. the
        grammar-masked steps, this way while it has nothing to do: decode_svc/loop.py.)"""
        v = variant
        if v.spec_k:
            return self.warm_verify(state, v)
        masks = np.full((v.rows, (self.info.vocab_size + 31) // 32), -1, np.int32) if v.masked else None
        state, tokens = self._generate(state, v.rows, logprobs=v.logprobs, masks=masks, steps=v.steps,
                                       table_blocks=v.width)
        jax.block_until_ready(tokens)
        return state

    def warmup(self, prefill: bool = True, logprobs: bool = True, masks: bool = False,
               progress: Callable[[int, int, float], None] | None = None, direct: bool = False,
               ragged: bool = False) -> int:
        """Compile every bucket's insert and every decode step variant (`warm_steps`: each batch
        bucket's, one step and `steps_per_dispatch` of them, with `masks` the grammar-masked step
        too; a step with logprobs is the same compiled step, `logprobs` compiles nothing more), and with `prefill` every bucket's prefill (one choice), so no request
        pays for a compilation (decode pods call this before they report ready). `progress(done, total, seconds)` after
        each step variant (the caller logs it). `direct` (without `prefill`): the smallest bucket's
        prefill too and the insert of its KV, for the short prompts a gateway routes straight to a
        decode pod (a prefill's KV is committed to the device, a pulled payload's is not: two cache
        keys of one insert). `ragged`: the ragged call too (`begin_prompt`, `generate_ragged` over
        every slot, with `logprobs` run with logprobs too). Returns the step variants compiled."""
        t0 = time.monotonic()
        state = self.init_state()
        c = self.cfg
        for b in self.buckets:
            if prefill:
                kv_of = self.prefill([0] * b, SamplingParams())
            else:
                kv = jnp.zeros((c.num_layers, b, c.num_kv_heads, c.head_dim), self._jdtype)
                kv_of = Prefix(kv, kv, 1, 0)
            state = self.insert(kv_of, state, 0, SamplingParams())
            if direct and not prefill and b == self.buckets[0]:
                state = self.insert(self.prefill([0] * b, SamplingParams()), state, 0, SamplingParams())
        state = self.free(state, 0)  # the steps run with every row free (no blocks held)
        variants = self.warm_steps(logprobs, masks)
        for i, variant in enumerate(variants):
            state = self.warm_step(state, variant)
            if progress is not None:
                progress(i + 1, len(variants), time.monotonic() - t0)
        state = self.free(state, 0)
        tokens = None
        for lp in ((False, True) if logprobs else (False,)) if ragged else ():
            state = self.begin_prompt(state, 0, [0], SamplingParams())
            state, out = self.generate_ragged(state, None, logprobs=lp)
            state = self.free(state, 0)
            tokens = out.tokens
        jax.block_until_ready((state, tokens))
        return len(variants)
