"""The Llama-family decoder as pure functions over a params pytree.

This is the only place that knows the architecture (RMSNorm, RoPE in Hugging Face's rotate_half
convention, grouped-query attention, SwiGLU). It knows nothing about slots, sampling or I/O: the
Engine composes these functions into jitted cores.

Params pytree (weights stored as `x @ W`, i.e. transposed from HF's [out, in]):
    embed   [vocab, d]
    layers  dict of per-layer weights stacked on a leading [num_layers] axis:
            attn_norm [L, d], wq [L, d, H*hd], wk [L, d, KV*hd], wv [L, d, KV*hd], wo [L, H*hd, d],
            mlp_norm [L, d], w_gate [L, d, f], w_up [L, d, f], w_down [L, f, d]
    norm    [d]
    lm_head [d, vocab]   (absent when word embeddings are tied: logits use embed.T)

Three forwards: `prefill_forward` (one padded prompt, returns its KV; `prefill_logits_all` is the
same pass with logits at every position; `prefill_suffix_forward` the rest of a prompt over a
cached prefix's KV), `decode_forward` (one token per slot against the slot
cache) and `reference_forward` (plain full recompute, no cache, a Python loop over layers) which
tests use as ground truth for the other two.
"""
from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tandem_core.models import ModelInfo


class ModelConfig(NamedTuple):
    """The architecture only (hashable, a static jit argument): two models with the same shapes
    share compiled code whatever their names or paths."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    rope_scaling: tuple = ()  # sorted (key, value) items of HF's rope_scaling, () when none


def config_from_info(info: ModelInfo) -> ModelConfig:
    scaling = (info.extra or {}).get("rope_scaling") or {}
    return ModelConfig(
        vocab_size=info.vocab_size, hidden_size=info.hidden_size, num_layers=info.num_layers,
        num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
        rope_theta=float(info.rope_theta), rms_norm_eps=float(info.rms_norm_eps),
        rope_scaling=tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (list, dict)))),
    )


# ---------------------------------------------------------------------------------------------
# building blocks


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back to the activation dtype (as HF does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32.astype(x.dtype) * w).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [head_dim // 2], with HF's "linear" and "llama3" rope_scaling."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    scaling = dict(cfg.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return jnp.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotate x [..., T, heads, hd] by positions [..., T] in HF's rotate_half layout."""
    freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)  # [..., T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., T, 1, hd]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


def mlp(x: jax.Array, lp: dict) -> jax.Array:
    return (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]


def logits_from_hidden(params: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and LM head; logits are float32 whatever the weight dtype."""
    h = rms_norm(h, params["norm"], cfg.rms_norm_eps)
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return (h @ head).astype(jnp.float32)


def _qkv(x: jax.Array, lp: dict, positions: jax.Array, cfg: ModelConfig):
    """Project x [..., T, d] to rotated q [..., T, H, hd], k and v [..., T, KV, hd]."""
    lead = x.shape[:-1]
    q = (x @ lp["wq"]).reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = (x @ lp["wk"]).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = (x @ lp["wv"]).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    return rope(q, positions, cfg), rope(k, positions, cfg), v


def _grouped_attention(q, k, v, mask, cfg: ModelConfig) -> jax.Array:
    """q [B, T, H, hd]; k, v [B, S, KV, hd]; mask [B, T, S] (True = attend). Returns [B, T, H*hd].

    Query heads are grouped per KV head (no repeat of K/V); softmax runs in float32.
    """
    b, t = q.shape[:2]
    groups = cfg.num_heads // cfg.num_kv_heads
    qg = q.reshape(b, t, cfg.num_kv_heads, groups, cfg.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(cfg.head_dim)
    scores = jnp.where(mask[:, None, None, :, :], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, cfg.num_heads * cfg.head_dim)


# ---------------------------------------------------------------------------------------------
# prefill: one padded prompt


def prefill_forward(params: dict, tokens: jax.Array, true_length: jax.Array, cfg: ModelConfig):
    """Run one prompt padded to a bucket.

    tokens [T] int32 (positions >= true_length are padding; the causal mask keeps them out of the
    real positions). Returns (logits [vocab] at position true_length - 1, k, v) with k and v
    [num_layers, T, KV, hd] in the weight dtype.
    """
    x, ks, vs = _prefill_layers(params, tokens, cfg)
    last = jax.lax.dynamic_index_in_dim(x, true_length - 1, axis=0, keepdims=False)
    return logits_from_hidden(params, last, cfg), ks, vs


def prefill_logits_all(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Logits [T, vocab] at every position of one padded prompt (prompt logprobs, echo): the
    same layers as `prefill_forward`, the LM head on every row instead of the last real one."""
    x, _, _ = _prefill_layers(params, tokens, cfg)
    return logits_from_hidden(params, x, cfg)


def _prefill_layers(params: dict, tokens: jax.Array, cfg: ModelConfig):
    """Hidden states [T, d] after the last layer, and the KV [num_layers, T, KV, hd]."""
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)
    mask = (positions[None, :] <= positions[:, None])[None]  # [1, T, T] causal
    x = params["embed"][tokens][None]  # [1, T, d]

    def layer(x, lp):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = _qkv(h, lp, positions[None], cfg)
        x = x + _grouped_attention(q, k, v, mask, cfg) @ lp["wo"]
        x = x + mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp)
        return x, (k[0], v[0])

    x, (ks, vs) = jax.lax.scan(layer, x, params["layers"])
    return x[0], ks, vs


def prefill_suffix_forward(params: dict, tokens: jax.Array, start: jax.Array, true_length: jax.Array,
                           k_buf: jax.Array, v_buf: jax.Array, cfg: ModelConfig):
    """Prefill the rest of a prompt over KV already computed for its first `start` tokens (a
    prefix-cache hit; JetStream's `existing_prefix`).

    tokens [T] int32: prompt tokens start .. start + true_length - 1, then padding. k_buf, v_buf
    [num_layers, S, KV, hd]: rows [0, start) hold the cached prefix's KV (the rest is ignored and
    overwritten). The suffix's KV is written at rows start + i (rows past S are dropped: only
    padding lands there as long as start + true_length <= S) and each suffix position attends to
    every row <= its own. Returns (logits [vocab] at prompt position start + true_length - 1, k, v
    [num_layers, S, KV, hd]): the same arrays `prefill_forward` returns for the whole prompt padded
    to S, up to float rounding in the row blocking.
    """
    t, s = tokens.shape[0], k_buf.shape[1]
    positions = start + jnp.arange(t, dtype=jnp.int32)
    mask = (jnp.arange(s)[None, :] <= positions[:, None])[None]  # [1, T, S]
    x = params["embed"][tokens][None]  # [1, T, d]

    def layer(x, xs):
        lp, kc, vc = xs  # kc, vc [S, KV, hd]
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = _qkv(h, lp, positions[None], cfg)
        kc = kc.at[positions].set(k[0].astype(kc.dtype), mode="drop")
        vc = vc.at[positions].set(v[0].astype(vc.dtype), mode="drop")
        x = x + _grouped_attention(q, kc[None], vc[None], mask, cfg) @ lp["wo"]
        x = x + mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp)
        return x, (kc, vc)

    x, (ks, vs) = jax.lax.scan(layer, x, (params["layers"], k_buf, v_buf))
    last = jax.lax.dynamic_index_in_dim(x[0], true_length - 1, axis=0, keepdims=False)
    return logits_from_hidden(params, last, cfg), ks, vs


# ---------------------------------------------------------------------------------------------
# decode: one token per slot


DECODE_CHUNK = 256  # cache positions per step of the decode attention loop


def decode_chunks(positions: jax.Array, max_len: int, chunk: int = DECODE_CHUNK,
                  active: jax.Array | None = None) -> jax.Array:
    """How many chunks of the cache a decode step visits: ceil((max(positions) + 1) / chunk) over
    the active slots (all slots when `active` is None), at least 1 and at most
    ceil(max_len / chunk). An int32 scalar computed on the device (no host round trip)."""
    chunk = min(chunk, max_len)
    if active is not None:  # a freed slot keeps its old position; it must not lengthen the loop
        positions = jnp.where(active, positions, 0)
    longest = jnp.minimum(jnp.max(positions), max_len - 1) + 1
    return jnp.maximum((longest + chunk - 1) // chunk, 1).astype(jnp.int32)


def chunked_decode_attention(q, k_cache, v_cache, layer, positions, cfg: ModelConfig,
                             chunk: int = DECODE_CHUNK, num_chunks: jax.Array | None = None):
    """Flash-decoding over the cache of one layer, reading only the chunks in use.

    q [rows, 1, H, hd]; k_cache, v_cache [num_layers, slots >= rows, KV, max_len, hd] (head-major;
    only the first rows slots are read); layer: which layer; positions [rows]: slot s attends to
    cache rows <= positions[s]. The loop visits `num_chunks` chunks (default
    `decode_chunks(positions, max_len, chunk)`) of `chunk` rows (a dynamic_slice each, so shapes
    stay static) with an online softmax in float32: a running max, sum and weighted values. Rows
    past the last chunk are not read; a slot whose position lies beyond them (only an inactive one)
    gets garbage, never NaN, as row 0 is always read.
    Query heads are grouped per KV head as in `_grouped_attention` (no repeat of K/V).
    Returns (out [slots, 1, H*hd] in q's dtype, the number of chunks visited).
    """
    slots, max_len = q.shape[0], k_cache.shape[3]
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    groups = cfg.num_heads // kvh
    chunk = min(chunk, max_len)
    n = decode_chunks(positions, max_len, chunk) if num_chunks is None else num_chunks
    qg = q.reshape(slots, kvh, groups, hd)
    scale = 1.0 / math.sqrt(hd)

    def body(carry):
        c, m, l, acc = carry
        # the last chunk may be clamped back to end at max_len: rows an earlier chunk already
        # covered (< c * chunk) are masked out, so none counts twice
        start = jnp.minimum(c * chunk, max_len - chunk)
        k = jax.lax.dynamic_slice(k_cache, (layer, 0, 0, start, 0), (1, slots, kvh, chunk, hd))[0]
        v = jax.lax.dynamic_slice(v_cache, (layer, 0, 0, start, 0), (1, slots, kvh, chunk, hd))[0]
        rows = start + jnp.arange(chunk)
        ok = (rows[None, :] >= c * chunk) & (rows[None, :] <= positions[:, None])  # [slots, chunk]
        # The barriers keep XLA CPU from fusing the softmax into the two batched matmuls: fused,
        # they lose the matmul kernel (measured: 6.8 -> 5.1 ms for 4 layers at 32 slots).
        s = jax.lax.optimization_barrier(
            jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32)) * scale
        s = jnp.where(ok[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # finite: row 0 is in chunk 0 for every slot
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=-1)
        pv = jax.lax.optimization_barrier(jnp.einsum(
            "bkgs,bksd->bkgd", jax.lax.optimization_barrier(p.astype(v.dtype)), v, preferred_element_type=jnp.float32))
        return c + 1, m_new, l, alpha[..., None] * acc + pv

    init = (jnp.int32(0), jnp.full((slots, kvh, groups), -jnp.inf, jnp.float32),
            jnp.zeros((slots, kvh, groups), jnp.float32), jnp.zeros((slots, kvh, groups, hd), jnp.float32))
    visited, _, l, acc = jax.lax.while_loop(lambda carry: carry[0] < n, body, init)
    out = (acc / l[..., None]).astype(q.dtype)
    return out.reshape(slots, 1, cfg.num_heads * hd), visited


def decode_forward(params: dict, tokens, positions, k_cache, v_cache, cfg: ModelConfig,
                   active: jax.Array | None = None):
    """One step for the first `rows` slots (rows = len(tokens) <= the cache's slots).

    tokens, positions [rows] int32: each slot's input token and the position it sits at. k_cache,
    v_cache [num_layers, slots, KV, max_len, hd] (head-major: each head's rows are contiguous, so
    attention is a plain batched matmul); only slots [0, rows) are read or written. The new K/V are
    written at `positions` (clamped to max_len - 1: staying below max_len is the caller's job) and
    each slot attends to cache positions <= its own position. Attention reads the cache in chunks up
    to the longest slot's position only (`chunked_decode_attention`), so a step's cost follows the
    tokens in use, not max_len; `active` [slots] bool (optional) leaves free slots out of that
    length (their logits are then garbage).
    Returns (logits [slots, vocab], k_cache, v_cache).
    """
    slots, max_len = tokens.shape[0], k_cache.shape[3]
    write_pos = jnp.minimum(positions, max_len - 1)
    slot_idx = jnp.arange(slots)
    num_chunks = decode_chunks(write_pos, max_len, active=active)  # once for all layers
    x = params["embed"][tokens][:, None, :]  # [slots, 1, d]

    def layer(carry, xs):
        x, kc, vc = carry
        lp, i = xs
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = _qkv(h, lp, positions[:, None], cfg)  # k, v [slots, 1, KV, hd]
        # the whole cache rides in the carry so XLA updates it in place (the state is donated)
        # head-major cache: [layer, slot, kv head, position, hd]; k[:, 0] is [slots, KV, hd]
        kc = kc.at[i, slot_idx, :, write_pos].set(k[:, 0].astype(kc.dtype))
        vc = vc.at[i, slot_idx, :, write_pos].set(v[:, 0].astype(vc.dtype))
        attn, _ = chunked_decode_attention(q, kc, vc, i, write_pos, cfg, num_chunks=num_chunks)
        x = x + attn @ lp["wo"]
        x = x + mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp)
        return (x, kc, vc), None

    xs = (params["layers"], jnp.arange(cfg.num_layers))
    (x, k_cache, v_cache), _ = jax.lax.scan(layer, (x, k_cache, v_cache), xs)
    return logits_from_hidden(params, x[:, 0], cfg), k_cache, v_cache


# ---------------------------------------------------------------------------------------------
# reference: the plainest possible full recompute


def reference_forward(params: dict, tokens, cfg: ModelConfig) -> jax.Array:
    """Logits [T, vocab] for every position of `tokens` [T]: no cache, no scan, no grouping
    (K/V heads are repeated as HF does). Ground truth for tests; not used when serving."""
    tokens = jnp.asarray(tokens, jnp.int32)
    t = tokens.shape[0]
    positions = jnp.arange(t)
    causal = positions[None, :] <= positions[:, None]
    x = params["embed"][tokens]  # [T, d]
    groups = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        lp = jax.tree.map(lambda w: w[i], params["layers"])
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = _qkv(h, lp, positions, cfg)  # [T, heads, hd]
        k = jnp.repeat(k, groups, axis=1)
        v = jnp.repeat(v, groups, axis=1)
        scores = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32))
        scores = jnp.where(causal[None], scores / math.sqrt(cfg.head_dim), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("hts,shd->thd", probs, v.astype(jnp.float32)).astype(x.dtype)
        x = x + attn.reshape(t, -1) @ lp["wo"]
        x = x + mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp)
    return logits_from_hidden(params, x, cfg)


@partial(jax.jit, static_argnames=("cfg",))
def _reference_logits_at(params, tokens, index, cfg: ModelConfig):
    return reference_forward(params, tokens, cfg)[index]


def reference_greedy(params: dict, cfg: ModelConfig, prompt_ids, num_tokens: int,
                     pad_to: int = 128) -> list[int]:
    """Greedy tokens by full recompute of the growing sequence (the single-process reference run).

    The sequence is zero-padded to `pad_to` (one compile; the causal mask keeps padding out of the
    real positions), so len(prompt_ids) + num_tokens must be <= pad_to.
    """
    ids = [int(t) for t in prompt_ids]
    if len(ids) + num_tokens > pad_to:
        raise ValueError(f"prompt {len(ids)} + {num_tokens} tokens exceeds pad_to {pad_to}")
    out = []
    for _ in range(num_tokens):
        padded = jnp.zeros((pad_to,), jnp.int32).at[: len(ids)].set(jnp.asarray(ids, jnp.int32))
        logits = _reference_logits_at(params, padded, len(ids) - 1, cfg=cfg)
        out.append(int(jnp.argmax(logits)))
        ids.append(out[-1])
    return out
