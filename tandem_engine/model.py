"""The decoder of every served family as pure functions over a params pytree.

The architecture is data (`ModelConfig`, arch.py): these functions read it and never ask which
family they run. They know nothing about slots, sampling or I/O: the Engine composes them into
jitted cores.

Params pytree (weights stored as `x @ W`, i.e. transposed from HF's [out, in]):
    embed   [vocab, d]
    layers  dict of per-layer weights stacked on a leading [num_layers] axis:
            attn_norm [L, d], wq [L, d, H*hd], wk [L, d, KV*hd], wv [L, d, KV*hd], wo [L, H*hd, d],
            mlp_norm [L, d], and by the config:
            bq, bk, bv [L, H*hd | KV*hd] (qkv_bias), bo [L, d] (o_bias),
            q_norm, k_norm [L, hd] (qk_norm), attn_post_norm, mlp_post_norm [L, d] (sandwich_norms),
            sinks [L, H] (sinks),
            a dense MLP: w_gate [L, d, f], w_up [L, d, f], w_down [L, f, d];
            or experts: router [L, d, E], router_bias [L, E], we_gate, we_up [L, E, d, f],
            we_down [L, E, f, d], be_gate, be_up [L, E, f], be_down [L, E, d]
    norm    [d]
    lm_head [d, vocab]   (absent when word embeddings are tied: logits use embed.T)
With int8 weights (quantize.py) the attention, MLP and expert matrices are int8 and each has
float32 scales `<name>_scale` [L, (E,) out] beside it; every weight matmul goes through
quantize.linear / expert_in / expert_out / ragged, which read either form.

Layers differ only in data the scan carries beside their weights (`LayerConsts`: each layer's
RoPE frequencies and window), so one scanned body serves Gemma 3's local and global layers alike.
That body is written once, `decoder_layer`: every forward below (and paged.py's, and
reference.py's) runs it and hands it the attention its KV layout needs (where the new K/V are
written and how they are read), so a family's math lives in one place.

The forwards: `prefill_forward` (one padded prompt, returns its KV; `prefill_logits_all` is the
same pass with logits at every position); a prompt's chunk over KV already in the pool (a
prefix hit, a seated prompt) and the decode step over the pool are both paged.py's
`decode_forward_paged`. The
plain full recompute tests use beside transformers as ground truth is reference.py.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tandem_engine.arch import ModelConfig, config_from_info
from tandem_engine.attention import NO_WINDOW, ragged_attention
from tandem_engine.quantize import expert_in, expert_out, linear, ragged

__all__ = ["ModelConfig", "config_from_info", "prefill_batch_forward", "prefill_forward",
           "prefill_logits_all", "split_layers"]


# ---------------------------------------------------------------------------------------------
# building blocks


def rms_norm(x: jax.Array, w: jax.Array, eps: float, cfg: ModelConfig | None = None) -> jax.Array:
    """RMSNorm computed in float32. Llama casts back, then multiplies by w; Gemma and gpt-oss
    multiply by (offset + w) in float32, then cast (`cfg.norm_f32_weight`, `cfg.norm_offset`)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if cfg is not None and cfg.norm_f32_weight:
        return (x32 * (cfg.norm_offset + w.astype(jnp.float32))).astype(x.dtype)
    offset = 0.0 if cfg is None else cfg.norm_offset
    return (x32.astype(x.dtype) * (w + offset if offset else w)).astype(x.dtype)


def _inv_freq(theta: float, scaling_items: tuple, hd: int) -> tuple[jax.Array, float]:
    """Inverse frequencies [hd // 2] and the cos/sin scale (YaRN's attention factor, else 1) for
    HF's default, "linear", "llama3" and "yarn" RoPE."""
    inv = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    scaling = dict(scaling_items)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return jnp.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(theta, scaling, hd)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3, yarn)")


def _yarn(theta: float, s: dict, hd: int) -> tuple[jax.Array, float]:
    """YaRN as transformers computes it (`_compute_yarn_parameters`)."""
    factor = float(s["factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)
    attention = s.get("attention_factor")
    if attention is None:
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return (hd * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(hd // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    pos = theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, float(attention)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [head_dim // 2] of the global layers."""
    return _inv_freq(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim)[0]


class LayerConsts(NamedTuple):
    """What differs between layers besides their weights; stacked on [num_layers] for the scan."""

    inv_freq: jax.Array  # float32 [L, hd / 2]
    rope_scale: jax.Array  # float32 [L]: cos and sin are multiplied by it (YaRN)
    window: jax.Array  # int32 [L]: attend to positions > own - window (NO_WINDOW: global)
    index: jax.Array  # int32 [L]


def layer_consts(cfg: ModelConfig) -> LayerConsts:
    glob, gscale = _inv_freq(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim)
    if cfg.local_rope_theta:
        loc, lscale = _inv_freq(cfg.local_rope_theta, cfg.local_rope_scaling, cfg.head_dim)
    else:
        loc, lscale = glob, gscale
    wins = [cfg.window(i) for i in range(cfg.num_layers)]
    return LayerConsts(
        inv_freq=jnp.stack([loc if w else glob for w in wins]),
        rope_scale=jnp.asarray([lscale if w else gscale for w in wins], jnp.float32),
        window=jnp.asarray([w or NO_WINDOW for w in wins], jnp.int32),
        index=jnp.arange(cfg.num_layers, dtype=jnp.int32),
    )


def rope_tables(positions: jax.Array, inv_freq: jax.Array, scale=1.0) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [..., T, 1, hd] of positions [..., T] (times YaRN's `scale`): what `rope` rotates by."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., T, 1, hd]
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale=1.0, tables=None) -> jax.Array:
    """Rotate x [..., T, heads, hd] by positions [..., T] in HF's rotate_half layout. `tables`:
    `rope_tables(positions, inv_freq, scale)` computed beforehand (positions and inv_freq then unused)."""
    cos, sin = rope_tables(positions, inv_freq, scale) if tables is None else tables
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


def _act(x: jax.Array, name: str) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=(name == "gelu_tanh"))


def mlp(x: jax.Array, lp: dict, cfg: ModelConfig | None = None) -> jax.Array:
    """The feed-forward block of one layer: a dense gated MLP or a mixture of experts."""
    if cfg is not None and cfg.moe:
        return moe(x, lp, cfg)
    act = "silu" if cfg is None else cfg.act
    return linear(_act(linear(x, lp, "w_gate"), act) * linear(x, lp, "w_up"), lp, "w_down")


def _expert_gate(gate: jax.Array, up: jax.Array, cfg: ModelConfig) -> jax.Array:
    if cfg.expert_act == "swiglu_clamped":  # gpt-oss
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))
    return _act(gate, cfg.act) * up


def route(x: jax.Array, lp: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Router: (weights [N, k] in x's dtype, expert ids [N, k]) for tokens x [N, d]."""
    logits = x @ lp["router"]
    if cfg.router_bias:
        logits = logits + lp["router_bias"]
    if cfg.router == "topk_softmax":  # gpt-oss: the top-k logits, then a softmax over them
        top, idx = jax.lax.top_k(logits, cfg.experts_per_tok)
        return jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(x.dtype), idx
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, cfg.experts_per_tok)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x.dtype), idx


def moe(x: jax.Array, lp: dict, cfg: ModelConfig) -> jax.Array:
    """A mixture of experts over x [..., d] (`cfg.moe_impl`: `_moe_ragged` or `_moe_dense`)."""
    return _moe_dense(x, lp, cfg) if cfg.moe_impl == "dense" else _moe_ragged(x, lp, cfg)


def _moe_dense(x: jax.Array, lp: dict, cfg: ModelConfig) -> jax.Array:
    """Every expert on every token, weighted by the router (zero for experts not chosen). What a
    CPU runs best: XLA CPU has no grouped matmul (`ragged_dot` lowers there to a masked dense dot
    over an [E, rows, d] copy of the input, measured 4-8x slower than this at 8-128 tokens, 16
    experts); each expert's weights are still read once a step."""
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    weights, idx = route(flat, lp, cfg)
    n = flat.shape[0]
    comb = jnp.zeros((n, cfg.num_experts), weights.dtype).at[jnp.arange(n)[:, None], idx].add(weights)
    gate = expert_in(flat, lp, "we_gate")
    up = expert_in(flat, lp, "we_up")
    if cfg.expert_bias:
        gate, up = gate + lp["be_gate"], up + lp["be_up"]
    h = _expert_gate(gate, up, cfg) * comb[..., None].astype(gate.dtype)
    out = expert_out(h.astype(x.dtype), lp, "we_down")
    if cfg.expert_bias:
        out = out + comb.astype(out.dtype) @ lp["be_down"]
    return out.astype(x.dtype).reshape(*lead, d)


def _moe_ragged(x: jax.Array, lp: dict, cfg: ModelConfig) -> jax.Array:
    """A mixture of experts over x [..., d] by sorted dispatch and grouped matmuls
    (`jax.lax.ragged_dot`): each (token, chosen expert) pair is one row, rows are sorted by
    expert, and each expert's weights multiply only its rows. Work follows the active
    parameters (k experts per token), not the expert count."""
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    n, k, e = flat.shape[0], cfg.experts_per_tok, cfg.num_experts
    weights, idx = route(flat, lp, cfg)
    expert = idx.reshape(-1)  # [n * k]
    order = jnp.argsort(expert, stable=True)
    rows = flat[order // k]  # [n * k, d], grouped by expert
    sizes = jnp.bincount(expert, length=e).astype(jnp.int32)
    chosen = expert[order]
    gate = ragged(rows, lp, "we_gate", sizes, chosen)
    up = ragged(rows, lp, "we_up", sizes, chosen)
    if cfg.expert_bias:
        gate, up = gate + lp["be_gate"][chosen], up + lp["be_up"][chosen]
    out = ragged(_expert_gate(gate, up, cfg).astype(x.dtype), lp, "we_down", sizes, chosen)
    if cfg.expert_bias:
        out = out + lp["be_down"][chosen]
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(n, k, d)
    return jnp.einsum("nkd,nk->nd", unsorted, weights.astype(out.dtype)).astype(x.dtype).reshape(*lead, d)


def logits_from_hidden(params: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and LM head; logits are float32 whatever the weight dtype (soft-capped where
    the family caps them)."""
    h = rms_norm(h, params["norm"], cfg.rms_norm_eps, cfg)
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    logits = (h @ head).astype(jnp.float32)
    if cfg.final_softcap:
        logits = jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits


def embed(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = params["embed"][tokens]
    if cfg.embed_scale != 1.0:  # Gemma: the scale is cast to the weight dtype first
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    return x


def _qkv(x: jax.Array, lp: dict, positions: jax.Array, lc: LayerConsts, cfg: ModelConfig, tables=None):
    """Project x [..., T, d] to rotated q [..., T, H, hd], k and v [..., T, KV, hd] (`tables`: the
    layer's `rope_tables` of positions, when the caller computed them once for all layers)."""
    lead = x.shape[:-1]
    q, k, v = linear(x, lp, "wq"), linear(x, lp, "wk"), linear(x, lp, "wv")
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps, cfg)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps, cfg)
    return (rope(q, positions, lc.inv_freq, lc.rope_scale, tables),
            rope(k, positions, lc.inv_freq, lc.rope_scale, tables), v)


def _attn_out(x: jax.Array, attn: jax.Array, lp: dict, cfg: ModelConfig) -> jax.Array:
    """The output projection (and Gemma's norm after it), added to the residual stream."""
    o = linear(attn, lp, "wo")
    if cfg.o_bias:
        o = o + lp["bo"]
    if cfg.sandwich_norms:
        o = rms_norm(o, lp["attn_post_norm"], cfg.rms_norm_eps, cfg)
    return x + o


def _ffn(x: jax.Array, lp: dict, cfg: ModelConfig) -> jax.Array:
    h = mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, cfg), lp, cfg)
    if cfg.sandwich_norms:
        h = rms_norm(h, lp["mlp_post_norm"], cfg.rms_norm_eps, cfg)
    return x + h


def _unroll(cfg: ModelConfig) -> int | bool:
    """The layer scan's unroll: 1 (a loop) when serving, True (every layer) where aot.py counts costs."""
    return True if cfg.unroll_layers else 1


def _sinks(lp: dict, cfg: ModelConfig):
    return lp["sinks"] if cfg.sinks else None


# ---------------------------------------------------------------------------------------------
# the decoder layer: one body for every forward


def decoder_layer(x: jax.Array, lp: dict, lc: LayerConsts, positions: jax.Array, cfg: ModelConfig, attention,
                  tables=None):
    """One decoder layer of every family, written once: the prefill forwards, the decode step over
    the KV pool and the reference all run this body.

    x [..., T, d]: the residual stream; lp, lc: the layer's weights and constants; positions: the
    rows' positions (as `rope` takes them); `tables`: the layer's `rope_tables` when the caller
    computed them once for all layers. `attention(q, k, v, sinks)` is the caller's part, what its
    KV does: q [..., T, H, hd], k, v [..., T, KV, hd] (rotated), sinks [H] or None ->
    (out [..., T, H * hd], kv): it writes the new K/V where the layout keeps them and attends
    over them; `kv` (what it wrote, or anything the caller wants back) is returned beside the
    layer's output. Returns (x after the layer, kv)."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, cfg)
    q, k, v = _qkv(h, lp, positions, lc, cfg, tables)
    attn, kv = attention(q, k, v, _sinks(lp, cfg))
    return _ffn(_attn_out(x, attn, lp, cfg), lp, cfg), kv


def layer_loop(params: dict, cfg: ModelConfig):
    """(i, layer i's weights, layer i's constants) for each layer: the forwards whose layers run
    as a Python loop (each layer's KV its own buffers). params["layers"]: stacked or per-layer
    (`split_layers`)."""
    consts = layer_consts(cfg)
    for i in range(cfg.num_layers):
        yield i, _layer_params(params["layers"], i), jax.tree.map(lambda c, i=i: c[i], consts)


# ---------------------------------------------------------------------------------------------
# prefill: one padded prompt


def prefill_forward(params: dict, tokens: jax.Array, true_length: jax.Array, cfg: ModelConfig):
    """Run one prompt padded to a bucket.

    tokens [T] int32 (positions >= true_length are padding; the causal mask keeps them out of the
    real positions). Returns (logits [vocab] at position true_length - 1, k, v) with k and v
    [num_layers, T, KV, hd] in the weight dtype.
    """
    x, ks, vs = _prefill_layers(params, tokens[None], cfg)
    last = jax.lax.dynamic_index_in_dim(x[0], true_length - 1, axis=0, keepdims=False)
    return logits_from_hidden(params, last, cfg), ks[:, 0], vs[:, 0]


def prefill_batch_forward(params: dict, tokens: jax.Array, true_lengths: jax.Array, cfg: ModelConfig):
    """`prefill_forward` over B prompts padded to one bucket, in one pass: tokens [B, T],
    true_lengths [B]. Returns (logits [B, vocab], k, v [num_layers, B, T, KV, hd]). Rows never see
    each other (the attention is per row), so row b is the one `prefill_forward` gives alone."""
    x, ks, vs = _prefill_layers(params, tokens, cfg)
    last = jnp.take_along_axis(x, (true_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, d]
    return logits_from_hidden(params, last, cfg), ks, vs


def prefill_logits_all(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Logits [T, vocab] at every position of one padded prompt (prompt logprobs, echo): the
    same layers as `prefill_forward`, the LM head on every row instead of the last real one."""
    x, _, _ = _prefill_layers(params, tokens[None], cfg)
    return logits_from_hidden(params, x[0], cfg)


def _prefill_layers(params: dict, tokens: jax.Array, cfg: ModelConfig):
    """tokens [B, T] (B prompts padded to one length): hidden states [B, T, d] after the last
    layer, and the KV [num_layers, B, T, KV, hd]."""
    t = tokens.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)
    x = embed(params, tokens, cfg)  # [B, T, d]
    consts = layer_consts(cfg)
    stacked, shared = _layer_rope_tables(positions[None], consts, cfg)

    def layer(x, xs):
        lp, lc, tables = xs

        def attention(q, k, v, sinks):  # the prompts as chunks from position 0, no pool; their K/V returned
            b = q.shape[0]
            out, _, _ = ragged_attention(q.reshape(b * t, 1, *q.shape[2:]), k.reshape(b * t, *k.shape[2:]),
                                         v.reshape(b * t, *v.shape[2:]), None, None, None, None, None, None,
                                         sinks, cfg=cfg, window=lc.window, has_sinks=sinks is not None, chunk=t,
                                         chunks=b)
            return out.reshape(b, t, -1), (k, v)

        return decoder_layer(x, lp, lc, positions[None], cfg, attention, shared if tables is None else tables)

    x, (ks, vs) = jax.lax.scan(layer, x, (params["layers"], consts, stacked), unroll=_unroll(cfg))
    return x, ks, vs


def _layer_rope_tables(positions: jax.Array, consts: LayerConsts, cfg: ModelConfig):
    """Every layer's `rope_tables` of positions, for the layer scan: (tables stacked on
    [num_layers], None) where layers rotate differently (a local RoPE, Gemma 3's), else (None, the
    one table every layer uses).

    Why: computed inside the layer, XLA CPU fused cos and sin into every consumer of the rotated
    q and k (the KV written out, the transposes, each attention block's slice) and evaluated them
    again in each: a quarter of a 512-token prefill's time. Computed here, once per distinct
    rotation, they are read, not recomputed (the same values: the same ops on the same inputs)."""
    if not cfg.local_rope_theta:  # layer_consts gives every layer the global frequencies
        return None, rope_tables(positions, consts.inv_freq[0], consts.rope_scale[0])
    return jax.vmap(lambda inv, scale: rope_tables(positions, inv, scale))(consts.inv_freq, consts.rope_scale), None


# ---------------------------------------------------------------------------------------------
# the layer weights one layer apiece (the unrolled paged step on a CPU)


def split_layers(params: dict) -> dict:
    """`params` with the stacked layer weights ([L, ...] arrays) also held one layer apiece:
    "layers" becomes a tuple of per-layer dicts, each array its own buffer (a copy: the stacked
    arrays stay where other code holds them); every other entry is shared, not copied.

    What a step whose layers run unrolled reads fastest on a CPU (paged.decode_forward_paged):
    XLA CPU hands a dot only whole buffers, so layer i's slice of a stacked weight is copied
    before each of its dots, every step (seen in the compiled step: 28 weight copies, ~0.9 ms of
    a 2 ms step at 8 rows, built-in model)."""
    layers = params["layers"]
    if not isinstance(layers, dict):
        return params
    count = next(iter(layers.values())).shape[0]
    per = tuple({name: jnp.array(w[i], copy=True) for name, w in layers.items()} for i in range(count))
    return {**params, "layers": per}


def _layer_params(layers, i: int) -> dict:
    """Layer i's weights from stacked [L, ...] arrays (a dict) or per-layer dicts (a tuple)."""
    if isinstance(layers, dict):
        return {name: w[i] for name, w in layers.items()}
    return layers[i]
