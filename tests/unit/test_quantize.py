"""int8 weights (`quantize="int8"`, tandem_engine/quantize.py): the quantizer's error bound, every
served family serving through int8 weights within a stated logit bound of its float weights, the
option reaching the engine from settings and `tandem local`, several chips, and the quality bench.

The families' checkpoints are written by transformers' own classes (tests/families.py: random
weights, flat logits), so the bound is on logits (a fraction of each position's logit range), not
on greedy agreement with the float engine (a near-tie flips on a small error); the int8 engine's
own greedy tokens are checked against the int8 model's reference forward (full recompute).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

from tandem_core.types import SamplingParams
from tandem_engine import config_from_info, load_engine, reference_forward
from tandem_engine.model import prefill_logits_all
from tandem_engine.reference import reference_greedy
from tandem_engine.quantize import QUANTIZED, dequantize, quantize_int8, quantize_params, weight_bytes

pytestmark = pytest.mark.slow  # make test-unit leaves it out (make test runs it): an int8 engine and its float twin for each of 10 families

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams()
# int8 vs float logits, as a fraction of the position's logit range (max - min over the vocab).
# Measured (bench/quantize_quality.py, float32): 0.3% for the built-in trained model, 1.5-4.3% over
# the dense families' random checkpoints. A mixture of experts moves further (31-37%): a slightly
# different hidden state flips a near-tied router choice (random routers: top-k gaps down to 0.02
# logits; quantizing only qwen3_moe's attention gives 24%, only its experts 1%; bfloat16 instead
# of float32, no int8, moves them as far). The int8 path
# itself is held tightly by EXACT: against the float model running the dequantized weights.
BOUND = {"dense": 0.08, "moe": 0.6}
EXACT = 1e-4
NEW_TOKENS = 12


# ---------------------------------------------------------------------------------------------
# the quantizer


@pytest.mark.parametrize("shape", [(3, 48, 80), (2, 4, 40, 24), (40, 24)])  # [L, in, out], experts, one matrix
def test_round_trip_error_is_at_most_half_a_step_per_element(shape):
    rng = np.random.default_rng(0)
    # columns of very different magnitudes: one scale per column keeps each column's own error small
    w = rng.normal(size=shape).astype(np.float32) * np.geomspace(1e-3, 10.0, shape[-1]).astype(np.float32)
    q, scale = quantize_int8(jnp.asarray(w))
    assert q.dtype == jnp.int8 and q.shape == w.shape
    assert scale.dtype == jnp.float32 and scale.shape == (*shape[:-2], shape[-1])  # per output channel
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) <= 127
    err = np.abs(np.asarray(dequantize(q, scale)) - w)
    bound = np.asarray(scale)[..., None, :] / 2
    assert (err <= bound * (1 + 1e-5) + 1e-12).all(), float((err / bound).max())
    # the largest element of each column is hit exactly (|q| = 127 there)
    assert np.allclose(np.abs(np.asarray(q, np.int32)).max(axis=-2), 127)


def test_an_all_zero_column_stays_zero():
    w = np.ones((8, 4), np.float32)
    w[:, 2] = 0
    q, scale = quantize_int8(jnp.asarray(w))
    assert np.isfinite(np.asarray(scale)).all()
    assert (np.asarray(dequantize(q, scale))[:, 2] == 0).all()


def test_quantize_params_takes_the_layer_matrices_only():
    from tandem_core.models import resolve_model
    from tandem_engine.weights import init_params

    params = init_params(resolve_model("tiny"))
    q = quantize_params(params, "int8")
    for name, w in q["layers"].items():
        base = name.removesuffix("_scale")
        if name in QUANTIZED:
            assert w.dtype == jnp.int8, name
        elif name != base:
            assert base in QUANTIZED and w.dtype == jnp.float32 and w.shape == (*w.shape[:1], q["layers"][base].shape[-1])
        else:
            assert w.dtype == params["layers"][name].dtype, name  # norms, biases: as they were
    assert q["embed"] is params["embed"] and q["lm_head"] is params["lm_head"]
    assert quantize_params(q, "int8") is q  # idempotent
    assert quantize_params(params, None) is params
    with pytest.raises(ValueError, match="int8"):
        quantize_params(params, "int4")


# ---------------------------------------------------------------------------------------------
# every family through the engine


def _greedy(engine, prompts):
    state = engine.init_state()
    out = {}
    for slot, ids in enumerate(prompts):
        prefix = engine.prefill(ids, GREEDY)
        state = engine.insert(prefix, state, slot, GREEDY)
        out[slot] = [prefix.first_token]
    for _ in range(NEW_TOKENS - 1):
        state, tokens = engine.generate(state)
        host = np.asarray(tokens)
        for slot in out:
            out[slot].append(int(host[slot]))
    return [out[s] for s in range(len(prompts))]


_logits_all = jax.jit(prefill_logits_all, static_argnames=("cfg",))


def _all_logits(params, ids, cfg, pad: int = 64):
    """Logits at every position of `ids` (one padded prefill, as the engine runs it)."""
    return np.asarray(_logits_all(params, jnp.zeros(pad, jnp.int32).at[: len(ids)].set(jnp.asarray(ids)), cfg=cfg))[
        : len(ids)]


def _range_error(ours, want) -> float:
    """max over positions of max |ours - want| / (max - min of want) at that position."""
    ours, want = np.atleast_2d(np.asarray(ours, np.float64)), np.atleast_2d(np.asarray(want, np.float64))
    return float((np.abs(ours - want).max(-1) / (want.max(-1) - want.min(-1))).max())


@pytest.fixture(scope="module", params=["tiny", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                        "mixtral", "qwen3_moe", "gpt_oss"])
def pair(request, tmp_path_factory):
    """(name, float engine, int8 engine on the same weights, prompts)."""
    name = request.param
    model = name
    if name != "tiny":
        pytest.importorskip("transformers")
        from tests.families import FAMILIES, build_family

        path = tmp_path_factory.mktemp(name)
        build_family(name, path, seed=FAMILIES.index(name))
        model = str(path)
    kw = dict(slots=2, max_len=64, prefill_buckets=(64,))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, n).tolist() for n in (11, 30)]
    return name, load_engine(model, **kw), load_engine(model, quantize="int8", **kw), prompts


def test_int8_engine_serves_within_the_bound_of_float(pair):
    name, fe, qe, prompts = pair
    assert qe.quantize == "int8" and fe.quantize is None
    layers = qe.params["layers"]
    assert all(layers[n].dtype == jnp.int8 for n in QUANTIZED if n in layers), name
    held = sum(int(fe.params["layers"][n].nbytes) for n in QUANTIZED if n in layers)
    assert weight_bytes(qe.params) <= weight_bytes(fe.params) - held * 0.7  # float32 -> int8 + scales
    cfg = config_from_info(qe.info)
    # the float model on exactly the weights the int8 ones stand for
    deq = {**fe.params, "layers": {**fe.params["layers"], **{
        n: dequantize(layers[n], layers[n + "_scale"]) for n in QUANTIZED if n in layers}}}
    bound = BOUND["moe" if cfg.moe else "dense"]
    tokens = _greedy(qe, prompts)
    for ids, out in zip(prompts, tokens):
        seq = ids + out  # prompt + the int8 engine's own tokens
        ours_last, ours_all = qe.prompt_logits(ids), _all_logits(qe.params, seq, cfg)
        # the int8 path computes what its weights stand for (the serving prefill, the last position
        # and every position of a prompt), and the reference forward agrees. A mixture runs both
        # expert paths here: the engine's (dense on a CPU) and, with `cfg` as config_from_info
        # gives it, the grouped matmuls (ragged_dot) chips run
        assert _range_error(ours_last, _all_logits(deq, ids, cfg)[-1]) < EXACT, name
        assert _range_error(ours_all, _all_logits(deq, seq, cfg)) < EXACT, name
        assert _range_error(reference_forward(qe.params, ids, cfg), _all_logits(deq, ids, cfg)) < EXACT, name
        # and stays within the stated bound of the unquantized weights
        rel_last = _range_error(ours_last, fe.prompt_logits(ids))
        rel_all = _range_error(ours_all, _all_logits(fe.params, seq, cfg))
        assert max(rel_last, rel_all) < bound, f"{name}: {rel_last:.3%}, {rel_all:.3%} (bound {bound:.0%})"
        # the int8 engine's prefill + decode steps give the int8 model's own greedy tokens
        assert out == reference_greedy(qe.params, cfg, ids, NEW_TOKENS, pad_to=64), name


# Two of the families: the KV's dtype does not depend on the family, and each other family would
# compile its float engine's prefill, insert and step for this test alone (~7 s each on 2 cores).
@pytest.mark.parametrize("pair", ["tiny", "qwen3_moe"], indirect=True)
def test_kv_crosses_between_int8_and_float_pods(pair):
    """Prefill and decode pods that disagree on `quantize` still move KV (it is in the KV dtype
    either way): an int8 prefill's KV decodes on a float engine and back. Nothing refuses it
    here; the chart refuses the mismatch, since the tokens then come from two sets of weights.
    A dense family and a mixture (its experts quantized too)."""
    name, fe, qe, prompts = pair
    for src, dst in ((qe, fe), (fe, qe)):
        payload = src.export_prefix(src.prefill(prompts[1], GREEDY))
        assert payload.k.dtype == np.float32
        state = dst.insert(dst.import_prefix(payload), dst.init_state(), 0, GREEDY)
        state, tokens = dst.generate(state)
        assert 0 <= int(np.asarray(tokens)[0]) < dst.info.vocab_size


def test_bfloat16_int8_runs_both_expert_paths(tmp_path):
    """bfloat16 with int8 experts: the engine's expert path (dense on a CPU) serves, and the
    grouped-matmul path chips run (ragged_dot) gives the same logits (XLA CPU refused the first
    version's bfloat16 x bfloat16 -> float32 expert einsum)."""
    pytest.importorskip("transformers")
    from tests.families import build_family

    build_family("mixtral", tmp_path, seed=5, dtype="bfloat16")
    fe = load_engine(str(tmp_path), dtype="bfloat16", slots=2, max_len=32, prefill_buckets=(16,))
    qe = load_engine(str(tmp_path), dtype="bfloat16", quantize="int8", slots=2, max_len=32, prefill_buckets=(16,))
    ids = list(range(40, 52))
    state = qe.insert(qe.prefill(ids, GREEDY), qe.init_state(), 0, GREEDY)
    for _ in range(3):
        state, tokens = qe.generate(state)
        assert 0 <= int(np.asarray(tokens)[0]) < qe.info.vocab_size
    ours = qe.prompt_logits(ids)
    ragged = np.asarray(reference_forward(qe.params, ids, config_from_info(qe.info)), np.float32)[-1]
    assert _range_error(ragged, ours) < 0.02  # two bfloat16 computations of the same int8 model
    assert _range_error(ours, fe.prompt_logits(ids)) < BOUND["moe"]


# ---------------------------------------------------------------------------------------------
# the option: settings, tandem local, a bad value


def test_settings_carry_quantize_to_the_engine(monkeypatch):
    from decode_svc.settings import DecodeSettings
    from prefill_svc.settings import PrefillSettings

    for cls, prefix in ((PrefillSettings, "TANDEM_PREFILL_"), (DecodeSettings, "TANDEM_DECODE_")):
        monkeypatch.setenv(f"{prefix}ENGINE__MODEL", "tiny")
        monkeypatch.setenv(f"{prefix}ENGINE__QUANTIZE", "int8")
        kwargs = cls().engine_kwargs(2)
        assert kwargs["quantize"] == "int8"
        monkeypatch.setenv(f"{prefix}ENGINE__QUANTIZE", "")
        assert cls().engine_kwargs(2)["quantize"] is None
        monkeypatch.setenv(f"{prefix}ENGINE__QUANTIZE", "int4")
        with pytest.raises(ValidationError, match="int8"):
            cls()
    kwargs.update(max_len=32, prefill_buckets=(16,), compile_cache_dir="")
    engine = load_engine(**kwargs)
    assert engine.quantize == "int8" and engine.params["layers"]["wq"].dtype == jnp.int8


def test_tandem_local_passes_quantize_to_both_roles():
    from tandem import local

    for argv, want in (([], ""), (["--quantize", "int8"], "int8")):
        c = local.Cluster(local._parse(["--max-len", "256", *argv]))
        for role in ("prefill", "decode"):
            pre = f"TANDEM_{role.upper()}_"
            assert c._engine_env(pre, role)[f"{pre}ENGINE__QUANTIZE"] == want
    with pytest.raises(SystemExit):
        local._parse(["--quantize", "int4"])


def test_an_unknown_mode_is_refused_before_loading():
    with pytest.raises(ValueError, match=r"quantize='int4' is not supported; use one of \['int8'\]"):
        load_engine("tiny", quantize="int4")


# ---------------------------------------------------------------------------------------------
# several chips: a weight and its scales split alike


def child() -> dict:
    from tandem_engine import load_engine

    out: dict = {"devices": len(jax.devices())}
    path = sys.argv[1]
    prompts = {0: list(range(30, 43)), 1: list(range(100, 140))}
    for tp, ep in ((1, False), (2, False), (4, False), (4, True)):
        e = load_engine(path, slots=2, max_len=64, prefill_buckets=(64,), tp=tp, expert_parallel=ep, quantize="int8")
        state, toks = e.init_state(), {}
        for slot, ids in prompts.items():
            prefix = e.prefill(ids, GREEDY)
            state = e.insert(prefix, state, slot, GREEDY)
            toks[slot] = [prefix.first_token]
        for _ in range(NEW_TOKENS - 1):
            state, t = e.generate(state)
            for slot in prompts:
                toks[slot].append(int(np.asarray(t)[slot]))
        layers = e.params["layers"]
        out[f"tp{tp}/ep{int(ep)}"] = {
            "tokens": [toks[0], toks[1]],
            "shards": {n: list(layers[n].addressable_shards[0].data.shape)
                       for n in ("wq", "wq_scale", "wo_scale", "we_gate", "we_gate_scale", "we_down_scale")},
        }
    return out


def test_int8_shards_with_its_scales(tmp_path):
    """qwen3_moe (dense attention + experts) at tp 1, 2, 4 and expert parallelism 4, all int8:
    the same tokens in every layout, and each scale cut where its weight's output columns are."""
    pytest.importorskip("transformers")
    from tests.families import build_family

    build_family("qwen3_moe", tmp_path, seed=3)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == 4
    for layout in ("tp2/ep0", "tp4/ep0", "tp4/ep1"):
        assert res[layout]["tokens"] == res["tp1/ep0"]["tokens"], layout
    # wq [L, d, H*hd] = [4, 64, 128]; experts [L, E, d, f] = [4, 8, 64, 48]; scales [L, out] / [L, E, out]
    assert res["tp4/ep0"]["shards"] == {"wq": [4, 64, 32], "wq_scale": [4, 32], "wo_scale": [4, 64],
                                        "we_gate": [4, 8, 64, 12], "we_gate_scale": [4, 8, 12],
                                        "we_down_scale": [4, 8, 64]}
    assert res["tp4/ep1"]["shards"]["we_gate_scale"] == [4, 2, 48]
    assert res["tp4/ep1"]["shards"]["we_down_scale"] == [4, 2, 64]


# ---------------------------------------------------------------------------------------------
# on a TPU (compiled ahead of time for a v5e chip here: tandem_engine/aot.py)


def test_tpu_steps_take_int8_weights_and_make_no_dequantized_copy():
    """The built-in model's decode step and prefill compiled for a TPU v5e chip, bfloat16 against
    int8: the weights the steps take shrink by what int8 saves, and no bfloat16 array of a
    quantized weight's [in, out] shape appears anywhere in the compiled decode step (the layer's
    int8 slice goes into the matmul fusion, which converts tile by tile: what decode reads from
    HBM is the int8)."""
    from tandem_engine.aot import libtpu_missing

    if libtpu_missing():
        pytest.skip(libtpu_missing())
    from tandem_core.models import resolve_model
    from tandem_engine import aot
    from tandem_engine.weights import init_params

    info = resolve_model("builtin")
    devices = aot.topology_devices("v5e", "2x2")
    kw = dict(tp=1, slots=8, max_len=256, prefill_buckets=(64,), dtype="bfloat16")
    steps = {}
    for q in (None, "int8"):
        comp = aot.Compiler(info, devices, quantize=q, **kw)
        steps[q] = comp.generate(8, layers=False), comp.prefill(64, layers=False)
    shapes = jax.eval_shape(lambda: init_params(info, "bfloat16"))["layers"]
    matrices = sum(int(np.prod(shapes[n].shape)) for n in QUANTIZED if n in shapes)  # elements
    scales = sum(int(np.prod(shapes[n].shape)) // shapes[n].shape[-2] for n in QUANTIZED if n in shapes)
    saved = 2 * matrices - (matrices + 4 * scales)  # bfloat16 -> int8 + float32 scales
    for (f_step, q_step) in zip(steps[None], steps["int8"]):
        assert abs((f_step.argument_bytes - q_step.argument_bytes) - saved) <= 4096, (f_step, q_step, saved)

    eng = aot.build_engine(info, devices, quantize="int8", **kw)
    lowered = aot.lower(eng.generate_call(aot.abstract_state(eng), 8), eng.layout.replicated())
    hlo = lowered.compile().as_text()
    for n in QUANTIZED:
        if n in shapes:
            d_in, d_out = shapes[n].shape[-2:]
            assert f"s8[{d_in},{d_out}]" in hlo, n  # the layer's slice, still int8
            assert f"bf16[{d_in},{d_out}]" not in hlo and f"bf16[{d_out},{d_in}]" not in hlo, n


# ---------------------------------------------------------------------------------------------
# the quality bench


def test_quality_bench_runs_and_writes_only_when_asked(capsys):
    from bench import quantize_quality
    from bench.common import RESULTS_MD

    before = RESULTS_MD.read_text() if RESULTS_MD.exists() else None
    assert quantize_quality.main(["--models", "tiny", "--dtypes", "float32", "--prompts", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "int8 weights: quality" in out and "| tiny " in out
    row = next(line for line in out.splitlines() if line.startswith("| tiny "))
    ratio = float(row.split("|")[4])
    assert 0.3 < ratio < 0.6  # float32 layers -> int8 + scales; the embedding and head stay
    assert (RESULTS_MD.read_text() if RESULTS_MD.exists() else None) == before


if __name__ == "__main__":
    print(json.dumps(child()))
