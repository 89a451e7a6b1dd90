"""What crosses the bridge between the decode pod's event loop and its engine thread.

In (`Bridge.inserts`): `Insert` (a pulled KV) and `LocalPrefill` (a prompt this pod prefills), each
naming the request-table record (`key`) whose seat it fills. Out (`Bridge.outputs`): one list of
`Emitted` per step, written to Redis in one round trip, or a `Preempted` (requests to hand back).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from tandem_core.types import GenerationRequest, KVPayload

if TYPE_CHECKING:  # the type only: no JAX import
    from tandem_engine.block_cache import PrefixMatch


@dataclass
class Insert:
    payload: KVPayload
    req: GenerationRequest
    key: int  # its record in the request table (QUEUED)
    # the engine's match of the prompt's first payload.start positions (its block cache: the
    # payload holds the rest), pinned until inserted; whoever drops the item releases it
    cached: PrefixMatch | None = None


@dataclass
class LocalPrefill:
    """A prompt this pod prefills itself (colocated mode, or routed direct by the gateway).
    `ack` is the (stream, group, entry id) to acknowledge once its first token is published."""

    req: GenerationRequest
    ack: tuple[str, str, bytes]
    key: int  # its record in the request table (QUEUED)


@dataclass(slots=True)
class Emitted:
    """One token stream entry a step (or a finish outside the steps) writes, as
    `token_stream.OwnedPublisher.add_batch` takes it (the attributes of `token_stream.TokenEntry`),
    with the stream entry to acknowledge once it is written."""

    request_id: str
    index: int
    token: int  # -1 when a request ends without a token (cancelled)
    finish: str | None = None
    ack: tuple[str, str, bytes] | None = None  # acknowledged after this token is written
    error: str | None = None
    logprobs: str | None = None  # TokenLogprobs.encode() when the request asked for logprobs
    prompt_logprobs: str | None = None  # the index -1 entry of an echo with logprobs


@dataclass
class Preempted:
    """Requests the engine thread freed because its paged KV ran out (decode_svc/loop.py
    `_make_room`), to hand back: a batch of its own on `Bridge.outputs`, behind every token of
    theirs already queued, so the publisher resumes them only once those are written. `counted`:
    the resume spends one of the request's attempts (it was alone and still did not fit: no
    endless round trips); otherwise it does not (the pod was merely full)."""

    reqs: list[GenerationRequest]
    why: str
    counted: bool = False


@dataclass
class HeldChoice:
    """A choice of a local n > 1 prefill waiting for a free slot (the KV stays on the device)."""

    prefix: object
    req: GenerationRequest
    first_token: int
    key: int  # its record in the request table (QUEUED)
    cached: PrefixMatch | None = None  # a pulled part's match (Insert.cached)


@dataclass
class LoopStats:
    steps: int = 0  # decode steps run (a multi-step call counts each of its steps)
    calls: int = 0  # decode calls dispatched (one per step without multi-step decode)
    single_calls: int = 0  # calls of one step while multi-step decode is on (work waited: `_steps_for`)
    ragged_calls: int = 0  # calls that carried a seated prompt's chunk beside the rows' step
    tokens: int = 0
    local_prefills: int = 0
    prompt_computed: int = 0  # prompt tokens prefilled here (local prompts: those not over the pool's blocks)
    prompt_queries: int = 0  # local prompts' tokens looked up in the pool's block cache (every local prompt's)
    prompt_hits: int = 0  # local prompts' tokens found there (seated over the pool's blocks, not computed)
    cancelled: int = 0  # requests ended by a client's cancel (a `cancelled` finish written)
    cancel_lag_tokens: int = 0  # the most tokens a request produced after its cancel reached the engine
    handed_back_for_blocks: int = 0  # running requests handed back because the paged KV ran out
    spec_short: int = 0  # verify calls not made: the pool lacked the blocks of k + 1 positions a row
    host_wait_s: float = 0.0  # time blocked copying tokens to the host
    constrained_steps: int = 0  # steps run with grammar masks (unpipelined)
    constrained_verifies: int = 0  # of those, verify calls (speculation under grammar masks)
    mask_s: float = 0.0  # host time computing those masks
    busy_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    # step variants the warm-up left to the engine thread's idle turns (EngineLoop.late_warm): how
    # many, how many compiled, and their seconds
    late_compiles: int = 0
    late_compiled: int = 0
    late_compile_s: float = 0.0
