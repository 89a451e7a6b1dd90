"""The paged decode step on one CPU device reads its layer weights in place (issue 29): the
compiled step has no copy of a layer's slice of a stacked weight (engine.step_params holds them
one layer apiece, model.split_layers); the greedy pick is argmax's. Structure is checked in the
compiled HLO (what XLA runs), never by timing."""
from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from tandem_engine import load_engine
from tandem_engine.cores import generate_core
from tandem_engine.model import split_layers
from tandem_engine.sampling import greedy_tokens

SLOTS, MAX_LEN = 8, 256


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny", slots=SLOTS, max_len=MAX_LEN, prefill_buckets=(16,))


def slice_copies(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """Lines of compiled HLO where a slice (fused or not) produces an array of one of `shapes`."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= f32\[([\d,]+)\]\{[^}]*\} \S+\(.*op_name=\"[^\"]*/slice\"", line)
        if m and tuple(int(x) for x in m.group(1).split(",")) in shapes:
            out.append(line.strip()[:160])
    return out


def test_paged_step_reads_layer_weights_in_place(engine):
    """The paged step on one CPU device runs its layers unrolled: compiled over `step_params` it
    slices no stacked layer weight (XLA CPU copies any slice before a dot)."""
    state = engine.init_state()
    kw = dict(cfg=engine.cfg, layout=None, rows=SLOTS, max_len=engine.max_len,
              table_blocks=engine.max_blocks_per_seq)
    hlo = generate_core.lower(engine.step_params, state, **kw).compile().as_text()
    weights = {tuple(w.shape[1:]) for w in engine.params["layers"].values() if w.ndim > 2}
    assert not slice_copies(hlo, weights), "a layer's weights are sliced out of the stacked arrays"
    # the check can see a slice copy: the stacked params make one per weight
    stacked = generate_core.lower(engine.params, state, **kw).compile().as_text()
    assert slice_copies(stacked, weights)


def test_split_layers_shares_all_but_the_layers(engine):
    split = split_layers(engine.params)
    assert split["embed"] is engine.params["embed"]
    assert len(split["layers"]) == engine.cfg.num_layers
    for name, w in engine.params["layers"].items():
        for i, layer in enumerate(split["layers"]):
            np.testing.assert_array_equal(np.asarray(layer[name]), np.asarray(w[i]))
    assert split_layers(split) is split


def test_greedy_tokens_are_argmax():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 300)).astype(np.float32)
    x[1, [5, 17, 200]] = 9.0  # a tie: the first index, as argmax
    x[2] = -np.inf  # every token masked: index 0, as argmax
    x[3, 299] = 50.0  # the last index
    x = jnp.asarray(x)
    assert np.asarray(greedy_tokens(x)).tolist() == np.asarray(jnp.argmax(x, axis=-1)).tolist()
    assert int(greedy_tokens(x)[1]) == 5
