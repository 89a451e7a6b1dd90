"""What a model family writes back: its reasoning parser, its tool-call parser and how a forced
call is written, chosen once per served model from its chat template and config.json.

A family's output format is data here, not branches through the gateway:
- `REASONING` and `TOOLS` map a parser name (vLLM's names: `--reasoning-parser qwen3`,
  `--tool-call-parser hermes|mistral|openai`) to its parser class;
- `detect` picks the names: the gateway settings `reasoning_parser` / `tool_call_parser` when
  they are not "auto", else the markers the chat template writes (`<|channel|>`: harmony;
  `[TOOL_CALLS]`: Mistral; `<tool_call>`: Hermes; `<think>`: think tags), else the parsers of
  config.json's `model_type`'s family (the family table, tandem_core/families.py), else Hermes
  without reasoning (the default template's format);
- `ChatFormat` holds the choice for the service; per request it gives the `OutputSpec` the
  stream's formatter reads (stored with a resumable stream, so a resume parses alike), whether
  the output must be decoded with special tokens kept (Mistral's and gpt-oss's markers are
  special tokens), the tool-call id style and the history fix-ups the family's template needs
  (Mistral's template accepts only 9-character call ids: longer ones are cut to their last 9,
  as vLLM does), the tokens that end the assistant's turn besides EOS (gpt-oss's `<|call|>` and
  `<|return|>`), and the `CallSyntax` that forced calls are written in.
- `ChoiceParser` runs one choice's text through the reasoning parser, then its content through
  the tool-call parser, and returns (reasoning, content, calls) per piece.

It must not know about HTTP or Redis; it reads the model directory once, at start.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.harmony import HarmonyParser
from gateway.reasoning import ThinkTags, opened_in
from gateway.toolparse import MistralCalls, ToolCallStream
from gateway.tools import CallSyntax
from tandem_core.errors import TandemError
from tandem_core.families import family_of

log = logging.getLogger(__name__)

REASONING: dict[str, type] = {"qwen3": ThinkTags, "deepseek_r1": ThinkTags, "openai_gptoss": HarmonyParser}
# None: the calls come out of the reasoning parser (harmony reads channels and calls together)
TOOLS: dict[str, type | None] = {"hermes": ToolCallStream, "mistral": MistralCalls, "openai": None}
SPECIAL_MARKERS = {"mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
                   "openai": ("<|channel|>", "<|message|>", "<|constrain|>", "<|start|>", "<|end|>")}
# Tokens that end the assistant's turn in a family's format, stopped on in every chat request (as
# vLLM's harmony path does): gpt-oss ends a turn with <|return|> or, for a tool call, <|call|>,
# which its config.json's eos_token_id does not list.
STOP_MARKERS = {"openai_gptoss": ("<|return|>", "<|call|>")}
# The template's own words, most specific first: (marker, tool parser, reasoning parser).
TEMPLATE_MARKERS = (("<|channel|>", "openai", "openai_gptoss"), ("[TOOL_CALLS]", "mistral", None),
                    ("<tool_call>", "hermes", None))
THINK_MARKER = "<think>"
AUTO, NONE = "auto", "none"


class ChatFormatError(TandemError):
    """The gateway's reasoning_parser / tool_call_parser settings do not fit together or name
    no parser: fix the settings."""

    error_type = "configuration_error"


@dataclass(frozen=True)
class OutputSpec:
    """How one request's output is parsed (StreamMeta carries these fields)."""

    reasoning: str = ""  # reasoning parser name, "" for none
    reasoning_open: bool = False  # the prompt ended inside the model's thinking
    tool_parser: str = "hermes"
    tools: bool = False  # the request has tools: parse calls


class ChoiceParser:
    """One choice's text -> (reasoning, content, calls), piece by piece, then `finish`."""

    def __init__(self, spec: OutputSpec, request_id: str, choice: int = 0) -> None:
        kind = REASONING.get(spec.reasoning) if spec.reasoning else None
        self._harmony = HarmonyParser(request_id, choice, tools=spec.tools) if kind is HarmonyParser else None
        self._think = kind(spec.reasoning_open) if kind is ThinkTags else None
        calls = TOOLS.get(spec.tool_parser) if spec.tools else None
        self._calls = calls(request_id, choice) if calls is not None else None

    @property
    def calls(self) -> list[dict]:
        if self._harmony is not None:
            return self._harmony.calls
        return self._calls.calls if self._calls is not None else []

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        return self._route(text, final=False)

    def finish(self) -> tuple[str, str, list[dict]]:
        return self._route("", final=True)

    def _route(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        reasoning, calls = "", []
        if self._harmony is not None:
            reasoning, text, calls = self._harmony.finish() if final else self._harmony.feed(text)
        elif self._think is not None:
            if final:
                r, c = self._think.finish()
                reasoning, text = r, text + c
            else:
                reasoning, text = self._think.feed(text)
        if self._calls is not None:
            text, more = self._calls.feed(text)
            calls = calls + more
            if final:
                text += self._calls.finish()
        return reasoning, text, calls


def parse_output(text: str, spec: OutputSpec, request_id: str, choice: int = 0) -> dict:
    """A whole output -> the message fields {"reasoning_content", "content", "tool_calls"}."""
    p = ChoiceParser(spec, request_id, choice)
    r1, c1, _ = p.feed(text)
    r2, c2, _ = p.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in p.calls]
    content = c1 + c2
    return {"reasoning_content": (r1 + r2) or None,
            "content": (content.strip() or None) if calls else content, "tool_calls": calls}


# ---------------------------------------------------------------- choosing the format of a model


def model_type(path: str | None) -> str:
    """config.json's model_type (a multimodal config's text_config's too), or ""."""
    if not path or not (Path(path) / "config.json").is_file():
        return ""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(cfg.get("model_type") or (cfg.get("text_config") or {}).get("model_type") or "")


def detect(template: str | None, family: str, reasoning: str = AUTO, tool_parser: str = AUTO) -> tuple[str, str]:
    """(tool parser, reasoning parser or "") from the settings, the template's markers, the family."""
    fam = family_of(family)
    fam_tools, fam_reasoning = (fam.tool_parser, fam.reasoning_parser) if fam else ("hermes", None)
    if template:
        pick = next(((t, r) for m, t, r in TEMPLATE_MARKERS if m in template), None)
        auto_tools = pick[0] if pick else fam_tools
        auto_reasoning = (pick[1] if pick and pick[1] else None) or ("qwen3" if THINK_MARKER in template else "")
    else:  # no template of its own (the default one): what the family writes
        auto_tools, auto_reasoning = fam_tools, fam_reasoning or ""
    tools = auto_tools if tool_parser == AUTO else tool_parser
    reasoning = auto_reasoning if reasoning == AUTO else ("" if reasoning == NONE else reasoning)
    if reasoning and reasoning not in REASONING:
        raise ChatFormatError(f"reasoning_parser {reasoning!r} is not one of {', '.join(sorted(REASONING))} "
                              f"(or auto, none)")
    if tools not in TOOLS:
        raise ChatFormatError(f"tool_call_parser {tools!r} is not one of {', '.join(sorted(TOOLS))} (or auto)")
    if TOOLS[tools] is None and REASONING.get(reasoning) is not HarmonyParser:
        raise ChatFormatError(f"tool_call_parser {tools!r} reads calls from harmony channels: it needs "
                              f"reasoning_parser openai_gptoss (or auto)")
    return tools, reasoning


class ChatFormat:
    """The served model's output format; built once per service."""

    def __init__(self, tool_parser: str = "hermes", reasoning: str = "", template: str | None = None,
                 tokenizer: Any = None) -> None:
        self.tool_parser, self.reasoning = tool_parser, reasoning
        self._channels = REASONING.get(reasoning) is HarmonyParser
        self.syntax = _syntax(tool_parser, template, tokenizer)
        self.short_ids = tool_parser == "mistral"
        self.stop_token_ids = tuple(i for t in STOP_MARKERS.get(reasoning, ()) if len(ids := _ids(tokenizer, t)) == 1
                                    for i in ids)

    @classmethod
    def for_model(cls, path: str | None, template: str | None, tokenizer: Any = None,
                  reasoning: str = AUTO, tool_parser: str = AUTO) -> "ChatFormat":
        family = model_type(path)
        tools, think = detect(template, family, reasoning, tool_parser)
        log.info("chat output format: tool calls %s, reasoning %s (model_type %r)", tools, think or "none",
                 family or "unknown")
        return cls(tools, think, template, tokenizer)

    def keeps_specials(self, tools: bool) -> bool:
        """Whether the output must be decoded with special tokens kept: harmony's channels always,
        Mistral's `[TOOL_CALLS]` when the request has tools (as vLLM's Mistral parser asks)."""
        return self._channels or (tools and self.tool_parser in SPECIAL_MARKERS)

    def output(self, prompt: str, tools: bool) -> OutputSpec:
        """How this request's output is parsed, given its rendered prompt."""
        open_ = self.reasoning != "" and REASONING[self.reasoning] is ThinkTags and opened_in(prompt)
        return OutputSpec(self.reasoning, open_, self.tool_parser, tools)

    def history(self, messages: list[dict]) -> list[dict]:
        """The messages as this family's template accepts them (Mistral: 9-character call ids)."""
        if not self.short_ids:
            return messages
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "id": c["id"][-9:]} for c in m["tool_calls"]]
            if m.get("tool_call_id"):
                m["tool_call_id"] = m["tool_call_id"][-9:]
            out.append(m)
        return out


def _syntax(tool_parser: str, template: str | None, tokenizer: Any) -> CallSyntax:
    """The forced-call wrapper: each special marker as `<[id]>` when the tokenizer has it as one
    token (a grammar can only emit a special token by its id), else as quoted text."""
    kind = {"mistral": "mistral_args" if template and "[ARGS]" in template else "mistral",
            "openai": "harmony"}.get(tool_parser, "hermes")
    marks = []
    for text in SPECIAL_MARKERS.get(tool_parser, ()):
        ids = _ids(tokenizer, text)
        if len(ids) == 1:
            marks.append((text, f"<[{ids[0]}]>"))
    return CallSyntax(kind, tuple(marks))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
