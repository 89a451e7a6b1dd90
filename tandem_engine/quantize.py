"""Weight-only int8: the layer matrices held as int8 with one float32 scale per output channel.

Why: a decode step reads every weight once per step for a handful of tokens, so it is bound by
memory bandwidth, not arithmetic; int8 halves the weight bytes a bfloat16 step reads (a quarter of
float32's). Activations, the KV cache, norms, biases and logits stay in the serving dtype.

What is quantized (`QUANTIZED`): the attention projections wq, wk, wv, wo; the dense MLP's w_gate,
w_up, w_down; a mixture of experts' we_gate, we_up, we_down. Each [..., in, out] matrix (stored
as `x @ W`, model.py) becomes int8 [..., in, out] plus `<name>_scale` float32 [..., out]: symmetric,
scale = max |W[..., :, j]| / 127 over the input axis, q = round(W / scale) in [-127, 127], so
|q * scale - W| <= scale / 2 element by element.

What is not, and why: the embedding (a lookup reads only the rows of the step's tokens, not the
table), the LM head (the last matmul decides the argmax; left in the serving dtype so that its
error is not added to the layers' — bench/quantize_quality.py reports the bytes this leaves), the
MoE router (a tiny [d, E] matrix whose error would flip discrete expert choices), norms and biases.

The matmul dequantizes inside the jitted step: (x @ q.astype(dtype)) * scale, so what XLA reads
from memory is the int8 array (the convert fuses into the matmul; checked in a TPU compile,
tests/unit/test_quantize.py); the scale multiplies the output columns in float32 (per output
channel, it commutes with the sum over the input axis). The matmul's own output dtype is x's, as
the unquantized path's: XLA CPU has no bfloat16 x bfloat16 -> float32 batched dot (the experts'
einsums), and rounding before or after a scale costs the same relative precision.
No I/O, no settings here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

QUANTIZE_MODES = ("int8",)
QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "we_gate", "we_up", "we_down")
SCALE = "_scale"  # a quantized weight `name`'s scales live beside it as f"{name}_scale"


def check_quantize(mode: str | None) -> str | None:
    """`mode` normalised ("" -> None), or ValueError naming the modes served."""
    if not mode:
        return None
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize={mode!r} is not supported; use one of {list(QUANTIZE_MODES)} "
                         f"or leave it empty for weights in the serving dtype")
    return mode


def quantize_int8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., in, out] -> (int8 [..., in, out], float32 scales [..., out]): symmetric, per output
    channel (one scale per column over the input axis -2). An all-zero column gets scale 1
    (its int8 values are 0, so it dequantizes to 0 exactly)."""
    w32 = jnp.asarray(w).astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w32 / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The weights int8 `q` with `scale` stand for, as `dtype` [..., in, out]."""
    return (q.astype(jnp.float32) * scale[..., None, :]).astype(dtype)


def is_quantized(params: dict) -> bool:
    layers = params["layers"]
    first = layers if isinstance(layers, dict) else layers[0]
    return any(name + SCALE in first for name in QUANTIZED)


def quantize_params(params: dict, mode: str | None) -> dict:
    """`params` with the `QUANTIZED` layer matrices in int8 and their scales beside them (every
    other entry shared, not copied). Idempotent: params already quantized come back as they are.
    `mode` None/"" returns `params` unchanged."""
    if check_quantize(mode) is None or is_quantized(params):
        return params
    layers = dict(params["layers"])
    for name in QUANTIZED:
        if name in layers:
            layers[name], layers[name + SCALE] = quantize_int8(layers[name])
    return {**params, "layers": layers}


def weight_bytes(params) -> int:
    """Bytes of every array in a params pytree (int8 weights and their scales counted as held)."""
    return sum(int(w.size) * w.dtype.itemsize for w in jax.tree.leaves(params))


# ---------------------------------------------------------------------------------------------
# the matmul sites model.py calls (weights in the serving dtype, or int8 with their scales)


def linear(x: jax.Array, lp: dict, name: str) -> jax.Array:
    """x [..., in] @ lp[name] [in, out] -> [..., out] in x's dtype."""
    w, scale = lp[name], lp.get(name + SCALE)
    if scale is None:
        return x @ w
    return (jnp.matmul(x, w.astype(x.dtype)) * scale).astype(x.dtype)


def expert_in(x: jax.Array, lp: dict, name: str) -> jax.Array:
    """Every expert on every token: x [n, d] x lp[name] [E, d, f] -> [n, E, f] in x's dtype."""
    w, scale = lp[name], lp.get(name + SCALE)
    if scale is None:
        return jnp.einsum("nd,edf->nef", x, w)
    return (jnp.einsum("nd,edf->nef", x, w.astype(x.dtype)) * scale).astype(x.dtype)


def expert_out(h: jax.Array, lp: dict, name: str) -> jax.Array:
    """The experts' outputs summed: h [n, E, f] x lp[name] [E, f, d] -> [n, d] in h's dtype. With
    int8 the scale is per (expert, output), so it is applied before the sum over experts."""
    w, scale = lp[name], lp.get(name + SCALE)
    if scale is None:
        return jnp.einsum("nef,efd->nd", h, w)
    y = jnp.einsum("nef,efd->ned", h, w.astype(h.dtype)) * scale  # float32: the scales' dtype
    return jnp.sum(y, axis=1).astype(h.dtype)


def ragged(rows: jax.Array, lp: dict, name: str, sizes: jax.Array, chosen: jax.Array) -> jax.Array:
    """Grouped matmul `jax.lax.ragged_dot(rows, lp[name], sizes)`: rows [m, in] sorted by expert,
    lp[name] [E, in, out]; `chosen` [m] is each row's expert (whose scales it takes)."""
    w, scale = lp[name], lp.get(name + SCALE)
    if scale is None:
        return jax.lax.ragged_dot(rows, w, sizes)
    return (jax.lax.ragged_dot(rows, w.astype(rows.dtype), sizes) * scale[chosen]).astype(rows.dtype)


__all__ = ["QUANTIZED", "QUANTIZE_MODES", "check_quantize", "dequantize", "expert_in", "expert_out",
           "is_quantized", "linear", "quantize_int8", "quantize_params", "ragged", "weight_bytes"]
