"""What a request asks of the engine, in the engine's terms: one place for the prefill pod and
the decode pod (which prefills too, in colocated mode), so both treat a request the same way.

No JAX here: these build keyword arguments for `Engine.prefill` / `Engine.insert` and decide
whether token 0 already ends a request.
"""
from __future__ import annotations

from typing import Any

from tandem_core.types import FINISH_LENGTH, FINISH_STOP, GenerationRequest


def prefill_args(req: GenerationRequest, grammars=None) -> dict[str, Any]:
    """`Engine.prefill` keywords: one first token per choice (n > 1), the index it has, where
    the output already streamed starts in the prompt (a resume) and the ids min_tokens holds back.
    A request with a grammar gets its token masks from `grammars` (tandem_core.grammar.Grammars;
    InvalidRequest / GrammarError if the spec cannot run); without one the key is left out."""
    choices = [req.choice(i).sampling for i in range(req.n)] if req.n > 1 else None
    kw = {"choices": choices, "start_index": req.start_index, "output_from": req.output_from,
          "stop_ids": list(req.stop_token_ids)}
    if req.grammar is not None:
        if grammars is None:
            raise ValueError(f"request {req.request_id} has a grammar but this caller passed no Grammars")
        kw["masks"] = grammars.first_masks(req)
    return kw


def insert_args(req: GenerationRequest, first_token: int) -> dict[str, Any]:
    """`Engine.insert` keywords. The prompt travels to the device only when a penalty reads it."""
    return {"first_token": int(first_token), "history": req.prompt_ids if req.sampling.penalized else None,
            "output_from": req.output_from, "start_index": req.start_index, "stop_ids": list(req.stop_token_ids)}


def first_finish(req: GenerationRequest, first: int, true_length: int, max_len: int) -> str | None:
    """The finish reason token `start_index` (the prefill's) already gives, or None to decode on.
    `stop_token_ids` is the whole stop set (the gateway leaves EOS out of it for ignore_eos)."""
    if first in req.stop_token_ids:
        return FINISH_STOP
    if req.max_tokens <= req.start_index + 1 or true_length >= max_len:
        return FINISH_LENGTH
    return None
