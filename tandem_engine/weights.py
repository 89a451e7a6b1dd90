"""Where the params pytree comes from: a preset's random weights or a Hugging Face directory of a
served family.

Random presets use `ModelInfo.seed`, so every process (prefill pod, decode pod, test) that loads the
same preset holds the same weights. HF checkpoints load unchanged: tensors are only transposed from
HF's [out, in] to `x @ W`, stacked per layer (and per expert), and dequantized to the serving dtype
where they ship quantized (FP8 with block scales, as Qwen3's `*-FP8` checkpoints; MXFP4, as
gpt-oss). One checkpoint may be sharded over several files (`model.safetensors.index.json`).
`save_hf_checkpoint` writes the Llama layout back so tests can build real checkpoint directories.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tandem_core.errors import ModelNotFound
from tandem_core.models import ModelInfo
from tandem_engine.arch import ModelConfig, config_from_info

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
QUANT_METHODS = ("fp8", "mxfp4")  # dequantized at load; anything else is refused at start

# our per-layer name -> (HF name under model.layers.{i}., transpose?) for the attention and norms
_ATTN = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
}
_QKV_BIAS = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
_DENSE = {"w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}
# experts stored one module per expert: (router, gate, up, down) under the layer
_PER_EXPERT = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                  "mlp.experts.{j}.down_proj.weight"),
}
# safetensors dtype names -> numpy (ml_dtypes for the ones numpy lacks)
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
FP4_VALUES = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        np.float32)


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
# reading a checkpoint


class _Tensors:
    """The tensors of a checkpoint directory, read lazily from its safetensors files (every dtype
    safetensors writes, FP8 included, as numpy arrays over a memory map)."""

    def __init__(self, path: Path):
        self.path = path
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelNotFound(f"{path}: no *.safetensors files")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            wanted = set(json.loads(index.read_text()).get("weight_map", {}).values())
            missing = sorted(w for w in wanted if not (path / w).is_file())
            if missing:
                raise ModelNotFound(f"{path}: shards named by model.safetensors.index.json are missing: {missing[:5]}")
        self.where: dict[str, tuple[Path, dict, int]] = {}
        for file in files:
            with open(file, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            for name, meta in header.items():
                self.where[name] = (file, meta, 8 + n)
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise ModelNotFound(f"{self.path}: tensor {name!r} is missing")
        file, meta, base = self.where[name]
        if meta["dtype"] not in _ST_DTYPES:
            raise ModelNotFound(f"{self.path}: tensor {name!r} has dtype {meta['dtype']}, which this loader does not read")
        start, end = meta["data_offsets"]
        dt = np.dtype(_ST_DTYPES[meta["dtype"]])
        self.used.add(name)
        arr = np.memmap(file, dtype=np.uint8, mode="r", offset=base + start, shape=(end - start,))
        return arr.view(dt).reshape(meta["shape"])

    def left(self) -> list[str]:
        return [n for n in self.where if n not in self.used and not n.endswith("rotary_emb.inv_freq")]


def _dequant_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """FP8 [out, in] with one float scale per (block[0] x block[1]) tile (DeepSeek/Qwen3 `*-FP8`)."""
    out_dim, in_dim = w.shape
    scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0), block[1], axis=1)
    return w.astype(np.float32) * scale[:out_dim, :in_dim]


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (gpt-oss): blocks uint8 [..., R, G, 16] (two e2m1 values a byte, low nibble first),
    scales uint8 [..., R, G] (e8m0: 2 ** (s - 127) for each group of 32) -> float32 [..., G * 32, R]
    (transposed as transformers' `convert_moe_packed_tensors` returns it)."""
    blocks = np.asarray(blocks, np.uint8)
    vals = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    vals[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    vals[..., 1::2] = FP4_VALUES[blocks >> 4]
    vals *= np.exp2(np.asarray(scales, np.float32) - 127.0)[..., None]
    out = vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2)  # [..., R, G*32]
    return np.swapaxes(out, -1, -2)


class _Reader:
    """Reads HF tensors as float32 numpy, dequantizing what the checkpoint's quantization_config
    says is quantized."""

    def __init__(self, path: Path, hf: dict):
        self.t = _Tensors(path)
        self.path = path
        q = hf.get("quantization_config") or {}
        self.method = q.get("quant_method")
        if self.method and self.method not in QUANT_METHODS:
            raise ModelNotFound(
                f"{path}: quantization {self.method!r} is not supported; served: bf16/f32 weights, "
                f"{', '.join(QUANT_METHODS)} (dequantized at load)")
        self.block = tuple(q.get("weight_block_size") or (128, 128))

    def has(self, name: str) -> bool:
        return name in self.t or f"{name}_blocks" in self.t

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.t and f"{name}_blocks" in self.t:  # MXFP4 experts
            arr = dequant_mxfp4(self.t.get(f"{name}_blocks"), self.t.get(f"{name}_scales"))
        else:
            arr = self.t.get(name)
            scale = name[: -len("weight")] + "weight_scale_inv" if name.endswith("weight") else None
            if scale and scale in self.t:
                arr = _dequant_fp8(arr, self.t.get(scale), self.block)
        if tuple(arr.shape) != tuple(shape):
            raise ModelNotFound(f"{self.path}: tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        return np.asarray(arr, np.float32)


def _layer_sources(cfg: ModelConfig, family: str) -> dict[str, tuple[str, bool]]:
    """Our per-layer dense names -> (HF name under model.layers.{i}., transpose?)."""
    out = dict(_ATTN)
    out.update({k: (v, False) for k, v in _QKV_BIAS.items() if cfg.qkv_bias})
    if cfg.o_bias:
        out["bo"] = ("self_attn.o_proj.bias", False)
    if cfg.qk_norm:
        out.update(q_norm=("self_attn.q_norm.weight", False), k_norm=("self_attn.k_norm.weight", False))
    if cfg.sinks:
        out["sinks"] = ("self_attn.sinks", False)
    if cfg.sandwich_norms:  # Gemma: post_attention_layernorm is the attention output's norm
        out.update(attn_post_norm=("post_attention_layernorm.weight", False),
                   mlp_norm=("pre_feedforward_layernorm.weight", False),
                   mlp_post_norm=("post_feedforward_layernorm.weight", False))
    else:
        out["mlp_norm"] = ("post_attention_layernorm.weight", False)
    if not cfg.moe:
        out.update({k: (v, True) for k, v in _DENSE.items()})
    return out


def _read_experts(r: _Reader, prefix: str, cfg: ModelConfig, family: str, shapes: dict) -> dict[str, np.ndarray]:
    """One layer's router and experts, as [E, d, f] / [E, f, d] stacks."""
    e, (_, d, f) = cfg.num_experts, shapes["we_gate"]
    if family == "gpt_oss":  # experts fused in one tensor, gate and up interleaved on the last axis
        gate_up = r.read(f"{prefix}mlp.experts.gate_up_proj", (e, d, 2 * f))
        out = {"router": r.read(f"{prefix}mlp.router.weight", (e, d)).T,
               "router_bias": r.read(f"{prefix}mlp.router.bias", (e,)),
               "we_gate": gate_up[..., 0::2], "we_up": gate_up[..., 1::2],
               "we_down": r.read(f"{prefix}mlp.experts.down_proj", (e, f, d))}
        bias = r.read(f"{prefix}mlp.experts.gate_up_proj_bias", (e, 2 * f))
        out.update(be_gate=bias[:, 0::2], be_up=bias[:, 1::2],
                   be_down=r.read(f"{prefix}mlp.experts.down_proj_bias", (e, d)))
        return out
    router, gate, up, down = _PER_EXPERT[family]
    return {
        "router": r.read(prefix + router, (e, d)).T,
        "we_gate": np.stack([r.read(prefix + gate.format(j=j), (f, d)).T for j in range(e)]),
        "we_up": np.stack([r.read(prefix + up.format(j=j), (f, d)).T for j in range(e)]),
        "we_down": np.stack([r.read(prefix + down.format(j=j), (d, f)).T for j in range(e)]),
    }


def _model_prefix(r: _Reader) -> str:
    """Where the decoder's tensors live: `model.` (a causal LM) or under a multimodal wrapper
    (Gemma 3: `language_model.model.` or, as transformers 5 writes it, `model.language_model.`)."""
    for prefix in ("model.", "model.language_model.", "language_model.model."):
        if f"{prefix}embed_tokens.weight" in r.t:
            return prefix
    raise ModelNotFound(f"{r.path}: no embed_tokens.weight under model., model.language_model. or language_model.model.")


def load_hf_params(info: ModelInfo, dtype: str = "float32") -> dict:
    """Read a HF directory (`info.path`) of a served family into the params pytree."""
    dt = resolve_dtype(dtype)
    path = Path(info.path)
    cfg = config_from_info(info)
    hf = (info.extra or {}).get("hf_config") or {}
    family = (info.extra or {}).get("family", "llama")
    r = _Reader(path, hf)
    root = _model_prefix(r)
    L, shapes = info.num_layers, layer_shapes(info, cfg)
    sources = _layer_sources(cfg, family)
    stacks: dict[str, list[np.ndarray]] = {name: [] for name in shapes}
    for i in range(L):
        prefix = f"{root}layers.{i}."
        for ours, (name, transpose) in sources.items():
            want = shapes[ours][::-1] if transpose else shapes[ours]
            t = r.read(prefix + name, want)
            stacks[ours].append(t.T if transpose else t)
        if cfg.moe:
            for ours, t in _read_experts(r, prefix, cfg, family, shapes).items():
                stacks[ours].append(t)
    layers = {name: jnp.asarray(np.stack(ts), dtype=dt) for name, ts in stacks.items()}
    d, v = info.hidden_size, info.vocab_size
    params = {
        "embed": jnp.asarray(r.read(f"{root}embed_tokens.weight", (v, d)), dtype=dt),
        "layers": layers,
        "norm": jnp.asarray(r.read(f"{root}norm.weight", (d,)), dtype=dt),
    }
    if not info.tie_word_embeddings:
        if not r.has("lm_head.weight"):
            raise ModelNotFound(f"{path}: lm_head.weight is missing and embeddings are not tied")
        params["lm_head"] = jnp.asarray(r.read("lm_head.weight", (v, d)).T, dtype=dt)
    elif r.has("lm_head.weight"):
        r.t.used.add("lm_head.weight")  # a tied copy some checkpoints carry anyway
    left = [n for n in r.t.left() if not n.endswith(("weight_scale_inv", "_scales"))
            and not n.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                  "model.multi_modal_projector."))]
    if left:
        raise ModelNotFound(f"{path}: tensors this {family} model does not use (another architecture?): {left[:5]}")
    return params


def load_params(info: ModelInfo, dtype: str = "float32") -> dict:
    """Preset -> random weights; HF directory -> its weights."""
    return load_hf_params(info, dtype) if info.path else init_params(info, dtype)


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
    names = {**_ATTN, "mlp_norm": ("post_attention_layernorm.weight", False),
             **{k: (v, True) for k, v in _DENSE.items()}}
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


__all__ = ["DTYPES", "QUANT_METHODS", "dequant_mxfp4", "init_params", "layer_shapes", "load_hf_params",
           "load_params", "resolve_dtype", "save_hf_checkpoint"]
