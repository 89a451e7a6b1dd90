"""Parity with Hugging Face transformers: the engine loads a real HF Llama directory and gives the
same float32 logits and the same greedy tokens as `LlamaForCausalLM`.

Each checkpoint is built here: a `tokenizers` byte-level BPE trained on Python stdlib sources, and
a `LlamaForCausalLM` with seeded random weights (std 1/sqrt(fan_in), so attention is far from
uniform and RoPE matters), saved with `save_pretrained(safe_serialization=True)`. Nothing is
downloaded. Two shapes: grouped-query attention with an untied LM head, and multi-head attention
with tied embeddings and rope_theta 500000 (which transformers 5 writes as `rope_parameters`).

Relative error = max |ours - hf| / max |hf| over the compared logits.
"""
from __future__ import annotations

import functools
import inspect
import json
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the test-reference extra; present in the dev venv
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tandem_core.types import SamplingParams
from tandem_engine import config_from_info, load_engine, reference_forward

pytestmark = pytest.mark.slow  # make test-unit leaves it out (make test runs it): transformers models and an engine for each shape

NEW_TOKENS = 32
REL_TOL = 1e-4
SHAPES = {
    "gqa_untied": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                       rope_theta=10000.0),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                     rope_theta=500000.0),
}
PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    textwrap.dedent(inspect.getsource(functools.wraps)),
]


def train_tokenizer(vocab_size: int = 512):
    """Byte-level BPE trained on stdlib sources at hand (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [open(inspect.getsourcefile(m), encoding="utf-8").read()
             for m in (json.decoder, textwrap, inspect)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def build_hf_model(tok, shape: dict, seed: int):
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"), **shape,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:  # [out, in] (or [vocab, d]): O(1) activations and logits
                p.copy_(torch.randn(p.shape) / p.shape[1] ** 0.5)
            else:  # norm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
    return model


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    """(HF model, our engine loaded from the same directory, prompt ids)."""
    tok = train_tokenizer()
    model = build_hf_model(tok, SHAPES[request.param], seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    engine = load_engine(str(path), slots=3, max_len=128, prefill_buckets=(16, 64))
    prompts = [tok.encode(p).ids[:48] for p in PROMPTS]  # 48 + 32 new tokens fit max_len
    return request.param, model, engine, prompts


def rel_err(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def test_checkpoint_read_as_written(pair):
    name, model, engine, prompts = pair
    c = model.config
    assert engine.info.tokenizer == "hf"
    assert engine.info.rope_theta == SHAPES[name]["rope_theta"]
    assert engine.info.num_kv_heads == c.num_key_value_heads
    assert ("lm_head" in engine.params) is not c.tie_word_embeddings
    assert 3 < len(prompts[0]) <= 16 < len(prompts[1]) <= 64  # one prompt per bucket


def test_prefill_logits_match(pair, record_property):
    name, model, engine, prompts = pair
    cfg = config_from_info(engine.info)
    for ids in prompts:
        with torch.no_grad():
            hf = model(torch.tensor([ids])).logits[0].numpy()  # [T, vocab]
        last = rel_err(engine.prompt_logits(ids), hf[-1])  # the serving prefill path
        full = rel_err(reference_forward(engine.params, ids, cfg), hf)  # every position
        record_property(f"{name}_len{len(ids)}", {"last": last, "all_positions": full})
        print(f"{name} len={len(ids)} rel err: prefill last {last:.2e}, all positions {full:.2e}")
        assert last < REL_TOL and full < REL_TOL


def test_greedy_tokens_match(pair):
    name, model, engine, prompts = pair
    greedy = SamplingParams()
    state = engine.init_state()
    ours = {}
    for slot, ids in enumerate(prompts):  # both prompts decode side by side in one batch
        prefix = engine.prefill(ids, greedy)
        state = engine.insert(prefix, state, slot, greedy)
        ours[slot] = [prefix.first_token]
    for _ in range(NEW_TOKENS - 1):
        state, tokens = engine.generate(state)
        host = np.asarray(tokens)
        for slot in ours:
            ours[slot].append(int(host[slot]))
    model.generation_config.eos_token_id = None  # always 32 tokens, as ours
    for slot, ids in enumerate(prompts):
        with torch.no_grad():
            mask = torch.ones(1, len(ids), dtype=torch.long)
            out = model.generate(torch.tensor([ids]), attention_mask=mask, do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=0)
        hf = out[0, len(ids):].tolist()
        assert len(hf) == NEW_TOKENS
        assert ours[slot] == hf, f"{name} prompt {slot}"
