"""Tool calling (issue 13, the gateway half): `tools`, `tool_choice` and `parallel_tool_calls` on a
chat request, turned into what the prompt shows and what the output may be.

The tool-call format is Hermes': the model answers a call with
`<tool_call>{"name": "<function>", "arguments": {...}}</tool_call>` (one block per call). The
default chat template lists the functions in a system block and asks for that format
(`chat.py`); a model's own template gets `tools=` as Hugging Face templates expect. Then:
- `"auto"`: free text, parsed afterwards for `<tool_call>` blocks (`toolparse.py`);
- `"required"` or a named function: a Lark grammar (llguidance's dialect, one `%json` schema per
  function) forces `<tool_call>` + `{"name": <that function>, "arguments": <its parameters
  schema>}` + `</tool_call>`, so the arguments always parse and validate. A model family with
  another call format gets the same guarantee in its own wrapper (`CallSyntax`, chosen by
  `chatformat.py`): Mistral's `[TOOL_CALLS][{...}]` or `[TOOL_CALLS]name[ARGS]{...}`, gpt-oss's
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` (its markers are
  special tokens, written `<[id]>` in the grammar). One call, unless
  `"parallel_tool_calls": true` with "required" (then 1..MAX_PARALLEL_CALLS): OpenAI's default
  is parallel, but a grammar that may go on with another call lets a small model start one it
  cannot finish within max_tokens, and a cut call is no call;
- `"none"`: no tools in the prompt, plain text.
The legacy `functions`/`function_call` fields stay refused (send `tools`/`tool_choice`).

It must not know about HTTP; it builds grammar specs and prompt text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from tandem_core.errors import InvalidRequest

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # "required" with parallel calls: at most this many calls, so the grammar ends
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_NAME_CHARS = "^[A-Za-z0-9_.-]{1,64}$"
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # no unbounded whitespace: a strict schema ends


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr = Field(pattern=_NAME_CHARS)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent = no parameters
    strict: StrictBool | None = None  # the grammar (with tool_choice required/named) is always enforced


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr = Field(max_length=64)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr = Field(max_length=64)
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """One call of an assistant message in the history."""

    model_config = ConfigDict(extra="forbid")
    id: StrictStr = Field(max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass
class ToolPlan:
    """What a chat request's tools mean: the tools shown to the model (None: none), whether the
    output is parsed for calls, and the grammar forcing a call (None: not forced)."""

    tools: list[dict] | None = None
    parse: bool = False
    grammar: dict | None = None


@dataclass(frozen=True)
class CallSyntax:
    """How a family writes a forced call around the JSON: `kind` names the shape, `marks` maps
    each special marker of that shape to its Lark term (`<[id]>` when the tokenizer has it as one
    special token, else the quoted text)."""

    kind: str = "hermes"  # "hermes" | "mistral" (v3 list) | "mistral_args" (name[ARGS]{...}) | "harmony"
    marks: tuple[tuple[str, str], ...] = ()

    def mark(self, text: str) -> str:
        return dict(self.marks).get(text, json.dumps(text))


HERMES = CallSyntax()


def plan(tools: list[ToolDef] | None, choice: ToolChoice | None, parallel: bool | None,
         syntax: CallSyntax = HERMES) -> ToolPlan:
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} functions, more than the limit of {MAX_TOOLS}", param="tools")
    names = [t.function.name for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise InvalidRequest(f"tools: function {dup!r} is defined twice", param="tools")
    choice = choice if choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan()
    if not tools:
        if choice == "auto":
            return ToolPlan()
        raise InvalidRequest("tool_choice needs tools: send the functions in \"tools\"", param="tool_choice")
    shown = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        return ToolPlan(shown, parse=True)
    if choice == "required":
        return ToolPlan(shown, parse=True, grammar=call_grammar(tools, many=parallel is True, syntax=syntax))
    wanted = choice.function.name
    picked = [t for t in tools if t.function.name == wanted]
    if not picked:
        raise InvalidRequest(f"tool_choice names function {wanted[:64]!r}, which is not in tools",
                             param="tool_choice.function.name")
    return ToolPlan(shown, parse=True, grammar=call_grammar(picked, many=False, syntax=syntax))


def _bounded(schema: dict) -> dict:
    """Integers bounded to the safe-integer range (`tandem_core.grammar.bounded`: an unbounded one
    lets a small model write digits until max_tokens), where the grammar module is installed."""
    try:
        from tandem_core.grammar import bounded
    except ImportError:
        return schema
    return bounded(schema)


def _args_schema(fn: FunctionDef) -> dict:
    return _bounded(fn.parameters) if fn.parameters is not None else NO_PARAMETERS


def _call_schema(fn: FunctionDef) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": _args_schema(fn)},
            "required": ["name", "arguments"], "additionalProperties": False, **_COMPACT}


def _json(schema: dict) -> str:
    return "%json " + json.dumps(schema, separators=(",", ":"))


def call_grammar(tools: list[ToolDef], many: bool, syntax: CallSyntax = HERMES) -> dict:
    """The Lark spec forcing one call (or 1..MAX_PARALLEL_CALLS calls) of these functions, in the
    family's format. gpt-oss calls one function per message: harmony forces one call."""
    fns = [t.function for t in tools]
    body = "body: " + " | ".join(f"fn_{i}" for i in range(len(fns)))
    if syntax.kind == "mistral":  # [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
        more = f' ("," body){{0,{MAX_PARALLEL_CALLS - 1}}}' if many else ""
        rules = [f'start: {syntax.mark("[TOOL_CALLS]")} "[" body{more} "]"', body]
        rules += [f"fn_{i}: {_json(_call_schema(f))}" for i, f in enumerate(fns)]
    elif syntax.kind == "mistral_args":  # [TOOL_CALLS]name[ARGS]{...}, repeated
        calls = f"call{{1,{MAX_PARALLEL_CALLS}}}" if many else "call"
        rules = [f"start: {calls}", f'call: {syntax.mark("[TOOL_CALLS]")} body', body]
        rules += [f'fn_{i}: {json.dumps(f.name)} {syntax.mark("[ARGS]")} {_json({**_args_schema(f), **_COMPACT})}'
                  for i, f in enumerate(fns)]
    elif syntax.kind == "harmony":  # <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
        rules = [f'start: {syntax.mark("<|channel|>")} "commentary to=functions." body', body]
        rules += [f'fn_{i}: {json.dumps(f.name + " ")} {syntax.mark("<|constrain|>")} "json" '
                  f'{syntax.mark("<|message|>")} {_json({**_args_schema(f), **_COMPACT})}' for i, f in enumerate(fns)]
    else:  # hermes: <tool_call>{"name": ..., "arguments": ...}</tool_call>
        calls = f"call{{1,{MAX_PARALLEL_CALLS}}}" if many else "call"
        rules = [f"start: {calls}", 'call: "<tool_call>" body "</tool_call>"', body]
        rules += [f"fn_{i}: {_json(_call_schema(f))}" for i, f in enumerate(fns)]
    return {"kind": "lark", "grammar": "\n".join(rules) + "\n"}


# ---------------------------------------------------------------- the history and the default template


def history_calls(calls: list[ToolCallIn]) -> list[dict]:
    """An assistant message's calls as templates read them: arguments parsed to an object (what
    Hugging Face templates expect), or kept as the string when it is not JSON."""
    out = []
    for c in calls:
        try:
            args: Any = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
        except ValueError:
            args = c.function.arguments
        out.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
    return out


def format_call(name: str, arguments: Any) -> str:
    """One call in the Hermes format the default template teaches."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}</tool_call>'


TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to answer. The functions, as JSON:\n<tools>\n")
TOOLS_FOOTER = ("</tools>\n\nTo call a function, answer with one block per call:\n"
                '<tool_call>{"name": <function name>, "arguments": <the arguments as a JSON object>}</tool_call>\n'
                "A function's result comes back in a tool message.")


def tools_block(tools: list[dict]) -> str:
    lines = "".join(json.dumps(t, ensure_ascii=False, separators=(", ", ": ")) + "\n" for t in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER
