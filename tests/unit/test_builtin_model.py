"""The shipped built-in checkpoint (tandem_core/assets/tandem-tiny-py, made by
tools/train_builtin.py): it is what "builtin" resolves to, it is small, its tokenizer round-trips
any text, it has learned Python (a random model fails these), and transformers loads it and
generates the same greedy tokens as the engine."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tandem_core.models import BUILTIN_DIR, resolve_model
from tandem_core.tokenizer import Detokenizer, load_tokenizer
from tandem_core.types import SamplingParams
from tandem_engine import config_from_info, load_engine, reference_forward

MAX_BYTES = 25 * 10**6
PYTHON_MARKERS = ("def ", "return", "self", "import", "(", "):\n", " = ")
SNIPPET = '''import os


class Config:
    def __init__(self, path, name=None):
        self.path = path
        self.name = name

    def exists(self):
        return os.path.exists(self.path)
'''


@pytest.fixture(scope="module")
def info():
    return resolve_model("builtin")


@pytest.fixture(scope="module")
def engine():
    return load_engine("builtin", slots=1, max_len=128, prefill_buckets=(16, 32, 64))


def greedy(engine, ids: list[int], n: int) -> list[int]:
    prefix = engine.prefill(ids, SamplingParams())
    state = engine.insert(prefix, engine.init_state(), 0, SamplingParams())
    out = [prefix.first_token]
    for _ in range(n - 1):
        state, toks = engine.generate(state)
        out.append(int(np.asarray(toks)[0]))
    return out


def test_builtin_resolves_to_the_shipped_directory(info):
    assert info.path == str(BUILTIN_DIR) and info.tokenizer == "hf"
    assert resolve_model("") == info
    assert info.bos_token_id is not None and info.eos_token_ids
    assert resolve_model("tiny").tokenizer == "byte" and resolve_model("tiny").path is None
    assert resolve_model("small-100m").path is None


def test_checkpoint_files_and_size():
    names = {p.name for p in BUILTIN_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert sum(p.stat().st_size for p in BUILTIN_DIR.iterdir()) <= MAX_BYTES
    cfg = json.loads((BUILTIN_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["rope_theta"] == 10000.0 and cfg["torch_dtype"] == "float32"
    tok_cfg = json.loads((BUILTIN_DIR / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["bos_token"] and tok_cfg["eos_token"]


@pytest.mark.parametrize("text", [SNIPPET, "naïve → 日本 🐍\ttabs  and   spaces\r\n", ""])
def test_tokenizer_round_trips(info, text):
    tok = load_tokenizer(info)
    ids = tok.encode(text)
    assert ids[0] == info.bos_token_id
    assert tok.decode(ids) == text
    detok = Detokenizer(tok)
    assert "".join(detok.feed(i) for i in ids) + detok.flush() == text


def test_model_has_learned_python(info, engine):
    """Per-token loss on unseen Python far below a random model's ~log(vocab)."""
    tok = load_tokenizer(info)
    ids = np.asarray(tok.encode(SNIPPET), np.int32)
    logits = np.asarray(reference_forward(engine.params, ids, config_from_info(info)))
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -logp[np.arange(len(ids) - 1), ids[1:]].mean()
    assert nll < 0.6 * math.log(info.vocab_size), f"loss {nll:.2f} on a Python snippet"


def test_greedy_continuation_is_python(info, engine):
    tok = load_tokenizer(info)
    text = tok.decode(greedy(engine, tok.encode("def "), 40))
    found = [m for m in PYTHON_MARKERS if m in text]
    assert len(found) >= 2, f"no Python in {text!r}"


def test_transformers_loads_it_and_agrees_with_the_engine(info, engine):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(BUILTIN_DIR))
    model = transformers.LlamaForCausalLM.from_pretrained(str(BUILTIN_DIR), dtype=torch.float32)
    prompt = "def "
    ids = hf_tok(prompt)["input_ids"]  # the post-processor adds BOS, as our tokenizer does
    assert ids == load_tokenizer(info).encode(prompt)
    n = 24
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n)
    assert out[0, len(ids):].tolist() == greedy(engine, ids, n)
    assert hf_tok.decode(out[0], skip_special_tokens=True).startswith(prompt)
