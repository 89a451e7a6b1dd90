"""What the services may use of an engine: `ServingEngine`, a typed Protocol.

The prefill and decode pods hold an engine only through this
Protocol, so the surface a service depends on is written down in one place: anything a service
calls that is not here is a type error (the services type their engine as `ServingEngine`; mypy
runs first in `make test`), and `Engine` is checked to provide every member
(tests/unit/test_engine_api.py). A second engine (another backend, a remote one) is a class with
these members; nothing else in the services changes.

The calling rules are `Engine`'s: one thread owns an engine and its DecodeState; states passed
to insert/generate/free are donated and must not be used again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # the types only: importing this module costs no JAX import
    import jax
    import numpy as np

    from tandem_core.models import ModelInfo
    from tandem_core.types import KVPayload, SamplingParams, TokenLogprobs
    from tandem_engine.block_cache import PrefixMatch
    from tandem_engine.cores import DecodeState
    from tandem_engine.engine_decode import RaggedOut
    from tandem_engine.engine_spec import SpecOut
    from tandem_engine.engine import Prefix
    from tandem_engine.engine_prefill import PendingPrefix
    from tandem_engine.model import ModelConfig


@dataclass
class PrefillCall:
    """One prompt of a batched prefill (`ServingEngine.prefill_batch`): `prefill`'s arguments for a
    prompt with one choice, no grammar masks and no cached prefix."""

    prompt_ids: Sequence[int]
    sampling: "SamplingParams"
    start_index: int = 0
    output_from: int | None = None
    stop_ids: Sequence[int] = ()


class StepVariant(NamedTuple):
    """One compiled shape of the decode step (`Engine.warm_steps`): its batch bucket, its table
    width in blocks, the steps a call runs, and whether it returns logprobs, takes grammar masks;
    or of the speculative verify call (`Engine.verify_variants`)."""

    rows: int
    width: int
    steps: int
    logprobs: bool
    masked: bool
    spec_k: int = 0  # a speculative verify call checking up to spec_k proposals a row (0: a step) ...
    extra: int = 0  # ... with this many proposal queries (speculative.extra_bucket)
    force: bool = False  # ... every proposal kept: a draft model catching up (draft.py)
    drafted: bool = False  # ... taking the proposals' distributions (a sampling draft model, draft.py)


@runtime_checkable
class ServingEngine(Protocol):
    """The slot API (prefill -> Prefix, insert into a slot, generate a step for every slot, free),
    the KV's moves to and from the host, and the shapes a service sizes itself by."""

    info: "ModelInfo"  # vocabulary, layers, heads: what a service sizes KV budgets and masks by
    cfg: "ModelConfig"
    slots: int
    max_len: int  # prompt plus output, per slot
    buckets: tuple[int, ...]  # prefill length buckets (compiled shapes)
    batch_buckets: tuple[int, ...]  # decode step row buckets (compiled shapes)
    dtype: str  # "float32" | "bfloat16": the KV's bytes per element
    prefix_chunk: int  # tokens per piece of a prefill over a cached prefix, and of a chunked prefill
    steps_per_dispatch: int  # multi-step decode: steps a decode pod runs per generate call when it can
    # KV capacity in blocks: a pool of kv_blocks_total blocks of kv_block_size positions shared by
    # `slots` sequence rows. A decode pod takes a prompt when kv_blocks_free() >=
    # kv_blocks_for(its length) plus its reserve, and calls reserve() before each generate.
    kv_block_size: int
    kv_blocks_total: int
    # finished rows' full blocks are kept and shared by later sequences with the same
    # leading tokens (tandem_engine/block_cache.py); a decode pod pulls only the rest
    kv_reuse: bool
    # per layer, whether it keeps its blocks in the windowed group (paged.WindowGroup: windowed
    # layers beside global ones, at most window_span blocks a row, never short); (): no group
    windowed: tuple
    window_span: int

    @property
    def tp(self) -> int: ...  # chips the weights and KV are split over (1: one chip)

    def match_prefix(self, ids: Sequence[int]) -> "PrefixMatch | None": ...

    def release_prefix(self, match: "PrefixMatch") -> None: ...

    def kv_reuse_summary(self) -> dict | None: ...

    def window_group_summary(self) -> dict | None: ...

    def kv_blocks_free(self) -> int: ...

    def kv_blocks_for(self, length: int) -> int: ...

    def reserve(self, state: "DecodeState", steps: int) -> "tuple[DecodeState, list[int]]": ...

    def prefill(self, prompt_ids: Sequence[int], sampling: "SamplingParams", *,
                choices: Sequence["SamplingParams"] | None = None, start_index: int = 0,
                output_from: int | None = None, stop_ids: Sequence[int] = (),
                masks: "np.ndarray | None" = None, cached=None) -> "Prefix": ...

    def prefill_start(self, prompt_ids: Sequence[int], sampling: "SamplingParams", *,
                      choices: Sequence["SamplingParams"] | None = None, start_index: int = 0,
                      output_from: int | None = None, stop_ids: Sequence[int] = (),
                      masks: "np.ndarray | None" = None) -> "PendingPrefix": ...  # prefill, read later

    def prefill_batch(self, calls: Sequence["PrefillCall"]) -> "list[Prefix]": ...

    def prompt_logprobs(self, prompt_ids: Sequence[int], k: int) -> "list[TokenLogprobs | None]": ...

    def export_prefix(self, prefix: "Prefix") -> "KVPayload": ...

    def import_prefix(self, payload: "KVPayload") -> "Prefix": ...

    def init_state(self) -> "DecodeState": ...

    def insert(self, prefix: "Prefix", state: "DecodeState", slot: int, sampling: "SamplingParams", *,
               first_token: int | None = None, history: Sequence[int] | None = None,
               output_from: int | None = None, start_index: int = 0,
               stop_ids: Sequence[int] = ()) -> "DecodeState": ...

    def insert_payload(self, payload: "KVPayload", state: "DecodeState", slot: int, sampling: "SamplingParams", *,
                       first_token: int | None = None, history: Sequence[int] | None = None,
                       output_from: int | None = None, start_index: int = 0,
                       stop_ids: Sequence[int] = (), cached: "PrefixMatch | None" = None) -> "DecodeState": ...

    def generate(self, state: "DecodeState", rows: int | None = None, *, logprobs: bool = False,
                 masks: "np.ndarray | None" = None, steps: int = 1) -> "tuple[DecodeState, jax.Array]": ...

    @property
    def prompts_pending(self) -> int: ...  # prompts begin_prompt seated, not yet ended by generate_ragged

    def begin_prompt(self, state: "DecodeState", slot: int, ids: Sequence[int], sampling: "SamplingParams", *,
                     output_from: int | None = None, start_index: int = 0, stop_ids: Sequence[int] = (),
                     cached: "PrefixMatch | None" = None) -> "DecodeState": ...

    def generate_ragged(self, state: "DecodeState", rows: int | None = None, *,
                        logprobs: bool = False) -> "tuple[DecodeState, RaggedOut]": ...

    def can_reserve(self, steps: int) -> bool: ...  # reserve(state, steps) would give every active row its blocks

    def verify(self, state: "DecodeState", proposals: Mapping[int, Sequence[int]], k: int, rows: int | None = None, *,
               logprobs: bool = False, masks: "np.ndarray | None" = None, draft_probs: Any = None
               ) -> "tuple[DecodeState, SpecOut]": ...  # speculative decoding's call

    def free(self, state: "DecodeState", slot: int, tokens: Sequence[int] | None = None) -> "DecodeState": ...

    def warmup(self, prefill: bool = True, logprobs: bool = True, masks: bool = False,
               progress: Callable[[int, int, float], None] | None = None,
               direct: bool = False, ragged: bool = False) -> int: ...

    def warm_steps(self, logprobs: bool = True, masks: bool = False) -> list[StepVariant]: ...

    def warm_step(self, state: "DecodeState", variant: StepVariant) -> "DecodeState": ...

    def warmup_prefill(self) -> None: ...

    def defer_batch_compiles(self) -> None: ...

    def batch_shapes(self, max_tokens: int) -> list[tuple[int, int]]: ...

    def warm_batch(self, bucket: int, rows: int) -> None: ...
