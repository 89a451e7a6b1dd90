"""The plainest forward: full recompute of every position, no cache, no scan, no grouping (K/V
heads repeated as transformers does). Ground truth beside transformers for the serving forwards
(model.py, paged.py) in tests, and the forward tools/train_builtin.py trains; never served."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from tandem_engine.arch import ModelConfig
from tandem_engine.attention import _scores, _window_mask
from tandem_engine.model import decoder_layer, embed, layer_loop, logits_from_hidden

__all__ = ["reference_forward", "reference_greedy"]


def reference_forward(params: dict, tokens, cfg: ModelConfig) -> jax.Array:
    """Logits [T, vocab] for every position of `tokens` [T]: no cache, no scan, no grouping
    (K/V heads are repeated as HF does). Ground truth for tests; not used when serving."""
    tokens = jnp.asarray(tokens, jnp.int32)
    t = tokens.shape[0]
    positions = jnp.arange(t)
    x = embed(params, tokens, cfg)  # [T, d]
    groups = cfg.num_heads // cfg.num_kv_heads
    for _, lp, lc in layer_loop(params, cfg):

        def attention(q, k, v, sinks, lc=lc):  # [T, heads, hd]: K/V heads repeated, every score kept
            k = jnp.repeat(k, groups, axis=1)
            v = jnp.repeat(v, groups, axis=1)
            scores = _scores(jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32)), cfg)
            allowed = _window_mask(positions[:, None], positions[None, :], lc.window)
            scores = jnp.where(allowed[None], scores, -jnp.inf)
            if sinks is not None:
                sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (cfg.num_heads, t, 1))
                probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
            else:
                probs = jax.nn.softmax(scores, axis=-1)
            attn = jnp.einsum("hts,shd->thd", probs, v.astype(jnp.float32)).astype(x.dtype)
            return attn.reshape(t, -1), None

        x, _ = decoder_layer(x, lp, lc, positions, cfg, attention)
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
