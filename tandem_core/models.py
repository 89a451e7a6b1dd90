"""Which model a service serves: presets and Hugging Face directories of the served families,
without JAX.

The gateway needs the tokenizer, the context length and the EOS ids; the engine needs the
architecture. Both read them from here so they can never disagree.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem_core.errors import ModelNotFound
from tandem_core.families import MODEL_TYPES

BYTE_VOCAB = 256  # byte-level tokenizer: ids 0..255 are bytes
BYTE_BOS = 256
BYTE_EOS = 257


@dataclass(frozen=True)
class ModelInfo:
    """Architecture and serving facts of one model. What a family changes beyond these shapes
    (biases, norms, windows, experts, ...) is read by the engine from `extra["hf_config"]`, the
    checkpoint's config.json as written (tandem_engine/arch.py)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    path: str | None = None  # HF directory; None for a random-weight preset
    seed: int = 0  # weight seed for presets
    tokenizer: str = "byte"  # "byte" or "hf"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_params(self) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + d


def _preset(name: str, **kw) -> ModelInfo:
    base: dict[str, Any] = dict(
        name=name, vocab_size=BYTE_EOS + 1, bos_token_id=BYTE_BOS, eos_token_ids=(BYTE_EOS,),
        tokenizer="byte", rope_theta=10000.0, rms_norm_eps=1e-5, seed=0,
    )
    base.update(kw)
    return ModelInfo(**base)


# Random-weight presets (fixed seed). "tiny" is fast enough for tests on 2 cores;
# "small-100m" is the ~100M-parameter preset the engine benchmark uses.
PRESETS: dict[str, ModelInfo] = {
    "tiny": _preset(
        "tiny", hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
    ),
    "small-100m": _preset(
        "small-100m", vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
        num_heads=12, num_kv_heads=4, head_dim=64, max_position_embeddings=2048,
        tokenizer="byte",
    ),
}

# The built-in default ("builtin" or ""): a small Llama trained on the Python standard library by
# tools/train_builtin.py and shipped as a Hugging Face directory inside the package, so `make serve`
# prints text a person can recognise. It resolves through the ordinary HF-directory path.
BUILTIN_DIR = Path(__file__).resolve().parent / "assets" / "tandem-tiny-py"
# Its draft model for speculative decoding ("builtin-draft"): one layer, hidden 128, the built-in
# tokenizer, distilled from the built-in model (tools/train_builtin.py --teacher; its training.json).
BUILTIN_DRAFT_DIR = BUILTIN_DIR.with_name("tandem-tiny-py-draft")


def resolve_model(name_or_path: str) -> ModelInfo:
    """"builtin" (or "") -> the shipped trained checkpoint ("builtin-draft": its draft model); a preset name ("tiny", "small-100m")
    -> random weights; otherwise a Hugging Face Llama directory."""
    if name_or_path in ("builtin", ""):
        if not (BUILTIN_DIR / "config.json").is_file():
            raise ModelNotFound(
                f"the built-in checkpoint is missing from {BUILTIN_DIR}; reinstall the package, "
                f"run tools/train_builtin.py, or serve the random-weight preset 'tiny'"
            )
        name_or_path = str(BUILTIN_DIR)
    if name_or_path == "builtin-draft":
        if not (BUILTIN_DRAFT_DIR / "config.json").is_file():
            raise ModelNotFound(f"the built-in draft checkpoint is missing from {BUILTIN_DRAFT_DIR}; reinstall the "
                                f"package, or train it (tools/README.md)")
        name_or_path = str(BUILTIN_DRAFT_DIR)
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelNotFound(
            f"model {name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
            f"nor a directory with config.json: give a preset name or a Hugging Face model directory"
        )
    try:
        return _from_hf_config(path, json.loads(cfg_file.read_text()))
    except KeyError as e:  # a configuration error like the others: named, so a worker stops on it (exit 78)
        raise ModelNotFound(f"{cfg_file}: has no {e.args[0]!r}; is it the config.json of a Hugging Face causal LM?") from None
    except (TypeError, ValueError) as e:
        raise ModelNotFound(f"{cfg_file}: cannot be read as a model config ({e})") from None


def text_config(cfg: dict) -> dict:
    """The language model's part of a config.json: a multimodal checkpoint (Gemma 3's
    `Gemma3ForConditionalGeneration`) nests it under `text_config`."""
    inner = cfg.get("text_config")
    if isinstance(inner, dict) and "num_hidden_layers" in inner:
        merged = {**inner}
        for key in ("eos_token_id", "bos_token_id", "_name_or_path", "tie_word_embeddings"):
            if key not in merged and key in cfg:
                merged[key] = cfg[key]
        merged.setdefault("model_type", cfg.get("model_type"))
        if cfg.get("model_type") == "gemma3":
            merged["model_type"] = "gemma3"
        return merged
    return cfg


def _from_hf_config(path: Path, cfg: dict) -> ModelInfo:
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    model_type = cfg.get("model_type", "llama" if "Llama" in arch else None)
    if model_type not in MODEL_TYPES:  # the family table (tandem_core/families.py)
        raise ModelNotFound(
            f"{path}: model_type {model_type!r} ({arch}) is not a family this engine serves; "
            f"served: {', '.join(sorted(MODEL_TYPES))}"
        )
    raw = cfg
    cfg = text_config(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos_ids = _eos_ids(path, cfg)
    tok = "hf" if (path / "tokenizer.json").is_file() else "byte"
    # a mixture of experts: intermediate_size is each expert's (Qwen3-MoE names it apart)
    ffn = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    return ModelInfo(
        name=cfg.get("_name_or_path") or path.name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=_rope(cfg)[0],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        path=str(path.resolve()),
        tokenizer=tok,
        extra={"rope_scaling": _rope(cfg)[1], "hf_config": cfg, "family": MODEL_TYPES[str(model_type)]},
    )


def _eos_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json together, as vLLM merges them: chat
    models (Qwen2.5's <|im_end|>, Gemma's <end_of_turn>, gpt-oss's <|return|> and <|call|>) often
    name their end-of-turn tokens only in the latter."""
    ids: list[int] = []
    sources = [cfg.get("eos_token_id")]
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError) as e:
            raise ModelNotFound(f"{gen}: unreadable ({e})") from e
    for eos in sources:
        for i in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of the global-attention layers (`rope_for`)."""
    return rope_for(cfg, "full_attention")


def rope_for(cfg: dict, layer_type: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of one layer type ("full_attention", "sliding_attention") from a
    config.json. transformers >= 5 writes `rope_parameters`: flat ({"rope_theta": ..., "rope_type":
    ..., scaling keys}) or per layer type (Gemma 3: {"sliding_attention": {...}, "full_attention":
    {...}}); older versions top-level `rope_theta` / `rope_scaling` (and Gemma 3's
    `rope_local_base_freq` for its sliding layers). Missing all, Llama's default theta is 10000.
    rope_scaling is None for plain RoPE."""
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get(layer_type), dict):
        rope = rope[layer_type]
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        return float(cfg["rope_local_base_freq"]), None
    if "rope_theta" in cfg or not isinstance(rope, dict) or "rope_theta" not in rope:
        return float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")
    own = {k: v for k, v in rope.items() if k != "rope_theta"}
    scaling: dict | None = own
    if own.get("rope_type", own.get("type", "default")) == "default":
        scaling = cfg.get("rope_scaling")
    return float(rope["rope_theta"]), scaling
