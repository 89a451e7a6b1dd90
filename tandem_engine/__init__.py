"""Tandem's inference engine: the only JAX code in the project.

The decoder of every served family (arch.py: Llama, Mistral, Qwen2/3, Gemma 2/3, Mixtral,
Qwen3-MoE, gpt-oss, one description read from config.json) behind a JetStream-shaped slot API (prefill -> Prefix, insert into a slot of
a DecodeState, generate one step for all slots), plus explicit device<->host moves of the KV so the
services only ever move bytes. `load_engine(..., tp=N)` (or `mesh=`) splits weights and KV over
N chips by attention head and MLP unit, or whole experts (sharding.py). It imports no Redis, gRPC, HTTP or settings.
"""
from tandem_engine.engine import DEFAULT_BUCKETS, DecodeState, Engine, PrefillCall, Prefix
from tandem_engine.loading import load_engine
from tandem_engine.logits import PACKED_WIDTH, unpack_logprobs, unpack_tokens
from tandem_engine.model import ModelConfig, config_from_info
from tandem_engine.reference import reference_forward, reference_greedy
from tandem_engine.sharding import Layout, make_layout
from tandem_engine.weights import init_params, load_params, save_hf_checkpoint

__all__ = [
    "DEFAULT_BUCKETS",
    "DecodeState",
    "Engine",
    "Layout",
    "PACKED_WIDTH",
    "PrefillCall",
    "ModelConfig",
    "Prefix",
    "config_from_info",
    "init_params",
    "load_engine",
    "load_params",
    "make_layout",
    "reference_forward",
    "reference_greedy",
    "save_hf_checkpoint",
    "unpack_logprobs",
    "unpack_tokens",
]
