"""Domain types that cross process boundaries (Redis messages, gRPC, engine seam).

Plain dataclasses and numpy only: no JAX, no Redis, no gRPC.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# CHOICE_SEP is never in a client-chosen request id, so a choice id cannot collide with one;
# keys.KeySpace.request_shard reads a choice's parent id from it
# a choice's id is its parent's, this, and its index (choice_id); the key table reads it from here,
# so the engine (which imports these types) loads no Redis client
CHOICE_SEP = "~"

FINISH_STOP = "stop"  # EOS token or stop string
FINISH_LENGTH = "length"  # max_tokens or context end
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


# Bounds the engine compiles for (static shapes): a request past them gets a clear 400 at the gateway.
MAX_TOP_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit)
MAX_LOGIT_BIAS = 64  # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 16  # ids min_tokens holds back (EOS ids + stop_token_ids)
LOGPROB_FLOOR = -9999.0  # a -inf logprob (a masked token) as JSON can carry it, as vLLM reports it


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy (top_k/top_p ignored).

    Processing order, the same on every pod: logits -> repetition_penalty (prompt and output
    tokens, HF/vLLM semantics) -> presence/frequency penalties (output tokens, OpenAI semantics)
    -> logit_bias -> min_tokens (stop ids masked until that many tokens are out) = the processed
    logits; `logprobs` are the log-softmax of those; then temperature, top-k, top-p and the draw.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1.0 = no nucleus cut
    seed: int | None = None
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # (0, 2]; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), <= MAX_LOGIT_BIAS
    min_tokens: int = 0  # stop ids cannot be sampled before this many output tokens
    logprobs: int | None = None  # None = off; k >= 0: the sampled token's logprob and the top k

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed}
        for name, off in _SAMPLING_OFF.items():  # only what is on: old readers see the same dict
            value = getattr(self, name)
            if value != off:
                d[name] = [list(x) for x in value] if name == "logit_bias" else value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        kw = {k: d[k] for k in ("temperature", "top_k", "top_p", "seed", *_SAMPLING_OFF) if k in d}
        if "logit_bias" in kw:
            kw["logit_bias"] = tuple((int(t), float(b)) for t, b in kw["logit_bias"])
        return cls(**kw)


_SAMPLING_OFF = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                 "logit_bias": (), "min_tokens": 0, "logprobs": None}


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's logprob and the top alternatives [(token id, logprob)], best first.

    On a token stream entry as the field `l`: "<logprob>|<id>:<logprob>,<id>:<logprob>,..."."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def encode(self) -> str:
        return f"{self.logprob:.6g}|" + ",".join(f"{t}:{lp:.6g}" for t, lp in self.top)

    @classmethod
    def decode(cls, s: str | bytes) -> "TokenLogprobs":
        s = s.decode() if isinstance(s, (bytes, bytearray)) else s
        head, _, rest = s.partition("|")
        top = tuple((int(t), float(lp)) for t, _, lp in (x.partition(":") for x in rest.split(",") if x))
        return cls(float(head), top)


def encode_prompt_logprobs(items: list["TokenLogprobs | None"]) -> str:
    """Prompt logprobs (None for position 0, which nothing predicts) as one string, ";"-joined."""
    return ";".join("" if x is None else x.encode() for x in items)


def decode_prompt_logprobs(s: str | bytes) -> list["TokenLogprobs | None"]:
    s = s.decode() if isinstance(s, (bytes, bytearray)) else s
    return [TokenLogprobs.decode(x) if x else None for x in s.split(";")]


@dataclass
class GenerationRequest:
    """What the gateway puts on the admission stream (JSON in the `req` field).

    `deadline_ts` is wall-clock seconds (time.time()); workers drop work past it.
    `start_index` is the index of the token the next prefill produces: 0 for a new request; after
    a failure, the request resumes from its prompt plus the tokens already streamed (they are in
    `prompt_ids`), and `start_index` is how many were streamed. `attempt` counts resumes.

    `grammar` (structured outputs, tools): a JSON-serializable spec every token must keep to,
    `{"kind": "json_schema", "schema": {...}}`, `{"kind": "json_object"}`, `{"kind": "regex",
    "pattern": "..."}`, `{"kind": "choice", "choices": ["a", "b"]}` or `{"kind": "lark", "grammar":
    "..."}` (llguidance's Lark dialect, which embeds JSON schemas with `%json`); None = free text.
    Whoever samples a token of this request (prefill pod, decode pod) masks the logits with it.

    `n` > 1: one prefill serves n choices. Whoever prefills splits the request into `choice(i)`
    requests (ids `<request_id>~<i>`, each with its own seed and token stream) that decode and
    resume on their own. `prompt_logprobs` (echo with logprobs): the prefill writes the prompt's
    logprobs with the top k to the token stream (index -1, field `p`) of choice 0.
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    priority: str = "normal"
    deadline_ts: float = 0.0
    enqueued_ts: float = 0.0
    start_index: int = 0
    attempt: int = 0
    preempted: int = 0  # hand-backs for KV blocks (paged decode pods): past a pod's free ones each is an attempt
    n: int = 1
    prompt_logprobs: int | None = None
    grammar: dict | None = None
    # The decode pod the gateway steered it to (its KV block cache likely holds the prompt's leading
    # blocks: gateway/decode_route.py); a hint: any decode pod may take it. None: any.
    decode_pod: str | None = None
    # False: the request opts out of speculative decoding (decode_svc/speculate.py) where a pod runs it
    speculative: bool = True

    @property
    def output_from(self) -> int:
        """Where the tokens already streamed start in `prompt_ids` (a resumed request)."""
        return len(self.prompt_ids) - self.start_index

    def choice(self, i: int) -> "GenerationRequest":
        """Choice i of an n > 1 request: its own id and seed (seed + i, as vLLM does), n = 1."""
        s = self.sampling
        seed = None if s.seed is None else s.seed + i
        return dataclasses.replace(self, request_id=choice_id(self.request_id, i), n=1,
                                   sampling=dataclasses.replace(s, seed=seed),
                                   prompt_logprobs=self.prompt_logprobs if i == 0 else None)

    def to_dict(self) -> dict[str, Any]:
        """A shallow dict (dataclasses.asdict deep-copies the prompt id by id: measured at a fifth
        of a prefill pod's Python time)."""
        d = {f.name: getattr(self, f.name) for f in _REQUEST_FIELDS}
        d["sampling"] = self.sampling.to_dict()
        if d["decode_pod"] is None:  # not steered: readable by pods that predate the field
            del d["decode_pod"]
        if d["speculative"]:  # the default: left out, as above
            del d["speculative"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> "GenerationRequest":
        return cls.from_dict(json.loads(s))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationRequest":
        # Fields a newer version added are dropped, not fatal: in a rolling upgrade an older pod
        # reads what a newer gateway wrote (every field added since has a default).
        d = {k: v for k, v in d.items() if k in _REQUEST_NAMES}
        d["sampling"] = SamplingParams.from_dict(d.get("sampling") or {})
        return cls(**d)


_REQUEST_FIELDS = dataclasses.fields(GenerationRequest)
_REQUEST_NAMES = frozenset(f.name for f in _REQUEST_FIELDS)


def choice_id(request_id: str, i: int) -> str:
    return f"{request_id}{CHOICE_SEP}{i}"


def choice_ids(request_id: str, n: int) -> list[str]:
    """The token streams a request's choices write: itself for n == 1."""
    return [request_id] if n <= 1 else [choice_id(request_id, i) for i in range(n)]


@dataclass
class KVPayload:
    """A prefill result on the host: what moves between prefill and decode pods.

    k, v: [num_layers, length, num_kv_heads, head_dim] (length = the prefill bucket, >= true_length).
    `first_token` is the token sampled from the last prompt position (token index 0).
    `start` > 0: a part, positions [start, start + length) of the prompt only (length =
    true_length - start): what a decode pod pulls when it holds the first `start` positions
    already (its block cache, tandem_engine/block_cache.py).
    """

    k: np.ndarray
    v: np.ndarray
    true_length: int
    first_token: int
    start: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)
