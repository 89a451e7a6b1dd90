"""Domain types that cross process boundaries (Redis messages, gRPC, engine seam).

Plain dataclasses and numpy only: no JAX, no Redis, no gRPC.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FINISH_STOP = "stop"  # EOS token or stop string
FINISH_LENGTH = "length"  # max_tokens or context end
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy (top_k/top_p ignored)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1.0 = no nucleus cut
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        return cls(**{k: d[k] for k in ("temperature", "top_k", "top_p", "seed") if k in d})


@dataclass
class GenerationRequest:
    """What the gateway puts on the admission stream (JSON in the `req` field).

    `deadline_ts` is wall-clock seconds (time.time()); workers drop work past it.
    `start_index` is the index of the token the next prefill produces: 0 for a new request; after
    a failure, the request resumes from its prompt plus the tokens already streamed (they are in
    `prompt_ids`), and `start_index` is how many were streamed. `attempt` counts resumes.
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

    def to_dict(self) -> dict[str, Any]:
        """A shallow dict (dataclasses.asdict deep-copies the prompt id by id: measured at a fifth
        of a prefill pod's Python time)."""
        d = {f.name: getattr(self, f.name) for f in _REQUEST_FIELDS}
        d["sampling"] = self.sampling.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> "GenerationRequest":
        return cls.from_dict(json.loads(s))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationRequest":
        d = dict(d)
        d["sampling"] = SamplingParams.from_dict(d.get("sampling") or {})
        return cls(**d)


_REQUEST_FIELDS = dataclasses.fields(GenerationRequest)


@dataclass
class KVPayload:
    """A prefill result on the host: what moves between prefill and decode pods.

    k, v: [num_layers, length, num_kv_heads, head_dim] (length = the prefill bucket, >= true_length).
    `first_token` is the token sampled from the last prompt position (token index 0).
    """

    k: np.ndarray
    v: np.ndarray
    true_length: int
    first_token: int

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)
