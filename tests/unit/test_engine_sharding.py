"""Tensor parallelism: greedy tokens are the same at tp 1, 2 and 4; a prefix made at tp=2 decodes
to the same tokens in engines at tp=4 and tp=1; a prefill over a cached prefix shards too, and so
does bfloat16; a bad tp says what to do.

XLA_FLAGS must be set before JAX starts, so the multi-device checks run in a child process (this
same file run as a script, with four host CPU devices) that prints one JSON line; the test reads it
and asserts here so a failure shows which check broke.
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
from tandem_core.types import SamplingParams

pytestmark = pytest.mark.slow  # make test-unit leaves it out (make test runs it): a child process with 4 host devices compiles engines at tp 1, 2 and 4

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams()
STEPS = 16
# 4 KV heads (8 query heads) so that tp 1, 2 and 4 all divide them, and a vocabulary of 260 (the
# bytes, BOS, EOS and two unused ids) that they divide too, so the embedding and head split
KV4 = dataclasses.replace(PRESETS["tiny"], name="tiny-kv4", num_heads=8, num_kv_heads=4,
                          head_dim=8, seed=3, vocab_size=260)
KW = dict(slots=3, max_len=64, prefill_buckets=(32,))  # one bucket: one prefill compile per engine


def prompts() -> dict[int, list[int]]:
    rng = np.random.default_rng(7)
    return {slot: rng.integers(0, 256, size=n).tolist() for slot, n in ((0, 5), (1, 20), (2, 31))}


SAMPLED = {0: SamplingParams(temperature=1.0, seed=5), 1: SamplingParams(temperature=0.8, top_p=0.9, seed=6),
           2: SamplingParams(temperature=1.2, top_k=20, seed=7)}  # plain, top-p, top-k


def decode(engine, prefixes: dict, steps: int = STEPS, per_call: int = 1,
           params: dict | None = None) -> dict[str, list[int]]:
    """Insert each slot's prefix, run `steps` greedy steps for the batch (`per_call` of them in
    each generate call: multi-step decode); tokens per slot."""
    state = engine.init_state()
    out = {}
    for slot, prefix in prefixes.items():
        state = engine.insert(prefix, state, slot, GREEDY if params is None else params[slot])
        out[str(slot)] = [prefix.first_token]
    for _ in range(steps // per_call):
        state, tokens = engine.generate(state, steps=per_call)
        host = np.asarray(tokens).reshape(per_call, -1)
        for slot in prefixes:
            out[str(slot)] += host[:, slot].tolist()
    import jax

    # the first pool buffer stands for the pool (tp 1: one device, no spec)
    out["_kv_spec"] = str(getattr(jax.tree.leaves(state.k)[0].sharding, "spec", None))
    return out


def child(workdir: str) -> dict:
    """Runs with 4 host devices; returns everything the parent asserts on."""
    import jax

    from tandem_engine import init_params, load_engine, save_hf_checkpoint

    ckpt = save_hf_checkpoint(init_params(KV4), KV4, Path(workdir) / "kv4")
    res: dict = {"devices": len(jax.devices())}
    # tp=2 through the `mesh` argument, on the last two devices (tp=4 uses all four)
    pair = jax.sharding.Mesh(np.asarray(jax.devices()[2:]), ("tp",))
    engines = {1: load_engine(str(ckpt), **KW), 2: load_engine(str(ckpt), mesh=pair, **KW),
               4: load_engine(str(ckpt), tp=4, **KW)}
    res["tp2_devices"] = sorted(d.id for d in engines[2].params["layers"]["wq"].devices())
    for tp, e in engines.items():
        res[f"greedy_tp{tp}"] = decode(e, {s: e.prefill(ids, GREEDY) for s, ids in prompts().items()})
        wq = e.params["layers"]["wq"]
        res[f"wq_shard_tp{tp}"] = list(wq.addressable_shards[0].data.shape)
        for name in ("embed", "lm_head"):
            if name in e.params:
                res[f"{name}_shards_tp{tp}"] = [list(s.data.shape) for s in e.params[name].addressable_shards]
    # seeded sampling: the same tokens at every tp (the sampler's top-k runs on the vocabulary's shards)
    for tp, e in engines.items():
        res[f"sampled_tp{tp}"] = decode(e, {s: e.prefill(ids, SAMPLED[s]) for s, ids in prompts().items()},
                                        params=SAMPLED)
    # multi-step decode (4 steps per call) at tp=4: the same tokens, the cache kept sharded by head
    e = engines[4]
    res["multi_tp4"] = decode(e, {s: e.prefill(ids, GREEDY) for s, ids in prompts().items()}, per_call=4)
    # prefill at tp=2 -> host bytes -> decode at tp=4 and tp=1
    payloads = {s: engines[2].export_prefix(engines[2].prefill(ids, GREEDY)) for s, ids in prompts().items()}
    res["payload_shape"] = list(payloads[1].k.shape)
    for tp in (4, 1):
        e = engines[tp]
        res[f"moved_2_to_{tp}"] = decode(e, {s: e.import_prefix(p) for s, p in payloads.items()})
    # a device prefix on chips 2-3 handed straight to another engine is moved there by insert
    for tp in (4, 1):
        res[f"direct_2_to_{tp}"] = decode(engines[tp], {1: engines[2].prefill(prompts()[1], GREEDY)})
    # a prompt over a cached prefix at tp=4: the prefix pool split by KV head over the chips, the
    # rest read from it in place on each chip (prefix_pool.py)
    from tandem_engine.prefix_pool import device_cache_for
    cache = device_cache_for(engines[4], 16, 1 << 24)
    head = prompts()[2][:20]
    first = engines[4].prefill(head, GREEDY)
    cache.insert(head, lambda: (np.asarray(first.k), np.asarray(first.v)))
    hit = cache.lookup(prompts()[2])
    res["cached_tp4"] = decode(engines[4], {2: engines[4].prefill(prompts()[2], GREEDY, cached=hit)})
    res["cached_tp4_hits"] = cache.stats.hits
    # bfloat16 weights and KV, sharded
    for tp in (1, 2):
        e = load_engine(str(ckpt), tp=tp, dtype="bfloat16", **KW)
        res[f"bf16_tp{tp}"] = decode(e, {s: e.prefill(ids, GREEDY) for s, ids in prompts().items()})
        payload = e.export_prefix(e.prefill(prompts()[0], GREEDY))
        res[f"bf16_tp{tp}_dtypes"] = [str(e.params["layers"]["wq"].dtype), str(payload.k.dtype)]
    try:
        load_engine(str(ckpt), tp=3, **KW)
        res["error_tp3"] = None
    except ValueError as err:
        res["error_tp3"] = str(err)
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


def tokens(run: dict) -> dict:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def test_weights_and_kv_are_split_by_head_and_vocabulary(results):
    assert results["devices"] == 4 and results["tp2_devices"] == [2, 3]
    d, h = KV4.hidden_size, KV4.num_heads * KV4.head_dim
    assert results["wq_shard_tp1"] == [KV4.num_layers, d, h]
    assert results["wq_shard_tp2"] == [KV4.num_layers, d, h // 2]
    assert results["wq_shard_tp4"] == [KV4.num_layers, d, h // 4]
    v = KV4.vocab_size
    assert results["embed_shards_tp1"] == [[v, d]]
    assert results["embed_shards_tp2"] == [[v // 2, d]] * 2  # vocabulary parallel: 1/tp on each chip
    assert results["embed_shards_tp4"] == [[v // 4, d]] * 4
    if "lm_head_shards_tp1" in results:
        assert results["lm_head_shards_tp4"] == [[d, v // 4]] * 4
    assert results["greedy_tp1"]["_kv_spec"] == "None"
    assert results["greedy_tp4"]["_kv_spec"] == "P('tp',)"  # a pool buffer [KV, blocks, B, hd] split by KV head


def test_greedy_tokens_equal_across_tp(results):
    want = tokens(results["greedy_tp1"])
    assert len(want) == 3 and all(len(t) == STEPS + 1 for t in want.values())
    assert tokens(results["greedy_tp2"]) == want
    assert tokens(results["greedy_tp4"]) == want


def test_seeded_sampling_equal_across_tp(results):
    want = tokens(results["sampled_tp1"])
    assert want != tokens(results["greedy_tp1"])
    assert tokens(results["sampled_tp2"]) == want
    assert tokens(results["sampled_tp4"]) == want


def test_multi_step_decode_shards(results):
    assert results["multi_tp4"] == results["greedy_tp4"]  # tokens and the KV's sharding spec


def test_prefix_moves_between_tp(results):
    want = tokens(results["greedy_tp1"])
    assert results["payload_shape"] == [KV4.num_layers, 32, KV4.num_kv_heads, KV4.head_dim]
    assert tokens(results["moved_2_to_4"]) == want
    assert tokens(results["moved_2_to_1"]) == want
    assert tokens(results["direct_2_to_4"]) == {"1": want["1"]}
    assert tokens(results["direct_2_to_1"]) == {"1": want["1"]}


def test_cached_prefix_prefill_shards(results):
    assert results["cached_tp4_hits"] == 16
    assert tokens(results["cached_tp4"]) == {"2": tokens(results["greedy_tp1"])["2"]}


def test_bfloat16_shards(results):
    assert results["bf16_tp2_dtypes"] == ["bfloat16", "bfloat16"]
    # bfloat16 at tp 2 sums the o projection's partial products in another order than tp 1: a
    # greedy near-tie may flip late (seen on the pool's step: row 2's 15th of 17 tokens); float32 is
    # held exact at every tp above. The first 12 tokens of every row agree.
    got, want = tokens(results["bf16_tp2"]), tokens(results["bf16_tp1"])
    assert got.keys() == want.keys() and all(got[k][:12] == want[k][:12] for k in want), (got, want)


def test_bad_tp_says_what_to_do(results):
    assert "num_kv_heads=4" in results["error_tp3"] and "[1, 2, 4]" in results["error_tp3"]


def test_tp_checked_before_loading_and_default_unsharded():
    from tandem_engine import load_engine

    with pytest.raises(ValueError, match="num_kv_heads=2"):
        load_engine("tiny", tp=4)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        load_engine("tiny", tp=-1)
    assert load_engine("tiny", tp=0, slots=1, max_len=32, prefill_buckets=(16,)).tp == 1  # 0: all devices
    with pytest.raises(ValueError, match="needs 2 devices .*xla_force_host_platform_device_count=2"):
        load_engine("tiny", tp=2)  # this process has one CPU device
    e = load_engine("tiny", slots=1, max_len=32, prefill_buckets=(16,))
    assert e.tp == 1 and e.mesh is None and e.layout is None


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1])))
