"""The single-CPU decode step reads its weights and KV in place (issue 29): the compiled step has
no copy of a layer's slice of a stacked weight and no copy of a block's first rows at a batch of
at most KV_SLOT_GROUP rows; the cache in slot groups computes and stores what one group of all
slots does; the greedy pick is argmax's. Structure is checked in the compiled HLO (what XLA
runs), never by timing."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem_engine import load_engine
from tandem_engine.cores import generate_core
from tandem_engine.model import (KV_SLOT_GROUP, blocked_cache, decode_forward_blocked, kv_block_sizes,
                                 kv_slot_groups, split_layers, write_blocks)
from tandem_engine.sampling import greedy_tokens

SLOTS, MAX_LEN = 16, 256  # slot groups of 8 and 8, blocks of 128 and 128


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(16,))


def test_slot_groups_cover_the_slots():
    assert kv_slot_groups(4) == (4,)
    assert kv_slot_groups(KV_SLOT_GROUP) == (KV_SLOT_GROUP,)
    assert kv_slot_groups(32) == (KV_SLOT_GROUP, 32 - KV_SLOT_GROUP)
    k, v = blocked_cache(2, 32, 2, 16, 300, jnp.float32)
    assert [[b.shape for b in g] for g in k[0]] == [[(8, 2, 16, n) for n in kv_block_sizes(300)],
                                                   [(24, 2, 16, n) for n in kv_block_sizes(300)]]
    assert [b.shape for b in v[1][1]] == [(24, 2, n, 16) for n in kv_block_sizes(300)]


def slice_copies(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """Lines of compiled HLO where a slice (fused or not) produces an array of one of `shapes`."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= f32\[([\d,]+)\]\{[^}]*\} \S+\(.*op_name=\"[^\"]*/slice\"", line)
        if m and tuple(int(x) for x in m.group(1).split(",")) in shapes:
            out.append(line.strip()[:160])
    return out


def test_step_reads_weights_and_blocks_in_place(engine):
    """At a batch of KV_SLOT_GROUP rows the compiled step slices no stacked layer weight and no
    cache block: each dot reads a whole buffer (XLA CPU copies any slice before a dot)."""
    rows = KV_SLOT_GROUP
    state = engine.init_state()
    hlo = generate_core.lower(engine.step_params, state, cfg=engine.cfg, layout=None, rows=rows).compile().as_text()
    weights = {tuple(w.shape[1:]) for w in engine.params["layers"].values() if w.ndim > 2}
    c = engine.cfg
    blocks = {shape for n in kv_block_sizes(MAX_LEN)
              for shape in ((rows, c.num_kv_heads, c.head_dim, n), (rows, c.num_kv_heads, n, c.head_dim))}
    assert not slice_copies(hlo, weights), "a layer's weights are sliced out of the stacked arrays"
    assert not slice_copies(hlo, blocks), "a step of KV_SLOT_GROUP rows copies the first rows of its blocks"
    # the check can see a slice copy: the stacked params make one per weight
    stacked = generate_core.lower(engine.params, state, cfg=engine.cfg, layout=None, rows=rows).compile().as_text()
    assert slice_copies(stacked, weights)


def test_split_layers_shares_all_but_the_layers(engine):
    split = split_layers(engine.params)
    assert split["embed"] is engine.params["embed"]
    assert len(split["layers"]) == engine.cfg.num_layers
    for name, w in engine.params["layers"].items():
        for i, layer in enumerate(split["layers"]):
            np.testing.assert_array_equal(np.asarray(layer[name]), np.asarray(w[i]))
    assert split_layers(split) is split


def _regroup(blocks, groups):
    """[layer][block] over all slots -> [layer][group][block] (the same values)."""
    out, first = [], 0
    for layer in blocks:
        gs, first = [], 0
        for n in groups:
            gs.append(tuple(b[first:first + n] for b in layer))
            first += n
        out.append(tuple(gs))
    return tuple(out)


def _ungroup(blocks):
    return tuple(tuple(jnp.concatenate([g[j] for g in layer]) for j in range(len(layer[0]))) for layer in blocks)


@pytest.mark.parametrize("rows", [4, 8, 12, 16])
def test_grouped_cache_step_equals_one_group(engine, rows):
    """A step over the cache in slot groups (a batch inside group 0, one that reaches into
    group 1, all slots) gives the logits and the cache one group of all slots gives."""
    cfg, params = engine.cfg, split_layers(engine.params)
    rng = np.random.default_rng(3)
    sizes = kv_block_sizes(MAX_LEN)
    kb = tuple(tuple(jnp.asarray(rng.standard_normal((SLOTS, cfg.num_kv_heads, cfg.head_dim, n)), jnp.float32)
                     for n in sizes) for _ in range(cfg.num_layers))
    vb = tuple(tuple(jnp.asarray(rng.standard_normal((SLOTS, cfg.num_kv_heads, n, cfg.head_dim)), jnp.float32)
                     for n in sizes) for _ in range(cfg.num_layers))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, rows), jnp.int32)
    positions = jnp.asarray(rng.integers(0, MAX_LEN, rows), jnp.int32).at[0].set(200)  # one in block 1
    active = jnp.arange(rows) != 1  # a freed slot
    step = jax.jit(decode_forward_blocked, static_argnames="cfg")
    want_logits, want_k, want_v = step(params, tokens, positions, kb, vb, cfg=cfg, active=active)
    groups = kv_slot_groups(SLOTS)
    got_logits, got_k, got_v = step(params, tokens, positions, _regroup(kb, groups), _regroup(vb, groups),
                                    cfg=cfg, active=active)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    # layer 0 writes the same K/V bit for bit; later layers' K/V follow float rounding of the
    # batch's shapes (a group's dots are smaller)
    for got, want in ((_ungroup(got_k), want_k), (_ungroup(got_v), want_v)):
        for i, (g_layer, w_layer) in enumerate(zip(got, want)):
            for g, w in zip(g_layer, w_layer):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0 if i == 0 else 1e-5,
                                           atol=0 if i == 0 else 1e-5)


@pytest.mark.parametrize("slot", [3, 8, 13])
def test_write_blocks_into_a_slot_group(engine, slot):
    """An insert writes the slot's rows in its own group and leaves every other slot as it was."""
    cfg = engine.cfg
    rng = np.random.default_rng(slot)
    sizes = kv_block_sizes(MAX_LEN)
    kb = tuple(tuple(jnp.asarray(rng.standard_normal((SLOTS, cfg.num_kv_heads, cfg.head_dim, n)), jnp.float32)
                     for n in sizes) for _ in range(cfg.num_layers))
    vb = tuple(tuple(jnp.asarray(rng.standard_normal((SLOTS, cfg.num_kv_heads, n, cfg.head_dim)), jnp.float32)
                     for n in sizes) for _ in range(cfg.num_layers))
    t = 150  # spans both blocks
    k = jnp.asarray(rng.standard_normal((cfg.num_layers, t, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((cfg.num_layers, t, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
    write = jax.jit(write_blocks)
    want_k, want_v = write(kb, vb, k, v, jnp.int32(slot))
    groups = kv_slot_groups(SLOTS)
    got_k, got_v = write(_regroup(kb, groups), _regroup(vb, groups), k, v, jnp.int32(slot))
    for got, want in ((_ungroup(got_k), want_k), (_ungroup(got_v), want_v)):
        for g_layer, w_layer in zip(got, want):
            for g, w in zip(g_layer, w_layer):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(want_k[0][0][slot, :, :, :t]), np.asarray(k[0].transpose(1, 2, 0)[:, :, :128]))


def test_greedy_tokens_are_argmax():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 300)).astype(np.float32)
    x[1, [5, 17, 200]] = 9.0  # a tie: the first index, as argmax
    x[2] = -np.inf  # every token masked: index 0, as argmax
    x[3, 299] = 50.0  # the last index
    x = jnp.asarray(x)
    assert np.asarray(greedy_tokens(x)).tolist() == np.asarray(jnp.argmax(x, axis=-1)).tolist()
    assert int(greedy_tokens(x)[1]) == 5
