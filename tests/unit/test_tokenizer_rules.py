"""Prompts are tokenized by the tokenizer's own rules, the way transformers does it: a completion
prompt as `tokenizer(text)` (the tokenizer.json post-processor decides about BOS), a chat
template's text without added specials (`apply_chat_template(tokenize=True)`), the default
template like a completion. Checked against transformers with a tokenizer whose post-processor
adds BOS (the built-in model's) and one that adds none; the built-in model's ids are pinned to
what they were before the change. Also: token_bytes and skip_special_tokens."""
from __future__ import annotations

import json
import shutil

import pytest

from gateway.chat import ChatTemplate
from gateway.settings import GatewaySettings
from gateway.validation import CompletionParams, build_request
from tandem_core.models import BUILTIN_DIR, resolve_model
from tandem_core.tokenizer import ByteTokenizer, Detokenizer, HFTokenizer, load_tokenizer

COMPLETION = 'def fibonacci(n):\n    """Return'
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
# The built-in model's ids before tokenization followed the tokenizer's rules (BOS prepended by
# the gateway, then the text without specials): they must not change.
PINNED_COMPLETION = [0, 316, 286, 1312, 269, 1158, 1064, 9, 79, 301, 273, 365, 689]
PINNED_CHAT = [0, 29, 93, 1508, 1161, 93, 31, 200, 58, 1028, 1249, 948, 15, 200, 29, 93, 1497, 93, 31, 200, 316,
               740, 9, 66, 13, 305, 301, 200, 29, 93, 66, 319, 471, 829, 93, 31, 200]
TEXTS = ["hello world", COMPLETION, "  leading spaces ✓ é\n\ttabs", "<s>already a BOS", ""]
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
PLAIN_TEMPLATE = BOS_TEMPLATE.replace("{{ bos_token }}", "")


def test_builtin_model_ids_are_unchanged():
    info = resolve_model("builtin")
    tok, tmpl = load_tokenizer(info), ChatTemplate.for_model(info)
    s = GatewaySettings(max_context_len=512, max_prompt_len=512)
    done = build_request(CompletionParams(prompt=COMPLETION, max_tokens=4), s, info, tok)
    assert done.request.prompt_ids == PINNED_COMPLETION
    chat = CompletionParams(prompt=tmpl.render(CHAT), add_special_tokens=tmpl.add_special_tokens,
                            max_tokens_to_context=True)
    prep = build_request(chat, s, info, tok)
    assert prep.request.prompt_ids == PINNED_CHAT
    assert prep.request.max_tokens == min(s.max_tokens_limit, 512 - len(PINNED_CHAT))  # chat: to the context end


def _without_post_processor(tmp_path):
    """The built-in tokenizer with no TemplateProcessing: it adds no BOS to anything."""
    spec = json.loads((BUILTIN_DIR / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    for name in ("config.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUILTIN_DIR / name, tmp_path / name)
    return tmp_path


@pytest.fixture(params=["adds-bos", "adds-none"])
def tokenizers_pair(request, tmp_path):
    """(ours, transformers') for the same tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    path = BUILTIN_DIR if request.param == "adds-bos" else _without_post_processor(tmp_path)
    info = resolve_model(str(path))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>",
                                                eos_token="</s>")
    return request.param, load_tokenizer(info), ref


def _ids(out) -> list[int]:
    """apply_chat_template(tokenize=True) returns ids, or a BatchEncoding in newer versions."""
    if hasattr(out, "keys") and "input_ids" in out.keys():
        out = out["input_ids"]
    return list(out)


def test_completion_prompts_encode_like_transformers(tokenizers_pair):
    kind, ours, ref = tokenizers_pair
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], (kind, text)
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
    first = ours.encode("hello")[0]
    assert (first == 0) == (kind == "adds-bos")  # config.json's bos_token_id is 0 either way: not prepended


@pytest.mark.parametrize("source", [BOS_TEMPLATE, PLAIN_TEMPLATE], ids=["writes-bos", "writes-none"])
def test_chat_templates_encode_like_apply_chat_template(tokenizers_pair, source):
    pytest.importorskip("jinja2")
    kind, ours, ref = tokenizers_pair
    tmpl = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}]
    got = ours.encode(tmpl.render(msgs), add_special_tokens=tmpl.add_special_tokens)
    want = _ids(ref.apply_chat_template(msgs, chat_template=source, tokenize=True, add_generation_prompt=True))
    assert got == want, kind
    assert got.count(0) == (1 if source == BOS_TEMPLATE else 0)  # a template's own BOS, never a second


def test_default_template_is_encoded_like_a_completion(tokenizers_pair):
    kind, ours, _ = tokenizers_pair
    tmpl = ChatTemplate()
    text = tmpl.render(CHAT)
    assert ours.encode(text, add_special_tokens=tmpl.add_special_tokens) == ours.encode(text)


def test_token_bytes_byte_level_and_bytes():
    tok = load_tokenizer(resolve_model("builtin"))
    text = 'def f():\n    return "✓ é"  # ünïcode'
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(0) == b"<s>" and tok.token_bytes(10**6) == b"" and tok.token_bytes(-1) == b""
    assert tok.token_bytes.cache_info().maxsize is not None  # bounded
    b = ByteTokenizer()
    assert b.token_bytes(0xC3) == b"\xc3" and b.token_bytes(256) == b"" and b.token_bytes(257) == b""
    assert b.encode("hi") == [256, 104, 105] and b.encode("hi", add_special_tokens=False) == [104, 105]


def test_token_bytes_sentencepiece_style(tmp_path):
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "\u2581hello": 1, "<0x0A>": 2, "world": 3}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    t.decoder = decoders.Metaspace()
    t.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path, None, ())
    assert [tok.token_bytes(i) for i in range(4)] == [b"<unk>", b" hello", b"\n", b"world"]


def test_skip_special_tokens():
    tok = load_tokenizer(resolve_model("builtin"))
    ids = [0, *tok.encode("x = 1", add_special_tokens=False), 1]
    assert tok.decode(ids) == "x = 1" and tok.decode(ids, skip_special_tokens=False) == "<s>x = 1</s>"
    for skip, want in ((True, "x = 1"), (False, "<s>x = 1</s>")):
        d = Detokenizer(tok, skip_special_tokens=skip)
        assert "".join(d.feed(i) for i in ids) + d.flush() == want


def _byte_fallback_tokenizer(path) -> HFTokenizer:
    """A sentencepiece-style tokenizer with byte fallback (<0xNN> for every byte), as Llama's."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581", "e", "\u2581hel", "lo"):
        vocab[piece] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.save(str(path / "tokenizer.json"))
    return HFTokenizer(path, 1, (2,))


def test_detokenizer_survives_a_stray_byte_after_emitted_text(tmp_path):
    """Why the gateway keeps its own Detokenizer rather than tokenizers' DecodeStream (measured in
    issue 32: identical steps on well-formed text, ~3x faster per token): a sampled ASCII byte token
    followed by a stray UTF-8 lead byte changes how the whole byte run decodes, and DecodeStream
    raises ("Invalid prefix encountered") where this one keeps streaming; and it has no flush for
    the bytes still held at the end."""
    from tokenizers.decoders import DecodeStream

    tok = _byte_fallback_tokenizer(tmp_path)
    v = tok._tok.get_vocab()
    ids = [v["<0x37>"], v["<0xDE>"], v["e"]]  # "7", a lone lead byte, "e"
    d = Detokenizer(tok)
    assert [d.feed(i) for i in ids] == ["7", "", "\ufffde"] and d.flush() == ""
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):  # tokenizers raises a bare Exception
        for i in ids:
            stream.step(tok._tok, i)
    d = Detokenizer(tok)  # the bytes still held at the end: flushed as U+FFFD, not dropped
    assert [d.feed(i) for i in (v["\u2581hel"], v["<0xE6>"], v["<0x97>"])] == ["hel", "", ""]
    assert d.flush() == "\ufffd\ufffd"
