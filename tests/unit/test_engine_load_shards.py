"""Weights straight into their shards (shards.py): every device callback receives exactly its
shard, never the whole weight; the values are the checkpoint's (float32, bfloat16, int8 quantized
per shard bit for bit as quantize.py does it whole); an accelerator's host staging stays under
its bound (layers placed in chunks); a checkpoint larger than one device's share loads with no
device holding more than its share; progress reaches the total.

XLA_FLAGS must be set before JAX starts, so the multi-device checks run in a child process (this
file as a script, with four host CPU devices) that prints one JSON line the tests assert on.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tandem_core.models import PRESETS

pytestmark = pytest.mark.slow  # make test-unit leaves it out (make test runs it): child processes with host devices load and compile sharded engines

ROOT = Path(__file__).resolve().parents[2]
# 4 KV heads so that tp 1, 2 and 4 all divide them; untied, so the LM head is a leaf of its own
INFO = dataclasses.replace(PRESETS["tiny"], name="tiny-kv4", num_heads=8, num_kv_heads=4, head_dim=8, seed=5,
                           tie_word_embeddings=False)


def leaf_items(params: dict):
    for k, v in params.items():
        if k == "layers":
            yield from ((("layers", n), a) for n, a in v.items())
        else:
            yield (k,), v


def child(workdir: str) -> dict:
    import jax

    from tandem_core.models import resolve_model
    from tandem_engine import init_params, save_hf_checkpoint
    from tandem_engine.quantize import quantize_params
    from tandem_engine.sharding import make_layout
    from tandem_engine.weights import load_hf_checkpoint

    ref = init_params(INFO)
    info = resolve_model(str(save_hf_checkpoint(ref, INFO, Path(workdir) / "ckpt")))
    host_ref = {p: np.asarray(a) for p, a in leaf_items(ref)}
    total = sum(a.nbytes for a in host_ref.values())
    res: dict = {"devices": len(jax.devices()), "total": total}
    for tp in (1, 2, 4):
        layout = make_layout(info, tp)
        seen: list = []
        params, stats = load_hf_checkpoint(info, "float32", layout=layout, progress=seen.append)
        shard = {p: a.addressable_shards[0].data.nbytes for p, a in leaf_items(params)}
        calls: dict = {}
        for path, n in stats.handed:
            calls.setdefault("/".join(path), []).append(n == shard[tuple(path)])
        replicated = {"/".join(p) for p, a in leaf_items(params) if a.sharding.is_fully_replicated}
        res[f"tp{tp}"] = {
            # per leaf: callbacks, each its shard, replicated (JAX asks a replicated leaf's once)
            "calls": {k: [len(v), all(v), k in replicated] for k, v in calls.items()},
            "equal": all(np.array_equal(np.asarray(a), host_ref[p]) for p, a in leaf_items(params)),
            "per_device": max(sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards
                                  if s.device == d) for d in jax.devices()[:tp]),
            "replicated": sum(a.nbytes for a in jax.tree.leaves(params) if a.sharding.is_fully_replicated),
            "progress_last": [seen[-1].done_bytes, seen[-1].total_bytes] if seen else None,
        }
    # bfloat16 from a float32 file: cast per block
    bf, _ = load_hf_checkpoint(info, "bfloat16", layout=make_layout(info, 2))
    res["bf16_equal"] = all(np.array_equal(np.asarray(a), host_ref[p].astype(a.dtype)) for p, a in leaf_items(bf))
    res["bf16_dtype"] = str(bf["layers"]["wq"].dtype)
    # int8 per shard at tp 4 (o and down projections split on their input axis) == quantize.py whole
    want = {p: np.asarray(a) for p, a in leaf_items(quantize_params(ref, "int8"))}
    q, _ = load_hf_checkpoint(info, "float32", layout=make_layout(info, 4), quantize="int8")
    got = dict(leaf_items(q))
    res["int8_names"] = sorted("/".join(p) for p in got) == sorted("/".join(p) for p in want)
    res["int8_equal"] = {"/".join(p): bool(np.array_equal(np.asarray(got[p]), want[p])) for p in want if p in got}
    # an accelerator's staging bound: a stacked leaf in chunks of layers, each handed buffer within it
    layer_bytes = host_ref[("layers", "w_gate")].nbytes // INFO.num_layers
    staged, st = load_hf_checkpoint(info, "float32", layout=make_layout(info, 2), stage_bytes=layer_bytes)
    res["staged_equal"] = all(np.array_equal(np.asarray(a), host_ref[p]) for p, a in leaf_items(staged))
    res["staged_gate_calls"] = sum(1 for p, _ in st.handed if p == ("layers", "w_gate"))
    res["staged_largest_layered"] = max(n for p, n in st.handed if p[0] == "layers")
    res["layer_bytes"] = layer_bytes
    return res


@pytest.fixture(scope="module")
def results() -> dict:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, __file__, tmp], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_device_callback_receives_only_its_shard(results, tp):
    run = results[f"tp{tp}"]
    assert results["devices"] == 4
    assert any(not rep for _, _, rep in run["calls"].values()) or tp == 1
    for leaf, (n, each_is_shard, replicated) in run["calls"].items():
        assert n == (1 if replicated else tp), f"{leaf}: {n} device callbacks at tp={tp}"
        assert each_is_shard, f"{leaf}: a callback received more than its device's shard"
    assert run["equal"], "loaded weights differ from the checkpoint's"
    assert run["progress_last"] == [results["total"], results["total"]]


def test_no_device_holds_more_than_its_share(results):
    """The whole checkpoint exceeds one device's share at tp 4 (what the old loader put on
    device 0 before splitting), yet each device holds only the replicated leaves and 1/4 of the rest."""
    total = results["total"]
    for tp in (2, 4):
        run = results[f"tp{tp}"]
        share = run["replicated"] + (total - run["replicated"]) / tp
        assert total > share * 1.5
        assert run["per_device"] <= share * 1.001, (tp, run["per_device"], share)


def test_bfloat16_is_cast_per_block(results):
    assert results["bf16_dtype"] == "bfloat16" and results["bf16_equal"]


def test_int8_per_shard_equals_quantizing_whole(results):
    assert results["int8_names"]
    assert results["int8_equal"] and all(results["int8_equal"].values()), results["int8_equal"]


def test_staging_bound_places_layers_in_chunks(results):
    assert results["staged_equal"]
    assert results["staged_gate_calls"] == 2 * INFO.num_layers  # one layer per chunk, two devices
    assert results["staged_largest_layered"] <= results["layer_bytes"]


def test_quantize_block_matches_quantize_int8():
    import jax.numpy as jnp

    from tandem_engine.quantize import quantize_int8
    from tandem_engine.shards import quantize_block

    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 40, 24)).astype(np.float32) * rng.uniform(0.01, 3, (1, 1, 24)).astype(np.float32)
    w[1, :, 5] = 0  # an all-zero column: scale 1
    q_want, s_want = quantize_int8(jnp.asarray(w))
    q, s = quantize_block(w, in_axis=-2)
    np.testing.assert_array_equal(q, np.asarray(q_want))
    np.testing.assert_array_equal(s, np.asarray(s_want))


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1])))


def test_direct_reads_equal_buffered_reads(tmp_path):
    """Blocks read by direct I/O (aligned reads around unaligned tensors, the file's last bytes
    too) are the bytes a buffered read gives, and safetensors' own reader gives."""
    from safetensors.numpy import load_file

    from tandem_engine import init_params, save_hf_checkpoint
    from tandem_engine.checkpoint import Tensors

    path = save_hf_checkpoint(init_params(INFO), INFO, tmp_path / "ckpt")
    want = load_file(str(path / "model.safetensors"))
    direct, buffered = Tensors(path, direct=True), Tensors(path, direct=False)
    try:
        if not direct._fd(path / "model.safetensors")[1]:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: the buffered reads serve")
        last = max(direct.meta, key=lambda n: direct.meta[n].offset)
        for name, arr in want.items():
            np.testing.assert_array_equal(direct.block(name), arr)
            np.testing.assert_array_equal(buffered.block(name), arr)
            if arr.ndim == 2:
                np.testing.assert_array_equal(direct.block(name, (), slice(3, 7)), arr[3:7])
            if arr.ndim == 2 and name == last:
                np.testing.assert_array_equal(direct.block(name, (), slice(arr.shape[0] - 1, None)), arr[-1:])
    finally:
        direct.close()
        buffered.close()
