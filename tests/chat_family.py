"""Model directories for the chat-family tests (issue 28): the built-in model's config and
tokenizer, with a family's chat template (tests/fixtures/chat_templates) and that family's
markers added to the tokenizer the way the real checkpoints have them: Mistral's `[TOOL_CALLS]`,
`[ARGS]`, `[CALL_ID]` and gpt-oss's `<|channel|>`, `<|message|>` ... as special tokens (decoding
drops them unless told to keep them), Qwen's `<tool_call>`, `<think>` ... as added tokens that are
not special (they stay in the text). The engine side of these families is not needed: the
gateway reads only the tokenizer, the template and config.json."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tandem_core.models import BUILTIN_DIR

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SPECIAL = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
           "<|constrain|>", "<|call|>", "<|return|>", "<|im_start|>", "<|im_end|>", "<start_of_turn>",
           "<end_of_turn>"]
PLAIN = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]


def family_dir(tmp: Path, family: str, model_type: str | None = None) -> Path:
    """A model directory serving `family`'s template (tests/fixtures/chat_templates/<family>.jinja).
    config.json keeps the built-in model's Llama model_type unless `model_type` is given."""
    from tokenizers import AddedToken, Tokenizer

    d = tmp / family
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(BUILTIN_DIR / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN])
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((BUILTIN_DIR / "config.json").read_text())
    cfg["vocab_size"] = tok.get_vocab_size()
    if model_type:
        cfg["model_type"] = model_type
    (d / "config.json").write_text(json.dumps(cfg))
    tcfg = json.loads((BUILTIN_DIR / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = (TEMPLATES / f"{family}.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    if (BUILTIN_DIR / "special_tokens_map.json").is_file():
        shutil.copy(BUILTIN_DIR / "special_tokens_map.json", d / "special_tokens_map.json")
    return d
