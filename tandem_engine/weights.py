"""Where the params pytree comes from: a preset's random weights or a Hugging Face Llama directory.

Random presets use `ModelInfo.seed`, so every process (prefill pod, decode pod, test) that loads the
same preset holds the same weights. HF checkpoints load unchanged: tensors are only transposed from
HF's [out, in] to `x @ W` and stacked per layer. `save_hf_checkpoint` writes the same layout back so
tests can build real checkpoint directories.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file
from safetensors import safe_open

from tandem_core.errors import ModelNotFound
from tandem_core.models import ModelInfo

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# our per-layer name -> (HF name under model.layers.{i}., transpose?)
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def resolve_dtype(dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _layer_shapes(info: ModelInfo) -> dict[str, tuple[int, ...]]:
    d, f, hd = info.hidden_size, info.intermediate_size, info.head_dim
    return {
        "attn_norm": (d,), "wq": (d, info.num_heads * hd), "wk": (d, info.num_kv_heads * hd),
        "wv": (d, info.num_kv_heads * hd), "wo": (info.num_heads * hd, d), "mlp_norm": (d,),
        "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }


def init_params(info: ModelInfo, dtype: str = "float32") -> dict:
    """Random weights from `info.seed`: matrices ~ N(0, 1/fan_in) so activations and logits stay
    O(1) (clear argmax margins keep greedy comparisons stable), norms near 1."""
    dt = resolve_dtype(dtype)
    L = info.num_layers
    shapes = _layer_shapes(info)
    keys = jax.random.split(jax.random.key(info.seed), len(shapes) + 3)
    layers = {}
    for key, (name, shape) in zip(keys, sorted(shapes.items())):
        if len(shape) == 1:  # norm weight
            w = 1.0 + 0.1 * jax.random.normal(key, (L, *shape), jnp.float32)
        else:
            w = jax.random.normal(key, (L, *shape), jnp.float32) / np.sqrt(shape[0])
        layers[name] = w.astype(dt)
    d, v = info.hidden_size, info.vocab_size
    params = {
        "embed": jax.random.normal(keys[-3], (v, d), jnp.float32).astype(dt),
        "layers": layers,
        "norm": (1.0 + 0.1 * jax.random.normal(keys[-2], (d,), jnp.float32)).astype(dt),
    }
    if not info.tie_word_embeddings:
        params["lm_head"] = (jax.random.normal(keys[-1], (d, v), jnp.float32) / np.sqrt(d)).astype(dt)
    return params


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{path}: no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _take(tensors: dict, name: str, shape: tuple[int, ...], path: Path) -> np.ndarray:
    if name not in tensors:
        raise ModelNotFound(f"{path}: tensor {name!r} is missing")
    t = tensors.pop(name)
    if tuple(t.shape) != shape:
        raise ModelNotFound(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def load_hf_params(info: ModelInfo, dtype: str = "float32") -> dict:
    """Read a HF Llama directory (`info.path`) into the params pytree."""
    dt = resolve_dtype(dtype)
    path = Path(info.path)
    tensors = _read_tensors(path)
    L, shapes = info.num_layers, _layer_shapes(info)
    layers = {}
    for ours, (hf, transpose) in _LAYER_NAMES.items():
        want = shapes[ours][::-1] if transpose else shapes[ours]
        stack = [_take(tensors, f"model.layers.{i}.{hf}", want, path) for i in range(L)]
        arr = np.stack([t.T if transpose else t for t in stack])
        layers[ours] = jnp.asarray(arr, dtype=dt)
    d, v = info.hidden_size, info.vocab_size
    params = {
        "embed": jnp.asarray(_take(tensors, "model.embed_tokens.weight", (v, d), path), dtype=dt),
        "layers": layers,
        "norm": jnp.asarray(_take(tensors, "model.norm.weight", (d,), path), dtype=dt),
    }
    head = tensors.pop("lm_head.weight", None)
    if not info.tie_word_embeddings:
        if head is None:
            raise ModelNotFound(f"{path}: lm_head.weight is missing and embeddings are not tied")
        params["lm_head"] = jnp.asarray(np.asarray(head).T, dtype=dt)
    left = [n for n in tensors if not n.endswith("rotary_emb.inv_freq")]
    if left:
        raise ModelNotFound(f"{path}: unsupported tensors (biases or another architecture?): {left[:5]}")
    return params


def load_params(info: ModelInfo, dtype: str = "float32") -> dict:
    """Preset -> random weights; HF directory -> its weights."""
    return load_hf_params(info, dtype) if info.path else init_params(info, dtype)


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
    """Write `config.json` and `model.safetensors` in HF Llama layout. Tied models (per
    `info.tie_word_embeddings`) get no lm_head tensor."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    host = jax.tree.map(np.asarray, params)
    dtype = "bfloat16" if host["embed"].dtype == jnp.bfloat16 else "float32"
    tensors = {"model.embed_tokens.weight": host["embed"], "model.norm.weight": host["norm"]}
    for ours, (hf, transpose) in _LAYER_NAMES.items():
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
