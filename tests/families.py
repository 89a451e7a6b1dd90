"""Tiny checkpoints of every served family, written by transformers' own classes.

Random weights (seeded, std 1/sqrt(fan_in) so attention is far from uniform), small shapes, and
sliding windows shorter than the tests' prompt plus output, saved with `save_pretrained` as a real
Hugging Face directory. Nothing is downloaded. Used by the engine parity tests, the end-to-end
family tests and bench/engine.py.
"""
from __future__ import annotations

from pathlib import Path

VOCAB = 320  # >= 258: the byte tokenizer (no tokenizer.json) fits
WINDOW = 8  # sliding window of the windowed layers: shorter than the tests' prompts

# 8 query and 4 KV heads so that tp 1, 2 and 4 all divide them; experts (4 or 8) too
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, head_dim=16, max_position_embeddings=512, bos_token_id=256,
               eos_token_id=257, pad_token_id=0)


def _configs(transformers) -> dict:
    t = transformers
    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, dict(intermediate_size=128)),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, dict(
            intermediate_size=128, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
            tie_word_embeddings=True)),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, dict(intermediate_size=128, tie_word_embeddings=True)),
        "mistral": (t.MistralConfig, t.MistralForCausalLM, dict(intermediate_size=128, sliding_window=WINDOW)),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM, dict(
            intermediate_size=128, sliding_window=WINDOW, query_pre_attn_scalar=24,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
        "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM, dict(
            intermediate_size=128, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, dict(
            intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
        "qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM, dict(
            intermediate_size=128, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
        "gpt_oss": (t.GptOssConfig, t.GptOssForCausalLM, dict(
            intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64,
                             "rope_theta": 150000.0})),
    }


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral", "qwen3_moe", "gpt_oss")


def build_family(family: str, path: str | Path, seed: int = 0, dtype: str = "float32", **over):
    """Write a tiny random `family` checkpoint to `path` (`over`: config fields to change, e.g. a
    tokenizer's vocab_size); returns the transformers model (eval)."""
    import torch
    import transformers

    cfg_cls, model_cls, extra = _configs(transformers)[family]
    cfg = cfg_cls(**{**_COMMON, **extra, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and family.startswith("gemma"):
                p.copy_(0.1 * torch.randn(p.shape))  # Gemma scales by (1 + w)
            elif p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            elif p.ndim == 1:  # biases, sinks
                p.copy_(0.5 * torch.randn(p.shape))
            elif p.ndim == 2:  # [out, in] / [vocab, d]
                p.copy_(torch.randn(p.shape) / p.shape[1] ** 0.5)
            else:  # stacked experts [E, a, b]: fan-in is the input side
                fan_in = p.shape[1] if "gate_up_proj" in name and family == "gpt_oss" else p.shape[-1]
                if family == "gpt_oss" and "down_proj" in name:
                    fan_in = p.shape[1]
                p.copy_(torch.randn(p.shape) / fan_in ** 0.5)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy `generate`: always `n` new tokens (EOS does not stop it, as ours with
    `ignore_eos`)."""
    import torch

    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()
