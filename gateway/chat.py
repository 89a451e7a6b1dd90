"""Chat messages -> one prompt string, the way the model was trained to read a conversation.

If the model directory's `tokenizer_config.json` has a `chat_template`, it is rendered with
Jinja2 in a sandbox (as Hugging Face `apply_chat_template` does: `messages`,
`add_generation_prompt=True`, `bos_token`, `eos_token`, `raise_exception`). Otherwise, or when
Jinja2 is not installed, the documented default template is used:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

i.e. every message as `<|{role}|>` on a line of its own followed by its content and a newline,
then `<|assistant|>\\n` for the reply. With tools (issue 13) the first system block (one is
added if the conversation has none) ends with a `# Tools` section listing the functions as JSON
and asking for Hermes-style calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(`tools.tools_block`); an assistant message's `tool_calls` are written in that same format after
its content, and a tool result is a `<|tool|>` block. A model's own template gets `tools=` and
the messages with `tool_calls` (arguments as objects) and `tool_call_id`, as Hugging Face
templates expect.

Special tokens follow the tokenizer's own rules, as transformers and vLLM do: a model's template
writes whatever specials it wants (`{{ bos_token }}` ...) and its text is encoded with
`add_special_tokens=False`, so a template that writes BOS gets exactly one. The default template
writes none, so its text is encoded like a completion prompt (`add_special_tokens=True`: the
tokenizer's post-processor adds BOS if it adds one to any text), which is how the built-in model
was trained. `ChatTemplate.add_special_tokens` says which. Pure: no I/O after construction.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from gateway.tools import format_call, tools_block
from tandem_core.errors import InvalidRequest
from tandem_core.models import ModelInfo

log = logging.getLogger(__name__)


def default_template(messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
    msgs = list(messages)
    if tools:
        block = tools_block(tools)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{block}" if msgs[0]["content"] else block}
        else:
            msgs.insert(0, {"role": "system", "content": block})
    return "".join(f"<|{m['role']}|>\n{_with_calls(m)}\n" for m in msgs) + "<|assistant|>\n"


def _with_calls(m: dict[str, Any]) -> str:
    calls = [format_call(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
    return "\n".join([m["content"], *calls] if m["content"] else calls)


def _token_text(tok: Any) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content") or "")
    return tok if isinstance(tok, str) else ""


def _pick_template(raw: Any) -> str | None:
    if isinstance(raw, str):
        return raw or None
    if isinstance(raw, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default") or next((t for t in named.values() if t), None)
    return None


class ChatTemplate:
    """`render(messages) -> prompt`; built once per service from the model directory."""

    def __init__(self, source: str | None = None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._compiled = _compile(source) if source else None
        self.kind = "model" if self._compiled is not None else "default"
        # How the rendered text is encoded: a model template writes its own specials.
        self.add_special_tokens = self._compiled is None

    @classmethod
    def for_model(cls, info: ModelInfo) -> "ChatTemplate":
        cfg_file = Path(info.path) / "tokenizer_config.json" if info.path else None
        if cfg_file is None or not cfg_file.is_file():
            return cls()
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            log.warning("cannot read %s (%s); using the default chat template", cfg_file, e)
            return cls()
        return cls(_pick_template(cfg.get("chat_template")), _token_text(cfg.get("bos_token")),
                   _token_text(cfg.get("eos_token")))

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
        if self._compiled is None:
            return default_template(messages, tools)
        extra = {"tools": tools} if tools else {}
        try:
            text = self._compiled.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                eos_token=self.eos_token, **extra,
            )
        except Exception as e:  # noqa: BLE001 - the template's own raise_exception, or a type error on odd input
            raise InvalidRequest(f"the model's chat template rejected the messages: {e}", param="messages") from e
        return text


class _TemplateError(Exception):
    pass


def _compile(source: str):
    """The compiled template, or None (logged) if Jinja2 is missing or the template is broken."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        log.warning("the model has a chat_template but jinja2 is not installed; using the default template")
        return None

    def raise_exception(message: str) -> None:
        raise _TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(source)
    except TemplateError as e:
        log.warning("the model's chat_template does not compile (%s); using the default template", e)
        return None
