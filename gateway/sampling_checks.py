"""Checks of the OpenAI/vLLM sampling extras (issue 12): n, penalties, logit_bias, min_tokens,
stop_token_ids, logprobs. Shared by HTTP and gRPC through `validation.build_request`.

The bounds are the engine's static shapes (`tandem_core.types`: MAX_TOP_LOGPROBS, MAX_LOGIT_BIAS,
MAX_STOP_TOKEN_IDS) and the settings, so a request the engine could not serve is a 400 here, never
a surprise on a worker. Every message names the field and the limit. Pure: no I/O.
"""
from __future__ import annotations

import math
from typing import Protocol

from tandem_core.errors import InvalidRequest
from tandem_core.types import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS

PENALTY_RANGE = 2.0  # presence/frequency penalties in [-2, 2] (OpenAI)
BIAS_RANGE = 100.0  # logit_bias values in [-100, 100] (OpenAI)


class _Extras(Protocol):
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    logit_bias: dict[int, float] | None
    min_tokens: int | None
    logprobs: int | None
    logprobs_param: str


def check_n(n: int | None, max_n: int) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= max_n:
        raise InvalidRequest(f"n must be between 1 and {max_n} (the gateway's max_n), got {n}", param="n")
    return n


def check_stop_token_ids(ids: list[int], eos_ids: tuple[int, ...] | list[int], vocab_size: int) -> list[int]:
    """The model's EOS ids (unless ignore_eos) then the client's, each once, in order."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})",
                             param="stop_token_ids")
    out = list(dict.fromkeys([*eos_ids, *ids]))
    if len(out) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"stop_token_ids: {len(out)} distinct ids together with the model's {len(eos_ids)} EOS id(s), "
            f"more than the limit of {MAX_STOP_TOKEN_IDS}", param="stop_token_ids",
        )
    return out


def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}", param=name)
    return float(value)


def _penalties(p: _Extras) -> dict:
    out = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if value is None:
            continue
        if not -PENALTY_RANGE <= _finite(value, name) <= PENALTY_RANGE:
            raise InvalidRequest(f"{name} must be in [-2, 2], got {value}", param=name)
        out[name] = float(value)
    if p.repetition_penalty is not None:
        rp = _finite(p.repetition_penalty, "repetition_penalty")
        if not 0.0 < rp <= 2.0:
            raise InvalidRequest(f"repetition_penalty must be in (0, 2] (1 = off), got {rp}",
                                 param="repetition_penalty")
        out["repetition_penalty"] = rp
    return out


def check_logit_bias(bias: dict[int, float] | None, max_entries: int, vocab_size: int
                     ) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    limit = min(max_entries, MAX_LOGIT_BIAS)
    if len(bias) > limit:
        raise InvalidRequest(f"logit_bias has {len(bias)} entries, more than the limit of {limit}",
                             param="logit_bias")
    for token, value in bias.items():
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})",
                                 param="logit_bias")
        if not (math.isfinite(value) and -BIAS_RANGE <= value <= BIAS_RANGE):
            raise InvalidRequest(f"logit_bias: the bias for token {token} is {value}, outside [-100, 100]",
                                 param="logit_bias")
    return tuple(sorted((int(t), float(v)) for t, v in bias.items()))


def check_logprobs(k: int | None, param: str, limit: int = MAX_TOP_LOGPROBS) -> int | None:
    if k is not None and not 0 <= k <= limit:
        raise InvalidRequest(f"{param} must be between 0 and {limit}, got {k}", param=param)
    return k


def check_min_tokens(min_tokens: int | None, max_tokens: int) -> int:
    if min_tokens is None:
        return 0
    if min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be >= 0, got {min_tokens}", param="min_tokens")
    if min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({min_tokens}) is more than max_tokens ({max_tokens})",
                             param="min_tokens")
    return int(min_tokens)


def check_processing(p: _Extras, max_logit_bias: int, vocab_size: int) -> dict:
    """The SamplingParams fields past temperature/top-k/top-p/seed that need no prompt, checked;
    only those set (min_tokens needs max_tokens: `check_min_tokens`)."""
    out = _penalties(p)
    bias = check_logit_bias(p.logit_bias, max_logit_bias, vocab_size)
    if bias:
        out["logit_bias"] = bias
    if p.min_tokens is not None and p.min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be >= 0, got {p.min_tokens}", param="min_tokens")
    if check_logprobs(p.logprobs, p.logprobs_param) is not None:
        out["logprobs"] = int(p.logprobs)
    return out
