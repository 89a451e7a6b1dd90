"""The plainest forward: full recompute of every position, no cache, no scan, no grouping (K/V
heads repeated as transformers does). Ground truth beside transformers for the serving forwards
(model.py, paged.py) in tests, and the forward tools/train_builtin.py trains; never served."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from tandem_engine.arch import ModelConfig
from tandem_engine.model import (_attn_out, _ffn, _qkv, _scores, _window_mask, embed, layer_consts, logits_from_hidden,
                                 rms_norm)

__all__ = ["reference_forward", "reference_greedy"]


def reference_forward(params: dict, tokens, cfg: ModelConfig) -> jax.Array:
    """Logits [T, vocab] for every position of `tokens` [T]: no cache, no scan, no grouping
    (K/V heads are repeated as HF does). Ground truth for tests; not used when serving."""
    tokens = jnp.asarray(tokens, jnp.int32)
    t = tokens.shape[0]
    positions = jnp.arange(t)
    x = embed(params, tokens, cfg)  # [T, d]
    groups = cfg.num_heads // cfg.num_kv_heads
    consts = layer_consts(cfg)
    for i in range(cfg.num_layers):
        lp = jax.tree.map(lambda w: w[i], params["layers"])
        lc = jax.tree.map(lambda c: c[i], consts)
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, cfg)
        q, k, v = _qkv(h, lp, positions, lc, cfg)  # [T, heads, hd]
        k = jnp.repeat(k, groups, axis=1)
        v = jnp.repeat(v, groups, axis=1)
        scores = _scores(jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32)), cfg)
        allowed = _window_mask(positions[:, None], positions[None, :], lc.window)
        scores = jnp.where(allowed[None], scores, -jnp.inf)
        if cfg.sinks:
            sink = jnp.broadcast_to(lp["sinks"].astype(jnp.float32)[:, None, None], (cfg.num_heads, t, 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
        else:
            probs = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("hts,shd->thd", probs, v.astype(jnp.float32)).astype(x.dtype)
        x = _ffn(_attn_out(x, attn.reshape(t, -1), lp, cfg), lp, cfg)
    return logits_from_hidden(params, x, cfg)


@partial(jax.jit, static_argnames=("cfg",))
def _reference_logits_at(params, tokens, index, cfg: ModelConfig):
    return reference_forward(params, tokens, cfg)[index]


def reference_greedy(params: dict, cfg: ModelConfig, prompt_ids, num_tokens: int,
                     pad_to: int = 128) -> list[int]:
    """Greedy tokens by full recompute of the growing sequence (the single-process reference run).

    The sequence is zero-padded to `pad_to` (one compile; the causal mask keeps padding out of the
    real positions), so len(prompt_ids) + num_tokens must be <= pad_to.
    """
    ids = [int(t) for t in prompt_ids]
    if len(ids) + num_tokens > pad_to:
        raise ValueError(f"prompt {len(ids)} + {num_tokens} tokens exceeds pad_to {pad_to}")
    out = []
    for _ in range(num_tokens):
        padded = jnp.zeros((pad_to,), jnp.int32).at[: len(ids)].set(jnp.asarray(ids, jnp.int32))
        logits = _reference_logits_at(params, padded, len(ids) - 1, cfg=cfg)
        out.append(int(jnp.argmax(logits)))
        ids.append(out[-1])
    return out
