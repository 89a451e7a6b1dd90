"""The Engine: the JetStream-shaped slot API the prefill and decode services drive.

Life of a request through the engine:
  1. prefill pod: `prefill(prompt_ids, sampling)` pads the prompt to a length bucket, runs it, and
     samples token index 0 from the last prompt position -> `Prefix` (device KV + first token).
  2. `export_prefix` copies the KV to host numpy (`KVPayload`); the transport moves only bytes.
  3. decode pod: `import_prefix(payload)` puts it back on the device; `insert(prefix, state, slot,
     sampling)` writes it into a free slot of the `DecodeState` with that request's sampling params.
  4. `generate(state)` runs ONE step for every slot and returns tokens still on the device, so the
     caller can dispatch the next step before copying them (pipelining). The token a slot returns
     at its n-th step is token index n.
  5. `free(state, slot)` marks the slot inactive when the request finishes.

Public methods do host work (validation, padding, seeds); private jitted cores do device work and
donate the `DecodeState` so the KV cache is updated in place. The cores take the params and a
hashable `ModelConfig` as arguments, so engines with the same architecture share compiled code.

Positions: a slot's position must stay below `max_len`; the caller finishes a request (reason
"length") before its position reaches `max_len`. Past that, writes clamp to the last cache row
and that slot's tokens are garbage (other slots are unaffected).
No I/O, no tokenizer, no settings here.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tandem_core.errors import InvalidRequest, PromptTooLong
from tandem_core.models import ModelInfo, resolve_model
from tandem_core.types import KVPayload, SamplingParams
from tandem_engine.model import ModelConfig, config_from_info, decode_forward, prefill_forward
from tandem_engine.sampling import sample, sampling_arrays, token_keys
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

    k: jax.Array  # [num_layers, slots, max_len, num_kv_heads, head_dim]
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


@partial(jax.jit, static_argnames=("cfg",))
def _prefill_core(params, tokens, true_length, temperature, top_k, top_p, seed, *, cfg: ModelConfig):
    logits, k, v = prefill_forward(params, tokens, true_length, cfg)
    keys = token_keys(seed[None], jnp.zeros((1,), jnp.int32))  # token index 0
    first = sample(logits[None], temperature[None], top_k[None], top_p[None], keys)[0]
    return k, v, first


@partial(jax.jit, donate_argnums=(0,))
def _insert_core(state: DecodeState, k, v, slot, true_length, first_token, temperature, top_k,
                 top_p, seed) -> DecodeState:
    # k, v [L, length, KV, hd] -> rows [0, length) of `slot`; rows past true_length are masked
    # until decode overwrites them, and so is whatever a previous occupant left further on.
    start = (0, slot, 0, 0, 0)
    return state._replace(
        k=jax.lax.dynamic_update_slice(state.k, k[:, None].astype(state.k.dtype), start),
        v=jax.lax.dynamic_update_slice(state.v, v[:, None].astype(state.v.dtype), start),
        positions=state.positions.at[slot].set(true_length),
        tokens=state.tokens.at[slot].set(first_token),
        active=state.active.at[slot].set(True),
        step=state.step.at[slot].set(1),
        temperature=state.temperature.at[slot].set(temperature),
        top_k=state.top_k.at[slot].set(top_k),
        top_p=state.top_p.at[slot].set(top_p),
        seeds=state.seeds.at[slot].set(seed),
    )


@partial(jax.jit, static_argnames=("cfg",), donate_argnums=(1,))
def _generate_core(params, state: DecodeState, *, cfg: ModelConfig):
    logits, k, v = decode_forward(params, state.tokens, state.positions, state.k, state.v, cfg)
    keys = token_keys(state.seeds, state.step)
    tokens = sample(logits, state.temperature, state.top_k, state.top_p, keys)
    advance = state.active.astype(jnp.int32)  # free slots stay put (their tokens are garbage)
    new = state._replace(
        k=k, v=v, tokens=tokens, positions=state.positions + advance, step=state.step + advance,
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
    and MUST NOT be used again)."""

    def __init__(self, info: ModelInfo, params: dict, *, slots: int = 4, max_len: int = 512,
                 prefill_buckets: Sequence[int] = DEFAULT_BUCKETS, dtype: str = "float32"):
        if slots < 1 or max_len < 1:
            raise ValueError(f"slots ({slots}) and max_len ({max_len}) must be positive")
        if max_len > info.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} exceeds the model's max_position_embeddings "
                f"{info.max_position_embeddings}"
            )
        self.info = info
        self.cfg = config_from_info(info)
        self.params = params
        self.slots = int(slots)
        self.max_len = int(max_len)
        self.buckets = tuple(sorted({int(b) for b in prefill_buckets if 0 < b <= max_len})) or (
            self.max_len,
        )
        self.dtype = dtype
        self._jdtype = resolve_dtype(dtype)

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

    def prefill(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Prefix:
        """Run one prompt; sample its first token (index 0). Blocks until that token is on the
        host (the KV stays on the device)."""
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
        s = sampling_arrays(sampling)
        k, v, first = _prefill_core(
            self.params, padded, np.int32(n), s["temperature"], s["top_k"], s["top_p"], s["seed"],
            cfg=self.cfg,
        )
        return Prefix(k=k, v=v, true_length=n, first_token=int(first))

    def export_prefix(self, prefix: Prefix) -> KVPayload:
        """Device -> host numpy, same layout [num_layers, length, num_kv_heads, head_dim]."""
        return KVPayload(
            k=np.asarray(prefix.k), v=np.asarray(prefix.v),
            true_length=int(prefix.true_length), first_token=int(prefix.first_token),
        )

    def import_prefix(self, payload: KVPayload) -> Prefix:
        """Host -> device. Accepts payloads from any engine serving the same architecture."""
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
            k=jnp.asarray(payload.k, dtype=self._jdtype), v=jnp.asarray(payload.v, dtype=self._jdtype),
            true_length=int(payload.true_length), first_token=int(payload.first_token),
        )

    # -- decode side -----------------------------------------------------------------------

    def init_state(self) -> DecodeState:
        """An all-free DecodeState; the KV cache is allocated here, once."""
        c, s = self.cfg, self.slots
        cache = (c.num_layers, s, self.max_len, c.num_kv_heads, c.head_dim)
        return DecodeState(
            k=jnp.zeros(cache, self._jdtype), v=jnp.zeros(cache, self._jdtype),
            positions=jnp.zeros((s,), jnp.int32), tokens=jnp.zeros((s,), jnp.int32),
            active=jnp.zeros((s,), jnp.bool_), step=jnp.zeros((s,), jnp.int32),
            temperature=jnp.zeros((s,), jnp.float32), top_k=jnp.zeros((s,), jnp.int32),
            top_p=jnp.ones((s,), jnp.float32), seeds=jnp.zeros((s, 2), jnp.uint32),
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
        return _insert_core(
            state, prefix.k, prefix.v, np.int32(slot), np.int32(prefix.true_length),
            np.int32(prefix.first_token), s["temperature"], s["top_k"], s["top_p"], s["seed"],
        )

    def generate(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
        """One decode step for all slots (donates `state`). Returns int32 tokens [slots] still on
        the device: no host round trip here."""
        return _generate_core(self.params, state, cfg=self.cfg)

    def free(self, state: DecodeState, slot: int) -> DecodeState:
        """Mark `slot` inactive (donates `state`); its KV is left to be overwritten."""
        self._check_slot(slot)
        return _free_core(state, np.int32(slot))

    def warmup(self) -> None:
        """Compile every bucket's prefill and insert plus the decode step (for startup probes)."""
        state = self.init_state()
        for b in self.buckets:
            prefix = self.prefill([0] * b, SamplingParams())
            state = self.insert(prefix, state, 0, SamplingParams())
        state, tokens = self.generate(state)
        state = self.free(state, 0)
        jax.block_until_ready((state, tokens))


def load_engine(model: str = "builtin", *, slots: int = 4, max_len: int = 512,
                prefill_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                dtype: str = "float32") -> Engine:
    """An Engine for a preset name ("builtin" == "tiny", "small-100m") or a HF Llama directory."""
    info = resolve_model(model)
    params = load_params(info, dtype)
    return Engine(info, params, slots=slots, max_len=max_len, prefill_buckets=prefill_buckets,
                  dtype=dtype)
