"""The Engine's prefill side: a prompt in, its KV on the device and its first tokens out (`Prefix`),
and the KV's moves between device and host (`export_prefix`, `import_prefix`).

What a prefill pod runs (and a decode pod that prefills locally). Steps 1-2 of the request's life
in engine.py's docstring. The decode side (engine_decode.py) only ever sees a `Prefix`.
No I/O, no tokenizer, no settings here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import jax
import numpy as np

from tandem_core.errors import InvalidRequest
from tandem_core.types import MAX_TOP_LOGPROBS, KVPayload, SamplingParams, TokenLogprobs
from tandem_engine.api import PrefillCall
from tandem_engine.cores import (CoreCall, logits_core, prefill_batch_core, prefill_core,
                                 prompt_logprobs_core)
from tandem_engine.engine_base import EngineBase
from tandem_engine.logits import (SlotLogits, check_output_from, mask_rows, slot_logits, stack,
                                  unpack_logprobs, unpack_tokens)
from tandem_engine.sampling import sampling_arrays


@dataclass
class Prefix:
    """One prefilled prompt on the device. k, v: [num_layers, length, num_kv_heads, head_dim]
    (length = the prefill bucket, >= true_length; rows past true_length are padding).
    One first token per choice (`first_token == first_tokens[0]`), already on the host, and its
    logprobs when the request asked for them (None otherwise)."""

    k: jax.Array
    v: jax.Array
    true_length: int
    first_token: int
    first_tokens: list[int] = field(default_factory=list)
    first_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    def __post_init__(self):
        if not self.first_tokens:
            self.first_tokens = [int(self.first_token)]
        if not self.first_logprobs:
            self.first_logprobs = [None] * len(self.first_tokens)


def _stack_sampling(picks: Sequence[SamplingParams]) -> dict[str, np.ndarray]:
    rows = [sampling_arrays(p) for p in picks]
    return {name: np.stack([r[name] for r in rows]) for name in rows[0]}


class PrefillSide(EngineBase):
    """Prefill, prompt scoring and the KV's host moves (see engine.Engine for the calling rules)."""

    def _pad_prompt(self, prompt_ids: Sequence[int]) -> tuple[np.ndarray, int]:
        """Validated prompt zero-padded to its bucket, and its true length."""
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        n = int(ids.shape[0])
        if n == 0:
            raise InvalidRequest("prompt is empty: at least one token is required", param="prompt")
        if ids.min() < 0 or ids.max() >= self.info.vocab_size:
            raise InvalidRequest(
                f"prompt token ids must be in [0, {self.info.vocab_size}); got "
                f"min {int(ids.min())}, max {int(ids.max())}",
                param="prompt",
            )
        bucket = self.bucket_for(n)
        padded = np.zeros((bucket,), np.int32)
        padded[:n] = ids
        return padded, n

    def _prepare_masked(self, prompt_ids, sampling, choices, start_index, output_from, stop_ids, masks):
        """`_prepare` for `prefill`: the choices (one `sampling`, or
        `choices`) first, and the grammar masks checked against them and appended to the rest."""
        picks = [sampling] if choices is None else list(choices)
        padded, n, rest = self._prepare(prompt_ids, picks, start_index, output_from, stop_ids)
        if masks is not None and len(masks) != len(picks):
            raise ValueError(f"masks has {len(masks)} rows; the prefill samples {len(picks)} choices")
        m = None if masks is None else mask_rows(masks, len(picks), self.info.vocab_size)
        return picks, padded, n, (*rest, m)

    def prefill(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                choices: Sequence[SamplingParams] | None = None, start_index: int = 0,
                output_from: int | None = None, stop_ids: Sequence[int] = (),
                masks: np.ndarray | None = None, cached=None) -> Prefix:
        """Run one prompt (one forward pass) and sample its first token, token index
        `start_index`: one per element of `choices` (each with its own params and seed, all from
        the same logits), else one from `sampling`. Blocks until the tokens are on the host (the KV
        stays on the device).

        `output_from`: where output already streamed starts in prompt_ids (a resumed request;
        default: no output yet). Repetition penalty sees all of prompt_ids, presence/frequency
        count prompt_ids[output_from:]. min_tokens holds `stop_ids` back while start_index <
        min_tokens. A choice with logprobs on gets its first token's logprobs in `first_logprobs`.
        `masks`: int32 [choices, ceil(vocab / 32)] allowed-token bitmasks (grammars; all-ones for
        an unconstrained choice), applied after processing: sampling and logprobs see them.
        `cached`: a prefill pod's prefix-pool hit (`prefix_pool.BlockHit`, from
        `DevicePrefixCache.lookup`): the prompt's first `cached.length` tokens are read from the
        pool in place, only the rest runs, and the Prefix is the one a full prefill gives."""
        if cached is not None:
            return self._prefill_over_pool(prompt_ids, sampling, choices, start_index, output_from, stop_ids,
                                           masks, cached)
        return self.prefill_start(prompt_ids, sampling, choices=choices, start_index=start_index,
                                  output_from=output_from, stop_ids=stop_ids, masks=masks).result()

    def prefill_start(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                      choices: Sequence[SamplingParams] | None = None, start_index: int = 0,
                      output_from: int | None = None, stop_ids: Sequence[int] = (),
                      masks: np.ndarray | None = None) -> "PendingPrefix":
        """`prefill` (no cached prefix) without its wait: the forward pass is dispatched now
        (JAX's asynchronous dispatch) and `PendingPrefix.result()` reads its first tokens to the
        host. A caller that dispatches other work in between (the decode loop: its next call)
        keeps the device busy while this one runs. Raises here for a bad prompt, as `prefill`."""
        picks, padded, n, rest = self._prepare_masked(prompt_ids, sampling, choices, start_index, output_from,
                                                      stop_ids, masks)
        k, v, packed = self._prefill_call(padded, rest)()
        return PendingPrefix(k, v, n, packed, tuple(picks))

    def prefill_call(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                     choices: Sequence[SamplingParams] | None = None, start_index: int = 0,
                     output_from: int | None = None, stop_ids: Sequence[int] = (),
                     masks: np.ndarray | None = None) -> CoreCall:
        """The one jitted call `prefill` makes for a prompt with no cached prefix, with its
        arguments (aot.py lowers it for chips that are not here)."""
        _, padded, _, rest = self._prepare_masked(prompt_ids, sampling, choices, start_index, output_from,
                                                  stop_ids, masks)
        return self._prefill_call(padded, rest)

    def _prefill_call(self, padded: np.ndarray, rest: tuple) -> CoreCall:
        return CoreCall(prefill_core, (self.params, padded, *rest), dict(cfg=self.cfg, layout=self.layout))

    def _prefill_over_pool(self, prompt_ids, sampling, choices, start_index, output_from, stop_ids, masks,
                           hit) -> Prefix:
        """`prefill` over a `prefix_pool.BlockHit`: the rest of the prompt through the device
        cache's pool, its hit read in place (copied nothing); when the pool has no room for the
        rest, the prompt runs whole. The hit is used up either way, and let go if this raises."""
        cache = hit.cache
        try:
            picks, padded, n, rest = self._prepare_masked(prompt_ids, sampling, choices, start_index, output_from,
                                                          stop_ids, masks)
            if not 0 < hit.length < n:
                raise ValueError(f"a cached prefix of {hit.length} tokens must be shorter than the prompt ({n} tokens)")
            out = cache.prefill_over(self, hit, padded, n, rest)
        except BaseException:
            cache.release(hit)
            raise
        if out is None:  # no blocks for the rest: whole, as a miss
            k, v, packed = self._prefill_call(padded, rest)()
        else:
            k, v, packed = out
        return self._prefix(k, v, n, np.asarray(packed), picks)

    def prefill_batch(self, calls: Sequence[PrefillCall]) -> list[Prefix]:
        """Several prompts of one bucket, each with one choice, in as few forward passes as the
        compiled row counts allow (powers of two: 13 prompts run as 8 + 4 + 1, no padded rows).
        Prefix i is the one `prefill(calls[i]...)` returns alone: the same first token, logprobs
        and KV (rows never see each other). Raises for the whole batch (InvalidRequest names the
        field of the first bad call; ValueError for prompts of different buckets): a caller that
        must fail one bad prompt alone runs the batch's prompts one at a time then."""
        prepared = [self._prepare(c.prompt_ids, [c.sampling], c.start_index, c.output_from, c.stop_ids)
                    for c in calls]
        lengths = {p[0].shape[0] for p in prepared}
        if len(lengths) > 1:
            raise ValueError(f"a batched prefill runs prompts of one bucket; got buckets {sorted(lengths)}")
        out: list[Prefix] = []
        bucket = prepared[0][0].shape[0] if prepared else 0
        while len(out) < len(prepared):
            group = prepared[len(out):]
            group = group[:self._group_rows(bucket, len(group))]
            if len(group) == 1:  # the single prompt's own compiled prefill
                (padded, n, rest), = group
                k, v, packed = self._prefill_call(padded, (*rest, None))()
                out.append(self._prefix(k, v, n, np.asarray(packed), [calls[len(out)].sampling]))
                continue
            k, v, host = self._run_group(group)
            for i, (_, n, _) in enumerate(group):
                out.append(self._prefix(k[:, i], v[:, i], n, host[i], [calls[len(out)].sampling]))
        return out

    def prefill_batch_call(self, calls: Sequence[PrefillCall]) -> CoreCall:
        """The one batched forward pass `prefill_batch` makes for `calls` (prompts of one bucket,
        a power of two of them), with its arguments (aot.py lowers it)."""
        group = [self._prepare(c.prompt_ids, [c.sampling], c.start_index, c.output_from, c.stop_ids) for c in calls]
        if len({p.shape[0] for p, _, _ in group}) != 1 or len(group) & (len(group) - 1):
            raise ValueError("one batched pass runs a power of two of prompts of one bucket")
        return self._group_call(group)

    def _group_call(self, group: list) -> CoreCall:
        cols = list(zip(*(rest for _, _, rest in group)))
        args = [np.stack(col) for col in cols[:-1]] + [SlotLogits(*(np.stack(xs) for xs in zip(*cols[-1])))]
        return CoreCall(prefill_batch_core, (self.params, np.stack([p for p, _, _ in group]), *args),
                        dict(cfg=self.cfg, layout=self.layout))

    def _run_group(self, group: list) -> tuple[jax.Array, jax.Array, np.ndarray]:
        """One batched forward pass over prepared prompts of one bucket: (k, v, packed on the host)."""
        k, v, packed = self._group_call(group)()
        return k, v, np.asarray(packed)  # one device -> host copy for the whole group

    # ---- batched prefills compiled off the serving thread --------------------------------------
    # None: `prefill_batch` groups prompts in any power of two and compiles a new row count on
    # first use. A pod calls `defer_batch_compiles` before it serves: from then on it groups only
    # the row counts `warm_batch` has compiled (each on another thread, while singles serve), so
    # no request waits for a compilation.
    _warm_rows: dict[int, set[int]] | None = None

    def defer_batch_compiles(self) -> None:
        self._warm_rows = {}

    def batch_shapes(self, max_tokens: int) -> list[tuple[int, int]]:
        """(bucket, rows) of every batched prefill a caller grouping at most `max_tokens` padded
        tokens per call runs: rows 2, 4, 8, ... while rows * bucket <= max_tokens, short buckets first."""
        return [(b, 1 << i) for b in self.buckets for i in range(1, max(1, max_tokens // b).bit_length())]

    def warm_batch(self, bucket: int, rows: int) -> None:
        """Compile (running it once, on zeros) the batched prefill of `rows` prompts of `bucket`;
        `prefill_batch` groups that many from then on. Safe beside the thread that owns the engine:
        it touches only the jitted core and the weights, and publishes the row count last."""
        picks = [SamplingParams()]
        group = [self._prepare([0] * bucket, picks, 0, None, ()) for _ in range(rows)]
        jax.block_until_ready(self._run_group(group))
        if self._warm_rows is not None:
            self._warm_rows = {**self._warm_rows, bucket: self._warm_rows.get(bucket, set()) | {rows}}

    def _group_rows(self, bucket: int, n: int) -> int:
        """Prompts the next group takes: the largest power of two <= n (with deferred compiles,
        the largest compiled one, else 1)."""
        top = 1 << (n.bit_length() - 1)
        if self._warm_rows is None:
            return top
        return max((r for r in self._warm_rows.get(bucket, ()) if r <= top), default=1)

    def _prepare(self, prompt_ids: Sequence[int], picks: Sequence[SamplingParams], start_index: int,
                 output_from: int | None, stop_ids: Sequence[int]) -> tuple[np.ndarray, int, tuple]:
        """Validated host arrays of one prompt: (padded ids, true length, prefill_core's arguments
        after the tokens, masks left out)."""
        padded, n = self._pad_prompt(prompt_ids)
        if not picks:
            raise InvalidRequest("choices is empty: at least one is required", param="n")
        out_from = check_output_from(output_from, n)
        if int(start_index) < 0:
            raise InvalidRequest(f"start_index must be >= 0, got {start_index}", param="start_index")
        s = _stack_sampling(picks)
        proc = stack([slot_logits(p, self.info.vocab_size, stop_ids) for p in picks])
        return padded, n, (np.int32(n), np.int32(out_from), np.int32(start_index), s["temperature"], s["top_k"],
                           s["top_p"], s["seed"], proc)

    @staticmethod
    def _prefix(k, v, n: int, host: np.ndarray, picks: Sequence[SamplingParams]) -> Prefix:
        return _prefix(k, v, n, host, picks)

    def prompt_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """float32 logits [vocab] at the last prompt position, computed exactly as `prefill`
        computes them (same bucket, same sharding). For parity checks and scoring."""
        padded, n = self._pad_prompt(prompt_ids)
        return np.asarray(logits_core(self.params, padded, np.int32(n), cfg=self.cfg))

    def prompt_logprobs(self, prompt_ids: Sequence[int], k: int) -> list[TokenLogprobs | None]:
        """Echo's logprobs: None for position 0 (nothing predicts it); for i > 0, the logprob of
        prompt_ids[i] given prompt_ids[:i] from the raw model logits (no penalties) and the top k.
        One forward pass over the prompt's bucket (logits at every position)."""
        if not 0 <= int(k) <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}",
                                 param="prompt_logprobs")
        padded, n = self._pad_prompt(prompt_ids)
        host = np.asarray(prompt_logprobs_core(self.params, padded, cfg=self.cfg))  # row i scores i + 1
        return [None] + [unpack_logprobs(host[i - 1], k) for i in range(1, n)]

    def export_prefix(self, prefix: Prefix) -> KVPayload:
        """Device -> host numpy, same layout [num_layers, length, num_kv_heads, head_dim]
        whatever the tp (a sharded prefix is gathered from its chips)."""
        return KVPayload(
            k=np.asarray(prefix.k), v=np.asarray(prefix.v),
            true_length=int(prefix.true_length), first_token=int(prefix.first_token),
        )

    def import_prefix(self, payload: KVPayload) -> Prefix:
        """Host -> device, split across this engine's chips. Accepts payloads from any engine
        serving the same architecture, whatever its tp or dtype."""
        self.check_payload(payload)
        return Prefix(
            k=self._place_kv(payload.k), v=self._place_kv(payload.v),
            true_length=int(payload.true_length), first_token=int(payload.first_token),
        )


class PendingPrefix(NamedTuple):
    """A prefill dispatched and not waited for (`PrefillSide.prefill_start`): its KV and packed
    first tokens still on the device."""

    k: jax.Array
    v: jax.Array
    true_length: int
    packed: jax.Array
    picks: tuple[SamplingParams, ...]

    def result(self) -> Prefix:
        """The Prefix `prefill` returns: waits for the call (one device -> host copy)."""
        return _prefix(self.k, self.v, self.true_length, np.asarray(self.packed), self.picks)


def _prefix(k, v, n: int, host: np.ndarray, picks: Sequence[SamplingParams]) -> Prefix:
    tokens = [int(t) for t in unpack_tokens(host)]
    lps = [None if p.logprobs is None else unpack_logprobs(host[i], p.logprobs) for i, p in enumerate(picks)]
    return Prefix(k=k, v=v, true_length=n, first_token=tokens[0], first_tokens=tokens, first_logprobs=lps)
