"""The paged pool's stored layout (tandem_engine/pool_layout.py): lane-folded blocks, the same
bytes as [B, hd], written by the step and the insert where the readers (the gather path, the CPU
kernel, the prefix pool's read-out, the Pallas kernel) look for each position."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tandem_engine import attention, paged
from tandem_engine.pool_layout import block_shape, fold, lane_fold, unfold


@pytest.mark.parametrize("hd, bs, want", [(64, 16, 2), (32, 16, 4), (16, 16, 8), (128, 16, 1), (256, 16, 1),
                                          (96, 16, 1), (80, 16, 1), (64, 15, 1), (32, 2, 1), (64, 2, 2)])
def test_lane_fold(hd, bs, want):
    """f positions a 128-lane row: 128 / hd for a head_dim dividing 128 over blocks f divides; 1
    (the pool as [.., B, hd]) for 128, 256, a head_dim not dividing 128, or a block size f does
    not divide."""
    assert lane_fold(hd, bs) == want
    assert block_shape(bs, hd) == (bs // want, hd * want)


def test_a_folded_row_holds_positions_t_times_f_plus_c_in_lane_group_c():
    """The kernel's reading of a folded block (pallas_decode.py): row t, lanes [c * hd, (c + 1) * hd)
    hold position t * f + c; unfold gives back [B, hd]."""
    hd, bs = 32, 16
    x = np.arange(bs * hd, dtype=np.float32).reshape(bs, hd)  # position p: values p * hd + [0, hd)
    folded = np.asarray(fold(jnp.asarray(x), hd))
    f = 128 // hd
    assert folded.shape == (bs // f, 128)
    for t in range(bs // f):
        for c in range(f):
            np.testing.assert_array_equal(folded[t, c * hd:(c + 1) * hd], x[t * f + c])
    np.testing.assert_array_equal(np.asarray(unfold(jnp.asarray(folded), hd)), x)


@pytest.mark.parametrize("hd", [64, 32, 128])
def test_the_step_and_the_insert_write_each_position_where_the_readers_read_it(hd):
    """`_write_rows` (the step's new K/V: two neighbours of one sequence in one call, as a prompt
    chunk writes them, and rows sharing the null block) and `write_prompt_blocks` (an insert) into
    a pool from `paged_pool`: each position lands at unfold(pool)[:, block, offset], where the
    gather path, the CPU kernel and the prefix pool's read-out look for it, nothing else changes."""
    kvh, blocks, bs = 2, 6, 16
    k, _ = paged.paged_pool(1, kvh, blocks, bs, hd, jnp.float32)
    layer = k[0]
    assert layer.shape == (kvh, blocks + 1, *block_shape(bs, hd))
    r = np.random.default_rng(0)
    want = r.normal(size=(kvh, blocks + 1, bs, hd)).astype(np.float32)
    layer = fold(jnp.asarray(want), hd)
    flat = np.array([3 * bs + 4, 3 * bs + 5, 1 * bs + 15, 0, 0], np.int32)  # neighbours; the null block twice
    new = r.normal(size=(len(flat), kvh, hd)).astype(np.float32)
    new[4] = new[3]  # rows sharing a target write the same (their order is not defined)
    got = np.asarray(unfold(attention._write_rows(layer, jnp.asarray(new), jnp.asarray(flat), hd), hd))
    for i, p in enumerate(flat):
        want[:, p // bs, p % bs] = new[i]
    np.testing.assert_array_equal(got, want)

    prompt = r.normal(size=(1, 2 * bs - 3, kvh, hd)).astype(np.float32)  # [L, T, KV, hd]: two blocks, the last part-full
    ids = jnp.asarray([5, 2], jnp.int32)
    (out,), _ = paged.write_prompt_blocks((layer,), (layer,), jnp.asarray(prompt), jnp.asarray(prompt), ids)
    got = np.asarray(unfold(out, hd))
    want = np.asarray(unfold(layer, hd)).copy()
    padded = np.concatenate([prompt[0], np.zeros((3, kvh, hd), np.float32)])  # rows past T: zeros
    want[:, 5] = np.swapaxes(padded[:bs], 0, 1)
    want[:, 2] = np.swapaxes(padded[bs:], 0, 1)
    np.testing.assert_array_equal(got, want)
