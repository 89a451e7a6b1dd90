"""What crosses the bridge between the decode pod's event loop and its engine thread.

In (`Bridge.inserts`): `Insert` (a pulled KV) and `LocalPrefill` (a prompt this pod prefills), each
naming the request-table record (`key`) whose seat it fills. Out (`Bridge.outputs`): one list of
`Emitted` per step, written to Redis in one round trip.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem_core.types import GenerationRequest, KVPayload


@dataclass
class Insert:
    payload: KVPayload
    req: GenerationRequest
    key: int  # its record in the request table (QUEUED)


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
class HeldChoice:
    """A choice of a local n > 1 prefill waiting for a free slot (the KV stays on the device)."""

    prefix: object
    req: GenerationRequest
    first_token: int
    key: int  # its record in the request table (QUEUED)


@dataclass
class LoopStats:
    steps: int = 0  # decode steps run (a multi-step call counts each of its steps)
    calls: int = 0  # decode calls dispatched (one per step without multi-step decode)
    single_calls: int = 0  # calls of one step while multi-step decode is on (work waited: `_steps_for`)
    tokens: int = 0
    local_prefills: int = 0
    cancelled: int = 0  # requests ended by a client's cancel (a `cancelled` finish written)
    cancel_lag_tokens: int = 0  # the most tokens a request produced after its cancel reached the engine
    host_wait_s: float = 0.0  # time blocked copying tokens to the host
    constrained_steps: int = 0  # steps run with grammar masks (unpipelined)
    mask_s: float = 0.0  # host time computing those masks
    busy_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
