"""The Engine: the JetStream-shaped slot API the prefill and decode services drive.

Life of a request through the engine:
  1. prefill pod: `prefill(prompt_ids, sampling)` pads the prompt to a length bucket, runs it, and
     samples token index 0 from the last prompt position -> `Prefix` (device KV + first token).
  2. `export_prefix` copies the KV to host numpy (`KVPayload`); the transport moves only bytes.
  3. decode pod: `import_prefix(payload)` puts it back on the device; `insert(prefix, state, slot,
     sampling)` writes it into a free slot of the `DecodeState` with that request's sampling params.
  4. `generate(state, rows)` runs ONE step for the slots in use (the smallest batch bucket that
     holds slots [0, rows)) and returns tokens still on the device, so the caller can dispatch the
     next step before copying them (pipelining). The token a slot returns
     at its n-th step is token index n.
  5. `free(state, slot)` marks the slot inactive when the request finishes.

Public methods do host work (validation, padding, seeds); private jitted cores do device work and
donate the `DecodeState` so the KV cache is updated in place. The cores take the params and a
hashable `ModelConfig` as arguments, so engines with the same architecture share compiled code.
With tp > 1 they also take a static `Layout` (sharding.py): params and the KV cache arrive
sharded by head, jit propagates that through the layers, and the cores pin only the KV they
return, so a donated cache keeps its sharding step after step. tp == 1 is the unsharded path.

Positions: a slot's position must stay below `max_len`; the caller finishes a request (reason
"length") before its position reaches `max_len`. Past that, writes clamp to the last cache row
and that slot's tokens are garbage (other slots are unaffected).
No I/O, no tokenizer, no settings here.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tandem_core.errors import InvalidRequest, PromptTooLong
from tandem_core.models import ModelInfo, resolve_model
from tandem_core.types import KVPayload, SamplingParams
from tandem_engine.cpu_pool import limit_cpu_threads
from tandem_engine.model import ModelConfig, config_from_info, decode_forward, prefill_forward
from tandem_engine.sampling import sample, sampling_arrays, token_keys
from tandem_engine.sharding import Layout, constrain, make_layout
from tandem_engine.weights import load_params, resolve_dtype

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)


@dataclass
class Prefix:
    """One prefilled prompt on the device. k, v: [num_layers, length, num_kv_heads, head_dim]
    (length = the prefill bucket, >= true_length; rows past true_length are padding)."""

    k: jax.Array
    v: jax.Array
    true_length: int
    first_token: int  # token index 0, already on the host


class DecodeState(NamedTuple):
    """Everything one decode step reads and writes, as device arrays (a pytree)."""

    k: jax.Array  # [num_layers, slots, num_kv_heads, max_len, head_dim] (head-major)
    v: jax.Array  # same
    positions: jax.Array  # int32 [slots]: where each slot's next input token sits
    tokens: jax.Array  # int32 [slots]: each slot's next input token
    active: jax.Array  # bool [slots]
    step: jax.Array  # int32 [slots]: token index the next generate produces
    temperature: jax.Array  # float32 [slots]
    top_k: jax.Array  # int32 [slots]
    top_p: jax.Array  # float32 [slots]
    seeds: jax.Array  # uint32 [slots, 2]


# ---------------------------------------------------------------------------------------------
# jitted cores (device work only)


def _kv(layout: Layout | None, cache: bool):
    if layout is None:
        return None
    return layout.kv_cache() if cache else layout.kv_prefix()


@partial(jax.jit, static_argnames=("cfg", "layout"))
def _prefill_core(params, tokens, true_length, temperature, top_k, top_p, seed, *,
                  cfg: ModelConfig, layout: Layout | None):
    logits, k, v = prefill_forward(params, tokens, true_length, cfg)
    keys = token_keys(seed[None], jnp.zeros((1,), jnp.int32))  # token index 0
    first = sample(logits[None], temperature[None], top_k[None], top_p[None], keys)[0]
    return constrain(k, _kv(layout, False)), constrain(v, _kv(layout, False)), first


@partial(jax.jit, static_argnames=("cfg",))
def _logits_core(params, tokens, true_length, *, cfg: ModelConfig):
    return prefill_forward(params, tokens, true_length, cfg)[0]


@partial(jax.jit, static_argnames=("layout",), donate_argnums=(0,))
def _insert_core(state: DecodeState, k, v, slot, true_length, first_token, temperature, top_k,
                 top_p, seed, *, layout: Layout | None) -> DecodeState:
    # k, v [L, length, KV, hd] -> rows [0, length) of `slot` in the head-major cache [L, slots, KV,
    # max_len, hd]; rows past true_length are masked until decode overwrites them, and so is
    # whatever a previous occupant left further on.
    start = (0, slot, 0, 0, 0)
    cache = _kv(layout, True)

    def rows(x):
        return jnp.swapaxes(x, 1, 2)[:, None].astype(state.k.dtype)  # [L, 1, KV, length, hd]

    return state._replace(
        k=constrain(jax.lax.dynamic_update_slice(state.k, rows(k), start), cache),
        v=constrain(jax.lax.dynamic_update_slice(state.v, rows(v), start), cache),
        positions=state.positions.at[slot].set(true_length),
        tokens=state.tokens.at[slot].set(first_token),
        active=state.active.at[slot].set(True),
        step=state.step.at[slot].set(1),
        temperature=state.temperature.at[slot].set(temperature),
        top_k=state.top_k.at[slot].set(top_k),
        top_p=state.top_p.at[slot].set(top_p),
        seeds=state.seeds.at[slot].set(seed),
    )


@partial(jax.jit, static_argnames=("cfg", "layout", "rows"), donate_argnums=(1,))
def _generate_core(params, state: DecodeState, *, cfg: ModelConfig, layout: Layout | None, rows: int):
    # Only slots [0, rows) are computed (the caller keeps every active slot below `rows`): a step
    # costs what the batch in use costs, not what the slot count would. Rows past it stay as they are.
    active = state.active[:rows]
    logits, k, v = decode_forward(params, state.tokens[:rows], state.positions[:rows], state.k, state.v, cfg,
                                 active=active)
    keys = token_keys(state.seeds[:rows], state.step[:rows])
    tokens = sample(logits, state.temperature[:rows], state.top_k[:rows], state.top_p[:rows], keys)
    advance = active.astype(jnp.int32)  # free slots stay put (their tokens are garbage)
    cache = _kv(layout, True)  # the KV keeps its sharding, so the donated buffers are reused
    new = state._replace(
        k=constrain(k, cache), v=constrain(v, cache), tokens=state.tokens.at[:rows].set(tokens),
        positions=state.positions.at[:rows].add(advance), step=state.step.at[:rows].add(advance),
    )
    return new, tokens


@partial(jax.jit, donate_argnums=(0,))
def _free_core(state: DecodeState, slot) -> DecodeState:
    return state._replace(active=state.active.at[slot].set(False))


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
                 tp: int = 1, mesh: Mesh | None = None):
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

    def prefill(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Prefix:
        """Run one prompt; sample its first token (index 0). Blocks until that token is on the
        host (the KV stays on the device)."""
        padded, n = self._pad_prompt(prompt_ids)
        s = sampling_arrays(sampling)
        k, v, first = _prefill_core(
            self.params, padded, np.int32(n), s["temperature"], s["top_k"], s["top_p"], s["seed"],
            cfg=self.cfg, layout=self.layout,
        )
        return Prefix(k=k, v=v, true_length=n, first_token=int(first))

    def prompt_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """float32 logits [vocab] at the last prompt position, computed exactly as `prefill`
        computes them (same bucket, same sharding). For parity checks and scoring."""
        padded, n = self._pad_prompt(prompt_ids)
        return np.asarray(_logits_core(self.params, padded, np.int32(n), cfg=self.cfg))

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
        )

    def _check_slot(self, slot: int) -> None:
        if not 0 <= int(slot) < self.slots:
            raise ValueError(f"slot {slot} is out of range [0, {self.slots})")

    def insert(self, prefix: Prefix, state: DecodeState, slot: int,
               sampling: SamplingParams) -> DecodeState:
        """Write `prefix` into `slot` (donates `state`). Its next step produces token index 1."""
        self._check_slot(slot)
        length = prefix.k.shape[1]
        if length > self.max_len:
            raise PromptTooLong(f"prefix has {length} positions; this engine's max_len is {self.max_len}")
        s = sampling_arrays(sampling)
        k, v = prefix.k, prefix.v
        if self.layout is not None:  # a prefix from an engine on other chips moves here first
            k, v = self._place_kv(k), self._place_kv(v)
        elif len(k.devices()) > 1:  # a sharded prefix handed to an unsharded engine
            k, v = jax.device_put(k, state.k.sharding), jax.device_put(v, state.v.sharding)
        return _insert_core(
            state, k, v, np.int32(slot), np.int32(prefix.true_length),
            np.int32(prefix.first_token), s["temperature"], s["top_k"], s["top_p"], s["seed"],
            layout=self.layout,
        )

    def generate(self, state: DecodeState, rows: int | None = None) -> tuple[DecodeState, jax.Array]:
        """One decode step (donates `state`). `rows`: every active slot is below it (None: all
        slots); the step computes the smallest batch bucket >= rows. Returns int32 tokens
        [bucket] still on the device (index by slot): no host round trip here."""
        return _generate_core(self.params, state, cfg=self.cfg, layout=self.layout, rows=self.rows_for(rows))

    def rows_for(self, rows: int | None) -> int:
        """The batch bucket a step over slots [0, rows) computes (powers of two, then `slots`)."""
        if rows is None or rows >= self.slots:
            return self.slots
        return next(b for b in self.batch_buckets if b >= max(1, rows))

    def free(self, state: DecodeState, slot: int) -> DecodeState:
        """Mark `slot` inactive (donates `state`); its KV is left to be overwritten."""
        self._check_slot(slot)
        return _free_core(state, np.int32(slot))

    def warmup(self, prefill: bool = True) -> None:
        """Compile every bucket's insert and every batch bucket's decode step, and with `prefill`
        every bucket's prefill, so no request pays for a compilation (decode pods call this
        before they report ready)."""
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
        state = self.free(state, 0)
        jax.block_until_ready((state, tokens))


def use_compile_cache(path: str) -> None:
    """Keep compiled executables in `path` across processes (JAX's persistent cache, on every
    backend); every compilation is cached, however quick. "" leaves the cache off."""
    if not path:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home in a container: compile every time, say so once
        logging.getLogger(__name__).warning("compilation cache %s unusable (%s); compiling without it", path, e)
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load_engine(model: str = "builtin", *, slots: int = 4, max_len: int = 512,
                prefill_buckets: tuple[int, ...] = DEFAULT_BUCKETS, dtype: str = "float32",
                tp: int = 1, mesh: Mesh | None = None, compile_cache_dir: str = "",
                cpu_threads: int = 0) -> Engine:
    """An Engine for a preset name ("builtin": the shipped trained checkpoint; "tiny", "small-100m":
    random weights) or a HF Llama directory.

    tp > 1 splits weights and KV over the first tp devices; or pass a `mesh` with a "tp" axis.
    num_kv_heads and intermediate_size must be divisible by tp (ValueError otherwise, checked
    before any weight is read)."""
    use_compile_cache(compile_cache_dir)
    limit_cpu_threads(cpu_threads)  # before anything starts a backend
    info = resolve_model(model)
    if tp == 0:  # all local devices (the chips of this TPU host)
        tp = len(jax.devices())
    make_layout(info, tp, mesh)  # fail fast on a bad tp
    params = load_params(info, dtype)
    return Engine(info, params, slots=slots, max_len=max_len, prefill_buckets=prefill_buckets,
                  dtype=dtype, tp=tp, mesh=mesh)
