"""A prompt the decode pod prefills itself (colocated mode, or a short prompt routed direct).

JetStream's interleaving on one pod: the engine thread prefills between two decode steps (the I/O
side claims a prompt only for a free slot, so a full pod keeps decoding and prefills nothing), then
publishes token `start_index` of every choice and queues the choices that go on for slots. The
prefill is dispatched before the next decode call and waited for after it (`start_here`, then
`Started.result`): the device runs the two back to back while the host reads the first tokens,
publishes them and inserts the rows, which join the call after. Two
kinds of prompt are not prefilled here but seated in a row and prefilled by the decode calls' ragged
batch (decode_svc/loop.py `_seat`): one whose leading full blocks the pod's KV pool keeps from a
finished sequence (its block cache: only the rest is computed), and, while streams are running, one
longer than `prefill_chunk_tokens` (its chunks go beside the running rows, so it does not stall
them). What is prefilled here is computed whole: the pod keeps no other prefix cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode_svc.items import Emitted, LocalPrefill
from tandem_core.grammar import Grammars
from tandem_core.sampling_args import first_finish, prefill_args
from tandem_core.types import FINISH_ERROR, GenerationRequest, choice_ids, encode_prompt_logprobs

if TYPE_CHECKING:  # the types only: no JAX import
    from tandem_engine.api import ServingEngine
    from tandem_engine.engine_prefill import PendingPrefix


@dataclass
class Prefilled:
    prefix: object  # the engine's Prefix: every choice's KV and first token
    emitted: list[Emitted]  # every choice's first token (the last carries the entry's ack)
    going: list[tuple[GenerationRequest, int]]  # (choice, first token) of those that go on


@dataclass
class Started:
    """A local prompt's whole prefill, dispatched (`start_here`); `result` waits for its first tokens."""

    engine: ServingEngine
    item: LocalPrefill
    pending: PendingPrefix

    def result(self) -> Prefilled:
        """Every choice's first token (and prompt logprobs): the wait for the call; raises TandemError."""
        return _prefilled(self.engine, self.item, self.pending.result())


def start_here(engine: ServingEngine, grammars: Grammars, item: LocalPrefill) -> Started:
    """Dispatch the whole prompt's prefill and return without waiting for it (the decode loop
    dispatches its next call meanwhile); raises TandemError for a prompt that cannot run."""
    req = item.req
    return Started(engine, item, engine.prefill_start(req.prompt_ids, req.sampling, **prefill_args(req, grammars)))


def _prefilled(engine, item: LocalPrefill, prefix) -> Prefilled:
    """Token `start_index` of every choice (and prompt logprobs) from a prompt's prefix."""
    req = item.req
    prompt_lp = None
    if req.prompt_logprobs is not None and req.start_index == 0:
        prompt_lp = encode_prompt_logprobs(engine.prompt_logprobs(req.prompt_ids, req.prompt_logprobs))
    choices = [req] if req.n <= 1 else [req.choice(i) for i in range(req.n)]
    out, going = [], []
    for c, first, lp in zip(choices, prefix.first_tokens, prefix.first_logprobs):
        finish = first_finish(c, first, prefix.true_length, engine.max_len)
        out.append(Emitted(c.request_id, c.start_index, first, finish, logprobs=lp.encode() if lp is not None else None))
        if finish is None:
            going.append((c, first))
    if prompt_lp is not None:  # the index -1 entry, before token 0 (see token_stream.add_prompt_logprobs)
        out.insert(0, Emitted(choices[0].request_id, -1, -1, prompt_logprobs=prompt_lp))
    out[-1].ack = item.ack  # acknowledged once every choice's first token is written
    return Prefilled(prefix, out, going)


def failed(item: LocalPrefill, message: str) -> list[Emitted]:
    """Every choice fails with `message`; the last carries the entry's ack."""
    req = item.req
    ids = choice_ids(req.request_id, req.n)
    return [Emitted(rid, req.start_index, -1, FINISH_ERROR, error=message, ack=item.ack if rid == ids[-1] else None)
            for rid in ids]
