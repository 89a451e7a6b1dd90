"""The model families Tandem serves: one table, pure data (no JAX), read by every part that
depends on the family.

- tandem_core/models.py: which config.json `model_type`s are served and as which family;
- tandem_engine/arch.py: what a family's modelling code does that its config.json does not say
  (`traits`, fields of `ModelConfig`);
- tandem_engine/checkpoint.py: where the family's experts live in the checkpoint (`experts`); the
  dense layers use the Llama names, which every family shares (Gemma's sandwich norms follow from
  the `sandwich_norms` trait);
- gateway/chatformat.py: the tool-call and reasoning parsers the family writes in when its chat
  template says nothing.

| family    | what it changes                                                                     |
|-----------|-------------------------------------------------------------------------------------|
| llama     | the baseline: RMSNorm, RoPE (default, linear, llama3), GQA, SwiGLU                   |
| mistral   | a sliding window on every layer (`sliding_window`)                                   |
| qwen2     | q/k/v biases; windows on the layers `layer_types` names                              |
| qwen3     | per-head q/k RMSNorm                                                                 |
| gemma2    | (1 + w) RMSNorm in float32, embeddings scaled by sqrt(d), GELU-tanh, norms after     |
|           | attention and MLP, attention and final logit soft-capping, query_pre_attn_scalar,     |
|           | alternating windows                                                                  |
| gemma3    | gemma2's, q/k norms, no soft-capping, 5 local : 1 global with a RoPE per layer type  |
| mixtral   | experts: softmax over all, top-k, renormalised                                       |
| qwen3_moe | q/k norms; experts with `norm_topk_prob`                                             |
| gpt_oss   | q/k/v/o biases, attention sinks, YaRN RoPE, alternating windows; experts: top-k of   |
|           | biased router logits then softmax, biased experts, clamped SwiGLU (alpha, limit)     |

tests/families.py builds one checkpoint of each row with transformers' own classes;
tests/unit/test_engine_families.py checks every row is served token-exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping


@dataclass(frozen=True)
class Experts:
    """Where a mixture of experts' tensors live under `model.layers.{i}.`.

    Not fused: one module per expert, `{j}` in the names is the expert's index (Mixtral, Qwen3-MoE).
    Fused: one tensor for all experts, gate and up in one (`gate` is `up`) interleaved on its last axis
    (gpt-oss), with biases beside each tensor (`<name>_bias`) and the router's (`<router>.bias`)."""

    router: str
    gate: str
    up: str
    down: str
    fused: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values served as this family
    # ModelConfig fields the family's modelling code sets (embed_scale "sqrt_d": sqrt(hidden_size))
    traits: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    experts: Experts | None = None
    # the chat format when the template says nothing: (tool-call parser, reasoning parser or None)
    tool_parser: str = "hermes"
    reasoning_parser: str | None = None


def _family(name: str, model_types: tuple[str, ...] = (), **kw: Any) -> Family:
    traits = MappingProxyType(dict(kw.pop("traits", {})))
    return Family(name, model_types or (name,), traits, **kw)


_GEMMA = dict(norm_offset=1.0, norm_f32_weight=True, sandwich_norms=True, embed_scale="sqrt_d")

FAMILIES: Mapping[str, Family] = MappingProxyType({f.name: f for f in (
    _family("llama"),
    _family("mistral", tool_parser="mistral"),
    _family("qwen2", traits=dict(qkv_bias=True)),
    _family("qwen3", traits=dict(qk_norm=True), reasoning_parser="qwen3"),
    _family("gemma2", traits=_GEMMA),
    _family("gemma3", ("gemma3_text", "gemma3"), traits=dict(qk_norm=True, **_GEMMA)),
    _family("mixtral", traits=dict(router="softmax_topk", norm_topk_prob=True), tool_parser="mistral",
            experts=Experts("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                            "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight")),
    _family("qwen3_moe", traits=dict(qk_norm=True, router="softmax_topk"), reasoning_parser="qwen3",
            experts=Experts("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                            "mlp.experts.{j}.down_proj.weight")),
    _family("gpt_oss", traits=dict(sinks=True, norm_f32_weight=True, router="topk_softmax", router_bias=True,
                                   expert_bias=True, expert_act="swiglu_clamped"),
            tool_parser="openai", reasoning_parser="openai_gptoss",
            experts=Experts("mlp.router.weight", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj",
                            "mlp.experts.down_proj", fused=True)),
)})

# config.json model_type -> the family it is served as
MODEL_TYPES: Mapping[str, str] = MappingProxyType({t: f.name for f in FAMILIES.values() for t in f.model_types})


def family_of(model_type: str) -> Family | None:
    """The family a config.json `model_type` is served as, or None."""
    name = MODEL_TYPES.get(model_type)
    return FAMILIES[name] if name else None


__all__ = ["FAMILIES", "MODEL_TYPES", "Experts", "Family", "family_of"]
