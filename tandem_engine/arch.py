"""One description of an architecture, read from a checkpoint's config.json.

What the families the engine serves change is data, not a model per family: `ModelConfig` holds it
(hashable: a static jit argument, so engines with the same architecture share compiled code), the
model functions (model.py) read it and never ask which family they run. A family is a row of
the family table (tandem_core/families.py: its `traits`, what its config.json does not say but its
modelling code does) plus what the generic reader `config_from_info` takes from config.json itself.
"""
from __future__ import annotations

from typing import NamedTuple

from tandem_core.errors import ModelNotFound
from tandem_core.families import FAMILIES
from tandem_core.models import ModelInfo, rope_for


class ModelConfig(NamedTuple):
    """The architecture only. Defaults are Llama's; every other family sets what it changes."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    rope_scaling: tuple = ()  # sorted (key, value) items of HF's rope_scaling, () when none
    # attention
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE
    query_scale: float = 0.0  # scores multiplier; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap); 0: none
    sinks: bool = False  # a learned per-head logit in the softmax (gpt-oss)
    windows: tuple = ()  # per layer: 0 global, w > 0 attends to the last w positions; (): all global
    local_rope_theta: float = 0.0  # RoPE of the windowed layers (plain); 0: the global RoPE
    local_rope_scaling: tuple = ()
    # norms and the residual stream
    norm_offset: float = 0.0  # RMSNorm weight is (offset + w) (Gemma: 1)
    norm_f32_weight: bool = False  # the weight multiplies in float32 before the cast (Gemma, gpt-oss)
    sandwich_norms: bool = False  # extra norms on the attention and MLP outputs (Gemma 2/3)
    embed_scale: float = 1.0  # embeddings times this, in the weight dtype (Gemma: sqrt(d))
    final_softcap: float = 0.0
    act: str = "silu"  # the MLP's gate activation: silu, gelu_tanh, gelu
    # mixture of experts (num_experts == 0: a dense MLP)
    num_experts: int = 0
    experts_per_tok: int = 0
    router: str = "softmax_topk"  # softmax over all then top-k | topk_softmax: top-k logits then softmax
    norm_topk_prob: bool = True  # renormalise the top-k weights (softmax_topk only)
    router_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "swiglu"  # swiglu | swiglu_clamped (gpt-oss: alpha, limit, (up + 1))
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # how the experts run (not the architecture: the engine picks it for the platform it runs on)
    moe_impl: str = "ragged"  # ragged: grouped matmuls (ragged_dot) | dense: every expert, weighted
    # the paged step holds the Pallas kernel's branch (taken where compiled for a TPU); the engine
    # sets it for its platform: off for a CPU, where tracing the kernel's branch, never compiled
    # there, cost ~0.5 s a layer call at each start (a restarted tiny-model decode pod: 8.3 s of
    # warm-up against 2.9, every compile a cache hit)
    paged_kernel: bool = True
    # trace the layer loop unrolled: aot.py's cost-accounting compiles of a 1- and 2-layer model (the
    # compiler counts a scanned body once, whatever its trip count); serving keeps the scan
    unroll_layers: bool = False

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def window(self, layer: int) -> int:
        return int(self.windows[layer]) if self.windows else 0


_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
         "gelu_tanh": "gelu_tanh", "gelu": "gelu"}


def _items(scaling: dict | None) -> tuple:
    scaling = scaling or {}
    return tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (list, dict))))


def _windows(hf: dict, num_layers: int) -> tuple:
    """Per-layer windows: `layer_types` where the config has them (Gemma 2/3, gpt-oss, Qwen2 as
    transformers 5 writes it), else Mistral's one `sliding_window` for every layer."""
    window = hf.get("sliding_window")
    if not window or hf.get("use_sliding_window") is False:
        return ()
    types = hf.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ModelNotFound(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ModelNotFound(f"layer types {sorted(unknown)} are not supported (sliding_attention, full_attention)")
        out = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    else:
        out = (int(window),) * num_layers
    return out if any(out) else ()


def _moe(hf: dict, family: str, num_layers: int) -> dict:
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if not experts:
        return {}
    dense_layers = list(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step") or 1)
    if dense_layers or step != 1:
        raise ModelNotFound(
            f"a mixture of experts with dense layers between (mlp_only_layers={dense_layers}, "
            f"decoder_sparse_step={step}) is not supported: every layer must be a mixture of experts"
        )
    if hf.get("shared_expert_intermediate_size"):
        raise ModelNotFound("shared experts (shared_expert_intermediate_size) are not supported")
    out = dict(num_experts=experts, experts_per_tok=int(hf["num_experts_per_tok"]))
    if "norm_topk_prob" in hf and family != "mixtral":
        out["norm_topk_prob"] = bool(hf["norm_topk_prob"])
    if "swiglu_limit" in hf:
        out["swiglu_limit"] = float(hf["swiglu_limit"])
    if "swiglu_alpha" in hf:
        out["swiglu_alpha"] = float(hf["swiglu_alpha"])
    return out


def config_from_info(info: ModelInfo) -> ModelConfig:
    """The architecture of `info`: a preset (Llama) or a checkpoint whose config.json
    (`info.extra["hf_config"]`) names a served family."""
    extra = info.extra or {}
    base = dict(
        vocab_size=info.vocab_size, hidden_size=info.hidden_size, num_layers=info.num_layers,
        num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
        rope_theta=float(info.rope_theta), rms_norm_eps=float(info.rms_norm_eps),
        rope_scaling=_items(extra.get("rope_scaling")),
    )
    hf = extra.get("hf_config")
    if not hf:
        return ModelConfig(**base)
    family = extra.get("family", "llama")
    traits = dict(FAMILIES[family].traits)
    if traits.get("embed_scale") == "sqrt_d":
        traits["embed_scale"] = float(info.hidden_size) ** 0.5
    act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act_name not in _ACTS:
        raise ModelNotFound(f"activation {act_name!r} is not supported ({', '.join(sorted(_ACTS))})")
    if hf.get("attention_bias"):  # Llama and gpt-oss: all four projections
        traits.update(qkv_bias=True, o_bias=True)
    if hf.get("mlp_bias"):
        raise ModelNotFound("MLP biases (mlp_bias) are not supported")
    windows = _windows(hf, info.num_layers)
    local_theta, local_scaling = rope_for(hf, "sliding_attention")
    local = {}
    if windows and (local_theta, _items(local_scaling)) != (base["rope_theta"], base["rope_scaling"]):
        local = dict(local_rope_theta=local_theta, local_rope_scaling=_items(local_scaling))
    scalar = hf.get("query_pre_attn_scalar")
    return ModelConfig(
        **base, **traits, **local, **_moe(hf, family, info.num_layers),
        windows=windows,
        act=_ACTS[act_name],
        query_scale=float(scalar) ** -0.5 if scalar else 0.0,
        attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
    )
