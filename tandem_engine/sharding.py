"""Tensor parallelism: where each weight and KV array lives on a `jax.sharding.Mesh`.

One mesh axis, "tp" (Megatron-style). Attention is split by head: the q/k/v projections by output
column, the o projection by input row, the KV cache on its kv-heads axis (the paged pool too: each
layer buffer on its leading kv-heads axis, every chip holding its heads' rows of every block). The
MLP is split by its hidden units: gate/up by column, down by row. Each chip then holds 1/tp of the
heavy weights and of the KV cache, and a layer needs one all-reduce after attention and one after
the MLP, which XLA inserts itself: the jitted cores only pin the shardings of what they return (the KV) and let jit
propagate the rest from the sharded inputs. Norms stay replicated.

The embedding [V, d] and the LM head [d, V] (a tied model's head is embed.T) are split on the
vocabulary (vocabulary parallelism), each chip holding V / tp rows / columns: a lookup is a masked
local gather and one all-reduce of the [rows, d] activations, and the logits come out split on V.
XLA partitions what reads them (seen in the TPU compile of Llama-3.1-8B's decode step at tp 4 on
v5e 2x2, whose only all-gathers are the sampler's: its candidates [64, 4 x 256] and a [4, 64]
value and id per shard): greedy is a local max and an all-reduce of [rows]; the sampler's
`lax.top_k` a per-shard top-k and one all-gather of the candidates, never of the logits.
Logprobs (log_softmax, the top MAX_TOP_LOGPROBS), penalties, logit_bias and grammar masks are
reductions, elementwise ops and scatters on the split logits, left to XLA's partitioning (correct
by construction; their collectives not inspected). A vocabulary that tp does not divide (the
built-in byte models' 258 at tp 4) keeps the embedding and head replicated, as before, rather than
refuse a layout that works.

Query heads are grouped per KV head in HF order (query head h reads KV head h // groups), so cutting
both the H*hd columns of wq and the KV*hd columns of wk/wv into tp contiguous blocks keeps every
query head on the chip that holds its KV head. That is why num_kv_heads must be divisible by tp.

The host layout of a prefix never depends on tp: export gathers to numpy [L, T, KV, hd] and import
places the payload with the importing engine's layout, so KV moves between engines of any tp.
This module knows nothing about slots or sampling.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tandem_core.models import ModelInfo
from tandem_engine.arch import config_from_info

AXIS = "tp"

# per-layer weights carry a leading [num_layers] axis (see model.py)
_LAYER_SPECS = {
    "attn_norm": P(), "mlp_norm": P(), "attn_post_norm": P(), "mlp_post_norm": P(),
    "q_norm": P(), "k_norm": P(),
    "wq": P(None, None, AXIS), "wk": P(None, None, AXIS), "wv": P(None, None, AXIS),
    "bq": P(None, AXIS), "bk": P(None, AXIS), "bv": P(None, AXIS),
    "wo": P(None, AXIS, None), "bo": P(),  # the o bias is added once, after the all-reduce
    "sinks": P(None, AXIS),  # per query head: each chip holds its heads' sinks
    "w_gate": P(None, None, AXIS), "w_up": P(None, None, AXIS), "w_down": P(None, AXIS, None),
    "router": P(), "router_bias": P(),
}
# mixture of experts: tensor parallelism inside each expert (its hidden units split, as the dense
# MLP's) or expert parallelism (whole experts split across chips)
_EXPERT_TP = {
    "we_gate": P(None, None, None, AXIS), "we_up": P(None, None, None, AXIS), "we_down": P(None, None, AXIS, None),
    "be_gate": P(None, None, AXIS), "be_up": P(None, None, AXIS), "be_down": P(),
}
_EXPERT_EP = {
    "we_gate": P(None, AXIS), "we_up": P(None, AXIS), "we_down": P(None, AXIS),
    "be_gate": P(None, AXIS), "be_up": P(None, AXIS), "be_down": P(None, AXIS),
}
# int8 weights (quantize.py): a weight's per-output-channel scales [L, (E,) out] are cut where
# its output columns are: with the columns (q/k/v, gate/up) or not at all (o, down: their output
# is the all-reduced sum, and the scale multiplies it after the sum is taken)
_SCALE_SPECS = {
    "wq_scale": P(None, AXIS), "wk_scale": P(None, AXIS), "wv_scale": P(None, AXIS), "wo_scale": P(),
    "w_gate_scale": P(None, AXIS), "w_up_scale": P(None, AXIS), "w_down_scale": P(),
}
_EXPERT_TP_SCALES = {"we_gate_scale": P(None, None, AXIS), "we_up_scale": P(None, None, AXIS), "we_down_scale": P()}
_EXPERT_EP_SCALES = {"we_gate_scale": P(None, AXIS), "we_up_scale": P(None, AXIS), "we_down_scale": P(None, AXIS)}
_EMBED = P(AXIS, None)  # [V, d]: vocabulary parallel
_LM_HEAD = P(None, AXIS)  # [d, V]
_KV_PREFIX = P(None, None, AXIS, None)  # [L, T, KV, hd]
_KV_PREFIXES = P(None, None, None, AXIS, None)  # [L, B, T, KV, hd]: a batched prefill's
_KV_POOL = P(AXIS, None, None, None)  # one layer's paged pool buffer [KV, num_blocks, block_size, hd]


class Layout(NamedTuple):
    """A mesh with a "tp" axis and the shardings the engine uses on it (hashable: it is a static
    argument of the jitted cores)."""

    mesh: Mesh
    expert_parallel: bool = False  # experts split across chips (else each expert split by hidden unit)

    @property
    def tp(self) -> int:
        return int(self.mesh.shape[AXIS])

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def replicated(self) -> NamedSharding:
        return self.named(P())

    def kv_prefix(self) -> NamedSharding:
        return self.named(_KV_PREFIX)

    def kv_prefixes(self) -> NamedSharding:
        return self.named(_KV_PREFIXES)

    def kv_pool(self) -> NamedSharding:
        """One layer buffer of the paged pool (paged.py), split by KV head: each chip holds its
        heads' slice of every block; block tables stay replicated."""
        return self.named(_KV_POOL)

    def param_shardings(self, params: dict) -> dict:
        """A pytree of NamedShardings matching `params` (with or without lm_head): the embedding
        and head split on the vocabulary when tp divides it (`vocab_split`)."""
        out = {name: self.replicated() for name in params if name != "layers"}
        if self.vocab_split(int(params["embed"].shape[0])):
            out["embed"] = self.named(_EMBED)
            if "lm_head" in params:
                out["lm_head"] = self.named(_LM_HEAD)
        specs = {**_LAYER_SPECS, **_SCALE_SPECS,
                 **(_EXPERT_EP | _EXPERT_EP_SCALES if self.expert_parallel else _EXPERT_TP | _EXPERT_TP_SCALES)}
        out["layers"] = {name: self.named(specs[name]) for name in params["layers"]}
        return out

    def vocab_split(self, vocab: int) -> bool:
        """Whether the embedding and LM head are split on the vocabulary (tp divides it)."""
        return self.tp > 1 and vocab % self.tp == 0

    def place_params(self, params: dict) -> dict:
        """`params` on this layout (leaves already placed so, as the loader leaves them, stay)."""
        return jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s else jax.device_put(x, s),
                            params, self.param_shardings(params))


def make_layout(info: ModelInfo, tp: int = 1, mesh: Mesh | None = None,
                expert_parallel: bool = False) -> Layout | None:
    """The layout for `tp` chips (the first tp of `jax.devices()`) or for a given mesh with a "tp"
    axis (other axes, if any, replicate). None when tp == 1 and no mesh: unsharded, as before.
    `expert_parallel`: a mixture of experts splits whole experts across the chips (expert
    parallelism) instead of each expert's hidden units (tensor parallelism)."""
    if mesh is not None:
        if AXIS not in mesh.axis_names:
            raise ValueError(f"mesh axes {mesh.axis_names} have no {AXIS!r} axis to shard over")
        if tp not in (1, mesh.shape[AXIS]):
            raise ValueError(f"tp={tp} disagrees with the mesh's {AXIS!r} axis of size {mesh.shape[AXIS]}")
        check_divisible(info, int(mesh.shape[AXIS]), expert_parallel)
        return Layout(mesh, bool(expert_parallel))
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    check_divisible(info, tp, expert_parallel)
    if tp == 1:
        return None
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(
            f"tp={tp} needs {tp} devices but JAX sees {len(devices)} ({devices[0].platform}); "
            f"on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count={tp} before JAX starts"
        )
    return Layout(Mesh(np.asarray(devices[:tp]), (AXIS,)), bool(expert_parallel))


def check_divisible(info: ModelInfo, tp: int, expert_parallel: bool = False) -> None:
    """Heads and MLP units (or experts) are split evenly across chips, or not at all."""
    ok = [d for d in range(1, info.num_kv_heads + 1) if info.num_kv_heads % d == 0]
    if info.num_kv_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide num_kv_heads={info.num_kv_heads} of {info.name}: KV heads are "
            f"split across chips, so use tp in {ok}"
        )
    experts = config_from_info(info).num_experts
    if expert_parallel:
        if not experts:
            raise ValueError(f"expert parallelism needs a mixture of experts; {info.name} is dense")
        if experts % tp:
            raise ValueError(f"tp={tp} does not divide the {experts} experts of {info.name}: experts are "
                             f"split across chips, so use a tp that divides {experts}")
        return
    if info.intermediate_size % tp:
        raise ValueError(
            f"tp={tp} does not divide intermediate_size={info.intermediate_size} of {info.name}: "
            f"MLP units are split across chips"
        )


def constrain(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    """Pin `x` to `sharding` inside a jitted function (no-op when unsharded)."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)
