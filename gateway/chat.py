"""Chat messages -> one prompt string, the way the model was trained to read a conversation.

The model's own template is used as it is: `chat_template.jinja` beside the tokenizer (what
transformers >= 4.43 writes), else `tokenizer_config.json`'s `chat_template` (a string, or the
named list whose "default" is taken). It is rendered with Jinja2 in the sandbox Hugging Face
`apply_chat_template` uses, with the same extras, so every Hub template renders as it does there:
the `loopcontrols` extension, the `{% generation %}` block, a `tojson` that does not escape HTML
and takes `indent`/`separators`/`sort_keys`, `raise_exception`, `strftime_now`; the variables
`messages`, `tools`, `add_generation_prompt=True`, the tokenizer's special tokens (`bos_token`,
`eos_token`, `pad_token`, `unk_token`), and a request's `chat_template_kwargs` (vLLM's extra:
`enable_thinking` for Qwen3, `reasoning_effort` for gpt-oss ...). An assistant message's earlier
thinking is passed as `reasoning_content` and `thinking` (the names Qwen3's and gpt-oss's
templates read). A template that raises (Gemma's has no system role; most insist that roles
alternate) is a 400 naming its message. Otherwise, or when Jinja2 is not installed, the
documented default template is used:

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


# What a request's chat_template_kwargs may not set: the render's own arguments.
RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "chat_template",
                             "continue_final_message", "tokenize"})
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
TEMPLATE_FILE = "chat_template.jinja"


def read_template(path: str | Path | None) -> tuple[str | None, dict[str, str]]:
    """(the model directory's chat template or None, its special tokens' text)."""
    if path is None:
        return None, {}
    d = Path(path)
    cfg: dict = {}
    cfg_file = d / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            log.warning("cannot read %s (%s); using the default chat template", cfg_file, e)
            return None, {}
    tokens = {k: _token_text(cfg.get(k)) for k in SPECIAL_TOKENS}
    source = (d / TEMPLATE_FILE).read_text() if (d / TEMPLATE_FILE).is_file() else _pick_template(
        cfg.get("chat_template"))
    return source, tokens


class ChatTemplate:
    """`render(messages) -> prompt`; built once per service from the model directory."""

    def __init__(self, source: str | None = None, bos_token: str = "", eos_token: str = "",
                 **special_tokens: str) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.tokens = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": "", "unk_token": "",
                       **special_tokens}
        self._compiled = _compile(source) if source else None
        self.kind = "model" if self._compiled is not None else "default"
        # How the rendered text is encoded: a model template writes its own specials.
        self.add_special_tokens = self._compiled is None

    @classmethod
    def for_model(cls, info: ModelInfo) -> "ChatTemplate":
        source, tokens = read_template(info.path)
        return cls(source, **tokens)

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
               kwargs: dict[str, Any] | None = None) -> str:
        """The prompt. `kwargs`: a request's chat_template_kwargs (a model template only)."""
        if self._compiled is None:
            return default_template(messages, tools)
        kwargs = dict(kwargs or {})
        bad = sorted(RESERVED_KWARGS.intersection(kwargs))
        if bad:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(bad)}: send them as request fields",
                                 param="chat_template_kwargs")
        try:
            return self._compiled.render(**{**self.tokens, **kwargs, "messages": [_for_template(m) for m in messages],
                                            "tools": tools or None, "add_generation_prompt": True})
        except Exception as e:
            raise InvalidRequest(f"the model's chat template rejected the messages: {e} (this model's template "
                                 f"decides which roles and orders it accepts)", param="messages") from e


def _for_template(m: dict[str, Any]) -> dict[str, Any]:
    """A message as Hugging Face hands it to templates: thinking under both names they read."""
    if m.get("reasoning_content") is None:
        return m
    return {"thinking": m["reasoning_content"], **m}


class _TemplateError(Exception):
    pass


def _compile(source: str):
    """The compiled template, or None (logged) if Jinja2 is missing or the template is broken."""
    try:
        from jinja2 import TemplateError, nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        log.warning("the model has a chat_template but jinja2 is not installed; using the default template")
        return None

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training):
        rendered as its body, as transformers does when it is not asked for the mask."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str) -> None:
        raise _TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(source)
    except TemplateError as e:
        log.warning("the model's chat_template does not compile (%s); using the default template", e)
        return None
