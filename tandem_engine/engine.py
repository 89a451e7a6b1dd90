"""The Engine: the JetStream-shaped slot API the prefill and decode services drive.

Life of a request through the engine:
  1. prefill pod: `prefill(prompt_ids, sampling)` pads the prompt to a length bucket, runs it, and
     samples the first token (index `start_index`, 0 for a new request) from the last prompt
     position -> `Prefix` (device KV + first token; with `choices`, one first token per choice
     from the same logits; with logprobs on, their logprobs).
  2. `export_prefix` copies the KV to host numpy (`KVPayload`); the transport moves only bytes.
  3. decode pod: `import_prefix(payload)` puts it back on the device; `insert(prefix, state, slot,
     sampling, history=...)` writes it into a free slot of the `DecodeState` with that request's
     sampling params and penalty state (the prompt it holds; the output in it, if resumed).
  4. `generate(state, rows)` runs ONE step for the slots in use (the smallest batch bucket that
     holds slots [0, rows)) and returns tokens still on the device, so the caller can dispatch the
     next step before copying them (pipelining); `logprobs=True` returns them packed with their
     logprobs (logits.py), still one device -> host copy. The token a slot returns at its n-th
     step is token index start_index + n.
  5. `free(state, slot)` marks the slot inactive when the request finishes.

Public methods do host work (validation, padding, seeds); the jitted cores (cores.py) do device
work and donate the `DecodeState` so the KV cache is updated in place. Logits processing
(penalties, logit_bias, min_tokens) and logprobs live in logits.py, in the contract's order.

Positions: a slot's position must stay below `max_len`; the caller finishes a request (reason
"length") before its position reaches `max_len`. Past that, writes clamp to the last cache row
and that slot's tokens are garbage (other slots are unaffected).
No I/O, no tokenizer, no settings here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tandem_core.errors import InvalidRequest, PromptTooLong
from tandem_core.models import ModelInfo
from tandem_core.types import MAX_TOP_LOGPROBS, KVPayload, SamplingParams, TokenLogprobs
from tandem_engine.cores import (DecodeState, free_core, generate_core, insert_core, logits_core,
                                 prefill_cached_core, prefill_core, prompt_logprobs_core)
from tandem_engine.logits import (check_output_from, history_arrays, init_slot_logits, mask_rows, slot_logits,
                                  stack, unpack_logprobs, unpack_tokens)
from tandem_engine.model import config_from_info
from tandem_engine.prefix_cache import Hit
from tandem_engine.sampling import sampling_arrays
from tandem_engine.sharding import make_layout
from tandem_engine.weights import resolve_dtype

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)
__all__ = ["DEFAULT_BUCKETS", "DecodeState", "Engine", "Prefix"]


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


# ---------------------------------------------------------------------------------------------
# the public API (host work)


class Engine:
    """Device work only: token ids in, token ids out. One thread MUST own an Engine and its
    DecodeState (calls are not thread-safe; states passed to insert/generate/free are donated
    and MUST NOT be used again).

    With tp > 1 (or a mesh) the weights and the KV are split across chips by head (see
    sharding.py); every method behaves the same and prefixes cross engines of any tp."""

    def __init__(self, info: ModelInfo, params: dict, *, slots: int = 4, max_len: int = 512,
                 prefill_buckets: Sequence[int] = DEFAULT_BUCKETS, dtype: str = "float32",
                 tp: int = 1, mesh: Mesh | None = None, prefix_chunk: int = 64):
        if slots < 1 or max_len < 1:
            raise ValueError(f"slots ({slots}) and max_len ({max_len}) must be positive")
        if max_len > info.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} exceeds the model's max_position_embeddings "
                f"{info.max_position_embeddings}"
            )
        self.info = info
        self.cfg = config_from_info(info)
        self.layout = make_layout(info, tp, mesh)  # None: one device, unsharded
        self.params = params if self.layout is None else self.layout.place_params(params)
        self.slots = int(slots)
        self.max_len = int(max_len)
        self.buckets = tuple(sorted({int(b) for b in prefill_buckets if 0 < b <= max_len})) or (
            self.max_len,
        )
        # a prompt over a cached prefix runs in chunks of this many tokens (one compiled shape)
        self.prefix_chunk = max(1, min(int(prefix_chunk), self.buckets[-1]))
        self.dtype = dtype
        self._jdtype = resolve_dtype(dtype)
        # Decode steps compile once per batch bucket: 2, 4, 8, ... below slots, and slots itself.
        # No bucket of 1 below slots: XLA CPU turns a one-row cache write into a select plus two
        # copies of the whole cache (seen in the compiled HLO: 12 ms a step instead of 2 at 32 slots).
        self.batch_buckets = tuple(sorted({1 << i for i in range(1, self.slots.bit_length()) if 1 << i < self.slots}
                                          | {self.slots}))

    @property
    def tp(self) -> int:
        return 1 if self.layout is None else self.layout.tp

    @property
    def mesh(self) -> Mesh | None:
        return None if self.layout is None else self.layout.mesh

    def max_prompt_len(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, length: int) -> int:
        """The smallest bucket >= length (PromptTooLong when there is none)."""
        for b in self.buckets:
            if b >= length:
                return b
        raise PromptTooLong(
            f"prompt has {length} tokens but this engine accepts at most {self.max_prompt_len()}",
            param="prompt",
        )

    # -- prefill side ----------------------------------------------------------------------

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
        `cached`: the KV of the prompt's first `cached.length` tokens (`cached.k`, `cached.v` host
        arrays [num_layers, length, num_kv_heads, head_dim], e.g. a `PrefixCache.lookup` hit):
        only the rest of the prompt runs, and the Prefix is the one a full prefill gives."""
        padded, n = self._pad_prompt(prompt_ids)
        picks = [sampling] if choices is None else list(choices)
        if not picks:
            raise InvalidRequest("choices is empty: at least one is required", param="n")
        out_from = check_output_from(output_from, n)
        if int(start_index) < 0:
            raise InvalidRequest(f"start_index must be >= 0, got {start_index}", param="start_index")
        s = _stack_sampling(picks)
        proc = stack([slot_logits(p, self.info.vocab_size, stop_ids) for p in picks])
        if masks is not None and len(masks) != len(picks):
            raise ValueError(f"masks has {len(masks)} rows; the prefill samples {len(picks)} choices")
        m = None if masks is None else mask_rows(masks, len(picks), self.info.vocab_size)
        rest = (np.int32(n), np.int32(out_from), np.int32(start_index), s["temperature"], s["top_k"], s["top_p"],
                s["seed"], proc, m)
        if cached is not None and int(cached.length) > 0:
            k, v, packed = self._prefill_over(padded, n, cached, rest)
        else:
            k, v, packed = prefill_core(self.params, padded, *rest, cfg=self.cfg, layout=self.layout)
        host = np.asarray(packed)  # the one device -> host copy: tokens and logprobs
        tokens = [int(t) for t in unpack_tokens(host)]
        lps = [None if p.logprobs is None else unpack_logprobs(host[i], p.logprobs) for i, p in enumerate(picks)]
        return Prefix(k=k, v=v, true_length=n, first_token=tokens[0], first_tokens=tokens, first_logprobs=lps)

    def _prefill_over(self, padded: np.ndarray, n: int, cached, rest: tuple):
        """The prompt after a cached prefix, in chunks of `prefix_chunk` tokens over one KV buffer
        of the largest bucket (one compiled shape whatever the lengths), then cut to the prompt's
        bucket. The last chunk's first tokens are the prompt's."""
        c, cfg, chunk = int(cached.length), self.cfg, self.prefix_chunk
        if not 0 < c < n:
            raise ValueError(f"a cached prefix of {c} tokens must be shorter than the prompt ({n} tokens)")
        want = (cfg.num_layers, c, cfg.num_kv_heads, cfg.head_dim)
        if tuple(cached.k.shape) != want or tuple(cached.v.shape) != want:
            raise ValueError(f"cached KV has shapes {cached.k.shape}, {cached.v.shape}; this prompt needs {want}")
        size = self.buckets[-1]
        bufs = []
        for kv in (cached.k, cached.v):
            buf = np.zeros((cfg.num_layers, size, cfg.num_kv_heads, cfg.head_dim), self._jdtype)
            buf[:, :c] = kv
            bufs.append(self._place_kv(buf))
        k, v = bufs
        whole = np.zeros((size,), np.int32)
        whole[:n] = padded[:n]
        for start in range(c, n, chunk):
            m = min(chunk, n - start)
            piece = np.zeros((chunk,), np.int32)
            piece[:m] = whole[start:start + m]
            k, v, packed = prefill_cached_core(self.params, piece, np.int32(start), np.int32(m),
                                               k, v, whole, *rest, cfg=self.cfg, layout=self.layout)
        bucket = padded.shape[0]
        return k[:, :bucket], v[:, :bucket], packed

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
        want = (self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim)
        for name, arr in (("k", payload.k), ("v", payload.v)):
            shape = tuple(arr.shape)
            if len(shape) != 4 or (shape[0], shape[2], shape[3]) != want:
                raise InvalidRequest(
                    f"KV payload {name} has shape {shape}; this model needs "
                    f"[{want[0]}, length, {want[1]}, {want[2]}]"
                )
        length = payload.k.shape[1]
        if payload.v.shape[1] != length or not 0 < payload.true_length <= length:
            raise InvalidRequest(
                f"KV payload lengths disagree: k {length}, v {payload.v.shape[1]}, "
                f"true_length {payload.true_length}"
            )
        if length > self.max_len:
            raise PromptTooLong(f"KV payload has {length} positions; this engine's max_len is {self.max_len}")
        return Prefix(
            k=self._place_kv(payload.k), v=self._place_kv(payload.v),
            true_length=int(payload.true_length), first_token=int(payload.first_token),
        )

    def _place_kv(self, kv) -> jax.Array:
        """A prefix array (host or device, any sharding) on this engine's chips, in its dtype."""
        if self.layout is None:
            return jnp.asarray(kv, dtype=self._jdtype)
        if isinstance(kv, np.ndarray):
            kv = np.asarray(kv, dtype=self._jdtype)  # convert on the host, then one transfer
        return jax.device_put(kv, self.layout.kv_prefix()).astype(self._jdtype)

    # -- decode side -----------------------------------------------------------------------

    def init_state(self) -> DecodeState:
        """An all-free DecodeState; the KV cache is allocated here, once."""
        c, s, lay = self.cfg, self.slots, self.layout
        cache = (c.num_layers, s, c.num_kv_heads, self.max_len, c.head_dim)  # head-major
        kv_dev = None if lay is None else lay.kv_cache()  # each chip allocates only its heads
        dev = None if lay is None else lay.replicated()
        return DecodeState(
            k=jnp.zeros(cache, self._jdtype, device=kv_dev),
            v=jnp.zeros(cache, self._jdtype, device=kv_dev),
            positions=jnp.zeros((s,), jnp.int32, device=dev),
            tokens=jnp.zeros((s,), jnp.int32, device=dev),
            active=jnp.zeros((s,), jnp.bool_, device=dev),
            step=jnp.zeros((s,), jnp.int32, device=dev),
            temperature=jnp.zeros((s,), jnp.float32, device=dev),
            top_k=jnp.zeros((s,), jnp.int32, device=dev),
            top_p=jnp.ones((s,), jnp.float32, device=dev),
            seeds=jnp.zeros((s, 2), jnp.uint32, device=dev),
            history=jnp.zeros((s, c.vocab_size), jnp.int32, device=dev),
            processing=init_slot_logits(s, c.vocab_size, dev),
        )

    def _check_slot(self, slot: int) -> None:
        if not 0 <= int(slot) < self.slots:
            raise ValueError(f"slot {slot} is out of range [0, {self.slots})")

    def insert(self, prefix: Prefix, state: DecodeState, slot: int, sampling: SamplingParams, *,
               first_token: int | None = None, history: Sequence[int] | None = None,
               output_from: int | None = None, start_index: int = 0,
               stop_ids: Sequence[int] = ()) -> DecodeState:
        """Write `prefix` into `slot` (donates `state`) with the request's sampling and processing
        params. `first_token` (default prefix.first_token: choice i inserts its own) is token index
        `start_index`; the slot's next step produces start_index + 1.

        `history`: the prompt ids the prefix holds (len == prefix.true_length), the penalty state:
        repetition sees all of it, presence/frequency count history[output_from:] (the output so
        far; default none) plus the first token. None: nothing seen but the first token."""
        self._check_slot(slot)
        length = prefix.k.shape[1]
        if length > self.max_len:
            raise PromptTooLong(f"prefix has {length} positions; this engine's max_len is {self.max_len}")
        first = int(prefix.first_token if first_token is None else first_token)
        if not 0 <= first < self.info.vocab_size:
            raise ValueError(f"first token {first} is outside the vocabulary [0, {self.info.vocab_size})")
        s = sampling_arrays(sampling)
        proc = slot_logits(sampling, self.info.vocab_size, stop_ids)
        hist_ids, hist_len, out_from = history_arrays(history, output_from, prefix.true_length, length,
                                                      self.info.vocab_size)
        k, v = prefix.k, prefix.v
        if self.layout is not None:  # a prefix from an engine on other chips moves here first
            k, v = self._place_kv(k), self._place_kv(v)
        elif len(k.devices()) > 1:  # a sharded prefix handed to an unsharded engine
            k, v = jax.device_put(k, state.k.sharding), jax.device_put(v, state.v.sharding)
        return insert_core(
            state, k, v, np.int32(slot), np.int32(prefix.true_length), np.int32(first),
            np.int32(int(start_index) + 1), s["temperature"], s["top_k"], s["top_p"], s["seed"],
            hist_ids, np.int32(hist_len), np.int32(out_from), proc, layout=self.layout,
        )

    def generate(self, state: DecodeState, rows: int | None = None, *, logprobs: bool = False,
                 masks: np.ndarray | None = None) -> tuple[DecodeState, jax.Array]:
        """One decode step (donates `state`). `rows`: every active slot is below it (None: all
        slots); the step computes the smallest batch bucket >= rows. Returns int32 tokens
        [bucket] still on the device (index by slot): no host round trip here. `logprobs=True`
        (a second compiled variant): int32 [bucket, PACKED_WIDTH] instead, tokens and logprobs
        packed (read with logits.unpack_tokens / unpack_logprobs). `masks` (grammars): int32
        [<= bucket, ceil(vocab / 32)] allowed-token bitmasks by slot, all-ones for an
        unconstrained slot (missing rows are padded so); a compiled variant of its own, so a
        batch without masks runs the unmasked step."""
        bucket = self.rows_for(rows)
        m = None if masks is None else mask_rows(masks, bucket, self.info.vocab_size)
        return generate_core(self.params, state, m, cfg=self.cfg, layout=self.layout, rows=bucket,
                             logprobs=bool(logprobs))

    def rows_for(self, rows: int | None) -> int:
        """The batch bucket a step over slots [0, rows) computes (powers of two, then `slots`)."""
        if rows is None or rows >= self.slots:
            return self.slots
        return next(b for b in self.batch_buckets if b >= max(1, rows))

    def free(self, state: DecodeState, slot: int) -> DecodeState:
        """Mark `slot` inactive (donates `state`); its KV is left to be overwritten."""
        self._check_slot(slot)
        return free_core(state, np.int32(slot))

    def warmup_prefix(self) -> None:
        """Compile the prefill over a cached prefix (one shape for every length: `_prefill_over`)."""
        c = self.cfg
        if self.buckets[-1] < 2:
            return
        kv = np.zeros((c.num_layers, 1, c.num_kv_heads, c.head_dim), self._jdtype)
        self.prefill([0, 0], SamplingParams(), cached=Hit(kv, kv, length=1, blocks=1))

    def warmup_prefill(self) -> None:
        """Compile every bucket's prefill (one choice): what a prefill pod runs, before it reports
        ready, so no request pays for a compilation (with the persistent compilation cache a
        restart loads them: 1.7 s for the built-in model's six buckets on 2 CPU cores, 9.7 s cold)."""
        for b in self.buckets:
            self.prefill([0] * b, SamplingParams())

    def warmup(self, prefill: bool = True, logprobs: bool = True, masks: bool = False, prefix: bool = False) -> None:
        """Compile every bucket's insert and every batch bucket's decode step (with `logprobs`
        its logprobs variant too: it doubles the step compiles; with `masks` the grammar-masked
        step too), and with `prefill` every bucket's prefill (one choice), so no request pays for
        a compilation (decode pods call this before they report ready). `prefix`: the prefill over a
        cached prefix too (`warmup_prefix`)."""
        if prefix:
            self.warmup_prefix()
        state = self.init_state()
        c = self.cfg
        for b in self.buckets:
            if prefill:
                prefix = self.prefill([0] * b, SamplingParams())
            else:
                kv = jnp.zeros((c.num_layers, b, c.num_kv_heads, c.head_dim), self._jdtype)
                prefix = Prefix(kv, kv, 1, 0)
            state = self.insert(prefix, state, 0, SamplingParams())
        for rows in self.batch_buckets:
            state, tokens = self.generate(state, rows)
            if logprobs:
                state, tokens = self.generate(state, rows, logprobs=True)
            if masks:
                ones = np.full((rows, (self.info.vocab_size + 31) // 32), -1, np.int32)
                state, tokens = self.generate(state, rows, masks=ones)
        state = self.free(state, 0)
        jax.block_until_ready((state, tokens))
