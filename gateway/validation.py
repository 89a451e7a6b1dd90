"""Request validation shared by the HTTP and gRPC front ends.

Both transports turn their wire format into one `CompletionParams`, and `build_request` checks it
against the settings and the model, tokenizes, and returns the `GenerationRequest` to enqueue.
Every failure is an `InvalidRequest` (or `ModelNotFound`) whose message names the field and the
limit, so a client can fix the request without reading our code. The sampling extras (n,
penalties, logit_bias, min_tokens, stop_token_ids, logprobs) are checked in `sampling_checks.py`;
a grammar spec (structured outputs, forced tool calls) is size-checked and, where the grammar
library is installed, checked by it in `structured.py` before anything is enqueued.
Cheap checks come before tokenization, so a bad field is reported even with a long prompt.
`Prepared` also carries what the formatters need (echo, logprobs, n, ...); it is frozen, and what
changes per relay lives in attachment.py. Pure: no I/O here.
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway import sampling_checks as checks
from gateway.structured import check_grammar
from gateway.settings import GatewaySettings
from tandem_core.bus import admission
from tandem_core.errors import InvalidRequest, ModelNotFound, PromptTooLong
from tandem_core.models import ModelInfo
from tandem_core.tokenizer import Tokenizer
from tandem_core.types import GenerationRequest, SamplingParams

if TYPE_CHECKING:  # resume.py talks to Redis; validation stays pure
    from gateway.resume import StreamMeta

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_STOP_CHARS = 256


@dataclass
class CompletionParams:
    """One completion request in transport-neutral form (None = use the default)."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    priority: str | None = None
    request_id: str | None = None
    # OpenAI parity (issue 12):
    n: int | None = None  # choices; None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias
    min_tokens: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS ids
    logprobs: int | None = None  # top k alternatives per token (chat: top_logprobs); None = off
    logprobs_param: str = "logprobs"  # the field a client named it by, for errors
    echo: bool = False  # completions: the prompt comes back before the completion
    skip_special_tokens: bool = True
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    speculative: bool = True  # False: this request opts out of speculative decoding
    add_special_tokens: bool = True  # False: the text already has them (a model's chat template)
    max_tokens_to_context: bool = False  # chat: no max_tokens = until a stop or the context ends
    # Structured outputs and tools (issue 13):
    grammar: dict | None = None  # GenerationRequest.grammar
    grammar_param: str | None = None  # the field that set it, for errors


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to enqueue, plus what the relay and the formatters need to finish
    it. Immutable: `build_request` makes it, the HTTP front end completes it once with
    `dataclasses.replace` (resumable, meta), and what one relay of it holds (the limiter lease, the
    admission entry id, the attach number) is an `Attachment` (attachment.py)."""

    request: GenerationRequest
    stop: tuple[str, ...]
    model: str  # the name to report back to the client
    arrival_ts: float  # time.monotonic() at arrival, for TTFT/e2e
    resumable: bool = False  # a client disconnect leaves the request running for resume
    replay: bool = False  # a resume: relays the stream again, records no latency metrics
    meta: StreamMeta | None = None  # for HTTP streams: what a resume needs to format them
    # What the formatters need (issue 12):
    echo: bool = False
    logprobs: int | None = None  # top k per token (the sampled token's logprob too); None = off
    skip_special_tokens: bool = True
    continuous_usage: bool = False
    n: int = 1
    prompt_text: str | None = None  # the prompt as sent (None for token ids): what echo returns

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)


def served_name(settings: GatewaySettings, info: ModelInfo) -> str:
    """The one name the API shows: `served_model_name`, else "builtin" for the built-in model (the
    name the docs and `tandem local` use; its checkpoint's own name stays an alias), else the
    model's name."""
    if settings.served_model_name:
        return settings.served_model_name
    return "builtin" if settings.model in ("builtin", "") else info.name


def model_aliases(settings: GatewaySettings, info: ModelInfo) -> set[str]:
    """Names a client may send: the served name, the model's own name and the configured model."""
    names = {served_name(settings, info), info.name, settings.model}
    if settings.model in ("builtin", "", info.name):
        names.add("builtin")
    return {n for n in names if n}


def check_model(model: str | None, settings: GatewaySettings, info: ModelInfo) -> str:
    name = served_name(settings, info)
    if model is None or model == "":
        return name
    if model not in model_aliases(settings, info):
        raise ModelNotFound(f"model {model[:64]!r} is not served here; this gateway serves {name!r}", param="model")
    return name


def _tokenize(p: CompletionParams, tokenizer: Tokenizer, info: ModelInfo) -> list[int]:
    if p.prompt_ids is not None:
        if not p.prompt_ids:
            raise InvalidRequest("prompt is empty: send at least one token id", param="prompt")
        bad = next((t for t in p.prompt_ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"prompt token id {bad} is outside the vocabulary [0, {info.vocab_size})", param="prompt"
            )
        return list(p.prompt_ids)
    if not p.prompt:
        raise InvalidRequest("prompt is empty: send a non-empty string", param="prompt")
    ids = tokenizer.encode(p.prompt, add_special_tokens=p.add_special_tokens)
    if not ids:  # e.g. a chat template that renders nothing the tokenizer keeps
        raise InvalidRequest("prompt is empty after tokenization", param="prompt")
    return ids


def _default_max_tokens(n_prompt: int, p: CompletionParams, s: GatewaySettings) -> int:
    """Without max_tokens: completions get default_max_tokens (OpenAI's 16); chat runs until a stop
    or the context ends (OpenAI, vLLM), bounded by max_tokens_limit. Both are clamped to what fits
    in the context and, with a per-key token budget, to what the budget can ever admit."""
    room = s.max_context_len - n_prompt
    if room <= 0:
        raise PromptTooLong(
            f"prompt is {n_prompt} tokens and leaves no room for output in the context of "
            f"{s.max_context_len} tokens: shorten the prompt", param="prompt",
        )
    cap = s.max_tokens_limit if p.max_tokens_to_context else s.default_max_tokens
    budget = s.tokens_per_minute_per_key - n_prompt
    if s.tokens_per_minute_per_key and budget > 0:
        cap = min(cap, budget)
    return min(cap, room)


def _check_lengths(n_prompt: int, p: CompletionParams, s: GatewaySettings) -> int:
    if n_prompt > s.max_prompt_len:
        raise PromptTooLong(
            f"prompt is {n_prompt} tokens, longer than the limit of {s.max_prompt_len} tokens: shorten it",
            param="prompt",
        )
    max_tokens = p.max_tokens
    if max_tokens is None:
        return _default_max_tokens(n_prompt, p, s)
    if max_tokens <= 0:
        raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > s.max_tokens_limit:
        raise InvalidRequest(
            f"max_tokens is {max_tokens}, more than the limit of {s.max_tokens_limit}", param="max_tokens"
        )
    if n_prompt + max_tokens > s.max_context_len:
        raise InvalidRequest(
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} exceeds "
            f"the context length of {s.max_context_len} tokens", param="max_tokens",
        )
    return max_tokens


def _check_sampling(p: CompletionParams, s: GatewaySettings, vocab_size: int) -> dict:
    temperature = s.default_temperature if p.temperature is None else p.temperature
    if not 0.0 <= temperature <= 2.0:
        raise InvalidRequest(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = 1.0 if p.top_p is None else p.top_p
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = 0 if p.top_k is None else p.top_k
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {top_k}", param="top_k")
    if top_k >= vocab_size:
        top_k = 0  # keeps every token: the same as off
    if p.seed is not None and not -(2**63) <= p.seed < 2**63:
        raise InvalidRequest("seed must fit in a signed 64-bit integer", param="seed")
    return dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=p.seed)


def _check_stop(stop: list[str], s: GatewaySettings) -> tuple[str, ...]:
    if len(stop) > s.max_stop_strings:
        raise InvalidRequest(
            f"stop has {len(stop)} strings, more than the limit of {s.max_stop_strings}", param="stop"
        )
    for x in stop:
        if not x:
            raise InvalidRequest("stop strings must not be empty", param="stop")
        if len(x) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"stop string of {len(x)} characters is longer than the limit of {MAX_STOP_CHARS}", param="stop"
            )
    return tuple(dict.fromkeys(stop))


def _check_ids(p: CompletionParams) -> tuple[str, str]:
    priority = p.priority or "normal"
    if priority not in admission.PRIORITIES:
        raise InvalidRequest(
            f"priority must be one of {', '.join(repr(x) for x in admission.PRIORITIES)}, got {priority!r}",
            param="priority",
        )
    rid = p.request_id or f"cmpl-{uuid.uuid4().hex}"
    if not _REQUEST_ID.match(rid):
        raise InvalidRequest(
            "request_id (X-Request-Id over HTTP) must be 1-128 characters of letters, digits, '.', '_', ':' or '-'", param="request_id"
        )
    return priority, rid


def _check_grammar(p: CompletionParams, s: GatewaySettings, tokenizer: Tokenizer, vocab_size: int) -> None:
    if p.grammar is None:
        return
    param = p.grammar_param or "grammar"
    if p.ignore_eos:
        raise InvalidRequest(f"ignore_eos cannot be combined with {param}: a constrained output ends with EOS "
                             f"once it is complete", param="ignore_eos")
    check_grammar(p.grammar, param, s.max_grammar_bytes, tokenizer, vocab_size)


def build_request(
    p: CompletionParams, s: GatewaySettings, info: ModelInfo, tokenizer: Tokenizer
) -> Prepared:
    """Validate `p` and build the request to enqueue; raises InvalidRequest/ModelNotFound."""
    arrival = time.monotonic()
    model = check_model(p.model, s, info)
    priority, rid = _check_ids(p)
    sampling = _check_sampling(p, s, info.vocab_size)
    sampling.update(checks.check_processing(p, s.max_logit_bias, info.vocab_size))
    n = checks.check_n(p.n, s.max_n)
    stop = _check_stop(p.stop, s)
    stop_ids = checks.check_stop_token_ids(p.stop_token_ids, () if p.ignore_eos else info.eos_token_ids,
                                           info.vocab_size)
    _check_grammar(p, s, tokenizer, info.vocab_size)
    prompt_ids = _tokenize(p, tokenizer, info)
    max_tokens = _check_lengths(len(prompt_ids), p, s)
    sampling["min_tokens"] = checks.check_min_tokens(p.min_tokens, max_tokens)
    now = time.time()
    req = GenerationRequest(
        request_id=rid,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(**sampling),
        stop_token_ids=stop_ids,
        ignore_eos=p.ignore_eos,
        priority=priority,
        deadline_ts=now + s.request_timeout_s,
        enqueued_ts=now,
        n=n,
        prompt_logprobs=p.logprobs if p.echo and p.logprobs is not None else None,
        grammar=p.grammar,
        speculative=p.speculative,
    )
    return Prepared(request=req, stop=stop, model=model, arrival_ts=arrival, echo=p.echo, logprobs=p.logprobs,
                    skip_special_tokens=p.skip_special_tokens, continuous_usage=p.continuous_usage, n=n,
                    prompt_text=p.prompt if p.prompt_ids is None else None)
