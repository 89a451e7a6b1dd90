"""Every served family, token-exact with transformers through the engine.

Each checkpoint is written here by transformers' own class (tests/families.py: random weights,
small, sliding windows of 8 positions, shorter than the prompts and outputs). Through the engine:
logits at every position (the reference forward) and at the last (the serving prefill) within
1e-4 of transformers'; greedy tokens equal to `generate` for two prompts decoded side by side in
one batch; the prefill over a cached prefix and a KV moved through host bytes (what a decode pod
pulls) decode to the same tokens. Checkpoints that ship quantized (FP8 with block scales, MXFP4)
load dequantized to exactly the weights transformers runs with.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the test-reference extra; present in the dev venv
transformers = pytest.importorskip("transformers")

from tandem_core.errors import ModelNotFound
from tandem_core.families import FAMILIES as SERVED
from tandem_core.families import MODEL_TYPES
from tandem_core.models import resolve_model
from tandem_core.types import SamplingParams
from tandem_engine import config_from_info, load_engine, reference_forward
from tandem_engine.prefix_pool import device_cache_for
from tests.families import FAMILIES, WINDOW, build_family, hf_greedy

pytestmark = pytest.mark.slow  # make test-unit leaves it out (make test runs it): every family's engine and its transformers model, 9 times

GREEDY = SamplingParams()
NEW_TOKENS = 20
REL_TOL = 1e-4
LENGTHS = (13, 40)  # both longer than the window; 40 + 20 crosses a 16-row prefix chunk too


def rel_err(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())




def decode(engine, prefixes: dict, steps: int = NEW_TOKENS - 1) -> dict[int, list[int]]:
    state = engine.init_state()
    out = {}
    for slot, prefix in prefixes.items():
        state = engine.insert(prefix, state, slot, GREEDY)
        out[slot] = [prefix.first_token]
    for _ in range(steps):
        state, tokens = engine.generate(state)
        host = np.asarray(tokens)
        for slot in prefixes:
            out[slot].append(int(host[slot]))
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, transformers model, our engine on the same directory, prompts)."""
    path = tmp_path_factory.mktemp(request.param)
    model = build_family(request.param, path, seed=FAMILIES.index(request.param))
    engine = load_engine(str(path), slots=3, max_len=128, prefill_buckets=(16, 64), prefix_chunk=16)
    rng = np.random.default_rng(len(request.param))
    prompts = [rng.integers(0, 256, n).tolist() for n in LENGTHS]
    return request.param, model, engine, prompts


def test_every_family_has_traits_and_a_checkpoint():
    assert set(MODEL_TYPES.values()) == set(SERVED) == set(FAMILIES)


def test_logits_match_at_every_position(family):
    name, model, engine, prompts = family
    cfg = config_from_info(engine.info)
    if name in ("mistral", "qwen2", "gemma2", "gemma3", "gpt_oss"):
        assert WINDOW in cfg.windows, "the checkpoint's windows were not read"
    for ids in prompts:
        with torch.no_grad():
            hf = model(torch.tensor([ids])).logits[0].numpy()
        last = rel_err(engine.prompt_logits(ids), hf[-1])
        full = rel_err(reference_forward(engine.params, ids, cfg), hf)
        assert last < REL_TOL and full < REL_TOL, f"{name} len {len(ids)}: last {last:.1e}, all {full:.1e}"


def test_greedy_tokens_match_transformers(family):
    name, model, engine, prompts = family
    ours = decode(engine, {slot: engine.prefill(ids, GREEDY) for slot, ids in enumerate(prompts)})
    for slot, ids in enumerate(prompts):
        assert ours[slot] == hf_greedy(model, ids, NEW_TOKENS), f"{name} prompt of {len(ids)} tokens"


def test_moved_kv_decodes_the_same(family):
    """A KV that went through host bytes (the decode pod's pull) gives transformers' tokens (a
    prompt over a cached prefix: `test_a_device_pool_hit_is_the_whole_prefill`)."""
    name, model, engine, prompts = family
    ids = prompts[1]
    moved = engine.import_prefix(engine.export_prefix(engine.prefill(ids, GREEDY)))
    assert decode(engine, {1: moved})[1] == hf_greedy(model, ids, NEW_TOKENS), f"{name}: KV moved through the host"


def test_a_device_pool_hit_is_the_whole_prefill(family):
    """A prefill pod's prefix pool (prefix_pool.py): a hit's rest runs through the ragged call's
    chunk attention over the pool (the cached blocks read in place, the chunk's own K/V dense)
    and gives the whole prefill's first tokens (greedy and seeded, with logprobs) and KV, and
    transformers' tokens after it. Windows of 8 positions are crossed by the cached block and by
    each chunk of 16; sinks (gpt_oss) and soft caps (gemma2) on the same path."""
    name, model, engine, prompts = family
    ids = prompts[1]  # 40 tokens
    cache = device_cache_for(engine, 16, 1 << 22)
    first = engine.prefill(ids[:17], GREEDY)
    assert cache.insert(ids[:17], lambda: (np.asarray(first.k), np.asarray(first.v))) == 1
    picks = [SamplingParams(logprobs=2), SamplingParams(temperature=1.0, seed=7, logprobs=2)]
    want = engine.prefill(ids, GREEDY, choices=picks)
    for cached in (16, 32):  # the rest in two chunks (16 + 8), then (its blocks kept by the first) one of 8
        hit = cache.lookup(ids)
        assert hit is not None and hit.length == cached, name
        got = engine.prefill(ids, GREEDY, choices=picks, cached=hit)
        assert got.first_tokens == want.first_tokens, f"{name}: {cached} cached"
        for g, w in zip(got.first_logprobs, want.first_logprobs):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4), f"{name}: {cached} cached"
        for ours, theirs in ((got.k, want.k), (got.v, want.v)):
            assert rel_err(np.asarray(ours)[:, :40], np.asarray(theirs)[:, :40]) < REL_TOL, f"{name}: {cached} cached"
        assert decode(engine, {0: got})[0] == hf_greedy(model, ids, NEW_TOKENS), f"{name}: {cached} cached"
    assert cache.stats.hit_copy_bytes == 0


def test_resume_from_streamed_tokens(family):
    """What a decode pod does when it takes over a request whose pod died: prefill the prompt
    plus the tokens already streamed, then go on from the next token index."""
    name, model, engine, prompts = family
    ids = prompts[1]
    want = hf_greedy(model, ids, NEW_TOKENS)
    m = 7
    prefix = engine.prefill(ids + want[:m], GREEDY, start_index=m, output_from=len(ids))
    got = decode(engine, {0: prefix}, steps=NEW_TOKENS - m - 1)[0]
    assert got == want[m:], f"{name}: resumed after {m} tokens"


def test_n_choices_and_logprobs(family):
    """n > 1 from one prefill, and logprobs: the greedy choice's logprob is the top alternative's,
    and equals transformers' log-softmax at the first position."""
    name, model, engine, prompts = family
    ids = prompts[0]
    picks = [SamplingParams(logprobs=2), SamplingParams(temperature=1.0, seed=3, logprobs=2)]
    prefix = engine.prefill(ids, GREEDY, choices=picks)
    assert len(prefix.first_tokens) == 2
    lp = prefix.first_logprobs[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
    assert prefix.first_tokens[0] == int(ref.argmax())
    assert lp.logprob == pytest.approx(float(ref.max()), abs=1e-4), name


# ---------------------------------------------------------------------------------------------
# quantized checkpoints, quantized here by the published formats' rules


def _fp8_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek/Qwen3 `*-FP8`: e4m3 weights, one float32 `weight_scale_inv` per block x block tile
    (amax / 448), dequantized as w8 * scale_inv."""
    out_dim, in_dim = w.shape
    tiles = w.reshape(out_dim // block, block, in_dim // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    q = (tiles / scale[:, None, :, None]).reshape(out_dim, in_dim).to(torch.float8_e4m3fn)
    return q, scale.float()


def _mxfp4_quantize(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """OCP MXFP4 as gpt-oss ships it: w [..., R, C] -> blocks uint8 [..., R, C/32, 16] (two e2m1
    codes a byte, low nibble first) and e8m0 scales uint8 [..., R, C/32] (2 ** (s - 127))."""
    values = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    x = w.detach().float().numpy()
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = np.abs(groups).max(axis=-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.exp2(exp)[..., None]
    code = np.abs(np.abs(scaled)[..., None] - values).argmin(axis=-1).astype(np.uint8)
    code |= (scaled < 0).astype(np.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exp + 127, np.uint8)


def _mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    return convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)


def test_fp8_block_scaled_checkpoint(tmp_path):
    """A Qwen3 checkpoint in the `*-FP8` layout serves the tokens of its dequantized weights."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    model = build_family("qwen3", src, seed=11)
    tensors = load_file(str(src / "model.safetensors"))
    block = 16
    for name in list(tensors):
        if name.endswith("_proj.weight"):
            q, scale = _fp8_quantize(tensors[name], block)
            tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = q, scale
            dequant = (q.float().reshape(q.shape[0] // block, block, q.shape[1] // block, block)
                       * scale[:, None, :, None]).reshape(q.shape)
            model.get_parameter(name).data.copy_(dequant)
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(cfg))
    engine = load_engine(str(out), slots=1, max_len=64, prefill_buckets=(16,))
    ids = list(range(40, 52))
    assert decode(engine, {0: engine.prefill(ids, GREEDY)})[0] == hf_greedy(model, ids, NEW_TOKENS)


def test_mxfp4_experts_checkpoint(tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts (`*_blocks`, `*_scales`) serves the tokens of its
    dequantized weights."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    model = build_family("gpt_oss", src, seed=12)
    tensors = load_file(str(src / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = tensors.pop(name)  # [E, in, out] -> quantized along `in`, stored [E, out, in/32, 16]
            blocks, scales = _mxfp4_quantize(w.transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            model.get_parameter(name).data.copy_(_mxfp4_dequantize(blocks, scales))
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(cfg))
    engine = load_engine(str(out), slots=1, max_len=64, prefill_buckets=(16,))
    ids = list(range(60, 75))
    assert decode(engine, {0: engine.prefill(ids, GREEDY)})[0] == hf_greedy(model, ids, NEW_TOKENS)


# ---------------------------------------------------------------------------------------------
# what is refused at start, naming it


def _write_config(path, **over):
    cfg = {"architectures": ["X"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 128, **over}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_unknown_family_is_refused_naming_the_served_ones(tmp_path):
    with pytest.raises(ModelNotFound, match="'deepseek_v3'.*served: gemma2"):
        resolve_model(str(_write_config(tmp_path / "m", model_type="deepseek_v3")))


def test_unsupported_quantization_is_refused_naming_it(tmp_path):
    path = tmp_path / "awq"
    build_family("llama", path, seed=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelNotFound, match="quantization 'awq' is not supported"):
        load_engine(str(path), slots=1, max_len=32, prefill_buckets=(16,))


def test_moe_with_dense_layers_between_is_refused(tmp_path):
    path = _write_config(tmp_path / "moe", model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, mlp_only_layers=[1])
    with pytest.raises(ModelNotFound, match="mlp_only_layers"):
        config_from_info(resolve_model(str(path)))


def test_eos_ids_merge_generation_config(tmp_path):
    """A chat checkpoint's end-of-turn ids in generation_config.json stop generation too."""
    path = _write_config(tmp_path / "chat", eos_token_id=2)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert resolve_model(str(path)).eos_token_ids == (2, 7, 9)
    (path / "generation_config.json").unlink()
    assert resolve_model(str(path)).eos_token_ids == (2,)


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 3's published checkpoints are `Gemma3ForConditionalGeneration`: config.json nests the
    language model under `text_config` and its tensors sit under `language_model.model.` beside a
    vision tower. The engine serves the language model and leaves the vision tower unread."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "text"
    model = build_family("gemma3", src, seed=13)
    tensors = load_file(str(src / "model.safetensors"))
    wrapped = {k.replace("model.", "language_model.model.", 1): v for k, v in tensors.items()}
    wrapped["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    out = tmp_path / "mm"
    out.mkdir()
    save_file(wrapped, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": text["eos_token_id"]}))
    engine = load_engine(str(out), slots=1, max_len=64, prefill_buckets=(32,))
    ids = list(range(5, 25))
    assert decode(engine, {0: engine.prefill(ids, GREEDY)})[0] == hf_greedy(model, ids, NEW_TOKENS)
