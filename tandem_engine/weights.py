"""Where the params pytree comes from: a preset's random weights or a Hugging Face directory of a
served family.

Random presets use `ModelInfo.seed`, so every process (prefill pod, decode pod, test) that loads the
same preset holds the same weights. HF checkpoints load unchanged: tensors are only transposed from
HF's [out, in] to `x @ W`, stacked per layer (and per expert), and dequantized to the serving dtype
where they ship quantized (FP8 with block scales, as Qwen3's `*-FP8` checkpoints; MXFP4, as
gpt-oss). One checkpoint may be sharded over several files (`model.safetensors.index.json`).
checkpoint.py reads them by block; shards.py puts each device's slice straight onto it (no whole
weight on one device, no float32 copy). `save_hf_checkpoint` writes the Llama layout back so tests
can build real checkpoint directories.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from tandem_core.models import ModelInfo
from tandem_engine.arch import ModelConfig, config_from_info
from tandem_engine.checkpoint import ATTN, DENSE, QUANT_METHODS, Reader, dequant_mxfp4, leaf_sources
from tandem_engine.quantize import check_quantize
from tandem_engine.shards import LoadStats, Progress, place_checkpoint
from tandem_engine.sharding import Layout

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

def resolve_dtype(dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def layer_shapes(info: ModelInfo, cfg: ModelConfig | None = None) -> dict[str, tuple[int, ...]]:
    """Each per-layer weight's shape without the leading [num_layers] axis."""
    cfg = cfg or config_from_info(info)
    d, f, hd = info.hidden_size, info.intermediate_size, info.head_dim
    h, kv = info.num_heads * hd, info.num_kv_heads * hd
    out = {"attn_norm": (d,), "wq": (d, h), "wk": (d, kv), "wv": (d, kv), "wo": (h, d), "mlp_norm": (d,)}
    if cfg.qkv_bias:
        out.update(bq=(h,), bk=(kv,), bv=(kv,))
    if cfg.o_bias:
        out["bo"] = (d,)
    if cfg.qk_norm:
        out.update(q_norm=(hd,), k_norm=(hd,))
    if cfg.sandwich_norms:
        out.update(attn_post_norm=(d,), mlp_post_norm=(d,))
    if cfg.sinks:
        out["sinks"] = (info.num_heads,)
    if cfg.moe:
        e = cfg.num_experts
        out.update(router=(d, e), we_gate=(e, d, f), we_up=(e, d, f), we_down=(e, f, d))
        if cfg.router_bias:
            out["router_bias"] = (e,)
        if cfg.expert_bias:
            out.update(be_gate=(e, f), be_up=(e, f), be_down=(e, d))
    else:
        out.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
    return out


def init_params(info: ModelInfo, dtype: str = "float32") -> dict:
    """Random weights from `info.seed`: matrices ~ N(0, 1/fan_in) so activations and logits stay
    O(1) (clear argmax margins keep greedy comparisons stable), norms near 1, biases small. Any
    served architecture (`jax.eval_shape(lambda: init_params(info))` gives the shapes alone)."""
    dt = resolve_dtype(dtype)
    cfg = config_from_info(info)
    L = info.num_layers
    shapes = layer_shapes(info, cfg)
    keys = jax.random.split(jax.random.key(info.seed), len(shapes) + 3)
    layers = {}
    for key, (name, shape) in zip(keys, sorted(shapes.items())):
        if name.endswith("norm"):
            w = (0.0 if cfg.norm_offset else 1.0) + 0.1 * jax.random.normal(key, (L, *shape), jnp.float32)
        elif len(shape) == 1 or name.startswith("be_"):  # biases, sinks
            w = 0.1 * jax.random.normal(key, (L, *shape), jnp.float32)
        else:
            w = jax.random.normal(key, (L, *shape), jnp.float32) / np.sqrt(shape[-2])
        layers[name] = w.astype(dt)
    d, v = info.hidden_size, info.vocab_size
    params = {
        "embed": jax.random.normal(keys[-3], (v, d), jnp.float32).astype(dt),
        "layers": layers,
        "norm": ((0.0 if cfg.norm_offset else 1.0) + 0.1 * jax.random.normal(keys[-2], (d,), jnp.float32)).astype(dt),
    }
    if not info.tie_word_embeddings:
        params["lm_head"] = (jax.random.normal(keys[-1], (d, v), jnp.float32) / np.sqrt(d)).astype(dt)
    return params


# ---------------------------------------------------------------------------------------------
# reading a checkpoint (checkpoint.py reads it by block, shards.py places each device's slice)


def load_hf_params(info: ModelInfo, dtype: str = "float32", *, layout: Layout | None = None,
                   quantize: str | None = None, threads: int = 0, stage_bytes: int | None = None,
                   progress: Callable[[Progress], None] | None = None) -> dict:
    """Read a HF directory (`info.path`) of a served family into the params pytree, each weight
    straight into its shards under `layout` (the first device when None), in `dtype`
    (`quantize="int8"`: the layer matrices as int8 with their scales). See shards.py."""
    return load_hf_checkpoint(info, dtype, layout=layout, quantize=quantize, threads=threads,
                              stage_bytes=stage_bytes, progress=progress)[0]


def load_hf_checkpoint(info: ModelInfo, dtype: str = "float32", *, layout: Layout | None = None,
                       quantize: str | None = None, threads: int = 0, stage_bytes: int | None = None,
                       progress: Callable[[Progress], None] | None = None) -> tuple[dict, LoadStats]:
    """`load_hf_params`, and what the load did (bytes handed to each device, seconds)."""
    dt = resolve_dtype(dtype)
    cfg = config_from_info(info)
    hf = (info.extra or {}).get("hf_config") or {}
    reader = Reader(Path(info.path), hf)
    try:
        sources = leaf_sources(info, cfg, layer_shapes(info, cfg), reader)  # every shape checked first
        return place_checkpoint(sources, dt, layout=layout, quantize=check_quantize(quantize), threads=threads,
                                stage_bytes=stage_bytes, progress=progress)
    finally:
        reader.close()


def load_params(info: ModelInfo, dtype: str = "float32", *, layout: Layout | None = None,
                quantize: str | None = None, progress: Callable[[Progress], None] | None = None) -> dict:
    """Preset -> random weights (on the default device; the engine places them); HF directory ->
    its weights, already in their shards under `layout` (and quantized when asked)."""
    if info.path:
        return load_hf_params(info, dtype, layout=layout, quantize=quantize, progress=progress)
    return init_params(info, dtype)


# ---------------------------------------------------------------------------------------------
# writing (tests build real checkpoint directories)


def _hf_config(info: ModelInfo, dtype: str) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": info.vocab_size, "hidden_size": info.hidden_size,
        "intermediate_size": info.intermediate_size, "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads, "num_key_value_heads": info.num_kv_heads,
        "head_dim": info.head_dim, "max_position_embeddings": info.max_position_embeddings,
        "rope_theta": info.rope_theta, "rms_norm_eps": info.rms_norm_eps,
        "tie_word_embeddings": info.tie_word_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
        "rope_scaling": (info.extra or {}).get("rope_scaling"),
        "bos_token_id": info.bos_token_id,
        "eos_token_id": list(info.eos_token_ids) if len(info.eos_token_ids) != 1 else info.eos_token_ids[0],
    }
    return cfg


def save_hf_checkpoint(params: dict, info: ModelInfo, directory: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` in HF Llama layout (a Llama-family params
    pytree). Tied models (per `info.tie_word_embeddings`) get no lm_head tensor."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    host = jax.tree.map(np.asarray, params)
    dtype = "bfloat16" if host["embed"].dtype == jnp.bfloat16 else "float32"
    tensors = {"model.embed_tokens.weight": host["embed"], "model.norm.weight": host["norm"]}
    names = {**ATTN, "mlp_norm": ("post_attention_layernorm.weight", False),
             **{k: (v, True) for k, v in DENSE.items()}}
    for ours, (hf, transpose) in names.items():
        for i in range(info.num_layers):
            w = host["layers"][ours][i]
            tensors[f"model.layers.{i}.{hf}"] = w.T if transpose else w
    if not info.tie_word_embeddings:
        head = host["lm_head"] if "lm_head" in host else host["embed"].T
        tensors["lm_head.weight"] = head.T
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_hf_config(info, dtype), indent=2))
    return out


__all__ = ["DTYPES", "QUANT_METHODS", "dequant_mxfp4", "init_params", "layer_shapes", "load_hf_checkpoint",
           "load_hf_params", "load_params", "resolve_dtype", "save_hf_checkpoint"]
