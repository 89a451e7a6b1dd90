"""Structured outputs (issue 13, the gateway half): the request fields that constrain what the
model may write, turned into the one grammar spec `GenerationRequest.grammar` carries.

The fields: OpenAI's chat `response_format` (`text`, `json_object`, `json_schema`) and vLLM's
extras on both endpoints (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and
the newer `structured_outputs` object). At most one of them may constrain a request: two are a
400 naming both. The spec is bounded in size (`max_grammar_bytes`) and, where
`tandem_core.grammar` is installed, checked by its `check_spec` before anything is enqueued, so
an unsupported schema is a 400 naming the construct, never a failure on a worker.

It must not know how the workers compile or apply the grammar; it only builds and checks specs.
"""
from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag

from tandem_core.errors import InvalidRequest

log = logging.getLogger(__name__)
MAX_CHOICES = 256  # guided_choice entries
JsonSchema = dict[str, Any]


class ResponseFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the reply must validate against."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr | None = Field(default=None, max_length=64)
    description: StrictStr | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: StrictBool | None = None  # the grammar is always enforced: strict or not


class ResponseFormatJsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


_FORMATS = {"text": "ResponseFormatText", "json_object": "ResponseFormatJsonObject",
            "json_schema": "ResponseFormatJsonSchema"}


def _format_tag(v: Any) -> str | None:
    """The member a `response_format` is, by its `type` (errors then name that member's fields)."""
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return _FORMATS.get(kind) if isinstance(kind, str) else None


ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("ResponseFormatText")]
    | Annotated[ResponseFormatJsonObject, Tag("ResponseFormatJsonObject")]
    | Annotated[ResponseFormatJsonSchema, Tag("ResponseFormatJsonSchema")],
    Discriminator(_format_tag, custom_error_type="invalid_type",
                  custom_error_message="type must be one of 'text', 'json_object', 'json_schema'")]
ChoiceList = list[StrictStr]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid")
    json_: JsonSchema | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: ChoiceList | None = None
    grammar: StrictStr | None = None  # llguidance's Lark dialect


def response_format_spec(rf: ResponseFormat | None) -> dict | None:
    if rf is None or isinstance(rf, ResponseFormatText):
        return None
    if isinstance(rf, ResponseFormatJsonObject):
        return {"kind": "json_object"}
    return {"kind": "json_schema", "schema": rf.json_schema.schema_}


def _json_spec(value: JsonSchema | str, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequest(f"{param} is a string that is not valid JSON: {e}", param=param) from e
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be a JSON schema object, got {type(value).__name__}", param=param)
    return {"kind": "json_schema", "schema": value}


def _choice_spec(choices: list[str], param: str) -> dict:
    if not choices:
        raise InvalidRequest(f"{param} is empty: send at least one choice", param=param)
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"{param} has {len(choices)} choices, more than the limit of {MAX_CHOICES}",
                             param=param)
    if any(c == "" for c in choices):
        raise InvalidRequest(f"{param} entries must not be empty", param=param)
    return {"kind": "choice", "choices": list(choices)}


def _nonempty(value: str, param: str) -> str:
    if not value:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    return value


def guided_specs(body: Any) -> list[tuple[str, dict]]:
    """(field, spec) for every vLLM extra the body sets (`body` has the `guided_*` and
    `structured_outputs` attributes)."""
    out: list[tuple[str, dict]] = []
    if body.guided_json is not None:
        out.append(("guided_json", _json_spec(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        out.append(("guided_regex", {"kind": "regex", "pattern": _nonempty(body.guided_regex, "guided_regex")}))
    if body.guided_choice is not None:
        out.append(("guided_choice", _choice_spec(body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        out.append(("guided_grammar", {"kind": "lark", "grammar": _nonempty(body.guided_grammar, "guided_grammar")}))
    if body.structured_outputs is not None:
        out.extend(_structured_outputs(body.structured_outputs))
    return out


def _structured_outputs(so: StructuredOutputs) -> list[tuple[str, dict]]:
    p = "structured_outputs"
    out = []
    if so.json_ is not None:
        out.append((f"{p}.json", _json_spec(so.json_, f"{p}.json")))
    if so.regex is not None:
        out.append((f"{p}.regex", {"kind": "regex", "pattern": _nonempty(so.regex, f"{p}.regex")}))
    if so.choice is not None:
        out.append((f"{p}.choice", _choice_spec(so.choice, f"{p}.choice")))
    if so.grammar is not None:
        out.append((f"{p}.grammar", {"kind": "lark", "grammar": _nonempty(so.grammar, f"{p}.grammar")}))
    if not out:
        raise InvalidRequest(f"{p} is empty: set one of json, regex, choice or grammar", param=p)
    return out


def one_spec(specs: list[tuple[str, dict]]) -> tuple[str | None, dict | None]:
    """The one constraint of a request, or a 400 naming the first two fields that set one."""
    if len(specs) > 1:
        (a, _), (b, _) = specs[:2]
        raise InvalidRequest(f"{a} and {b} both constrain the output: send at most one of them", param=b)
    return specs[0] if specs else (None, None)


def check_grammar(spec: dict, param: str, max_bytes: int, tokenizer: Any, vocab_size: int | None = None) -> None:
    """The size bound, then the grammar library's own check (when it is installed here)."""
    size = len(json.dumps(spec, separators=(",", ":"), ensure_ascii=False).encode())
    if size > max_bytes:
        raise InvalidRequest(f"{param} is {size} bytes as a grammar, more than the limit of {max_bytes} bytes "
                             f"(max_grammar_bytes)", param=param)
    check = _check_spec()
    if check is None:
        return
    try:
        check(spec, tokenizer, vocab_size=vocab_size)
    except InvalidRequest as e:
        raise InvalidRequest(f"{param}: {e.message}", param=param) from e
    except ValueError as e:
        raise InvalidRequest(f"{param} is not a grammar this server can enforce: {e}", param=param) from e


def _check_spec():
    """`tandem_core.grammar.check_spec`, or None where that module (or its library) is missing."""
    try:
        from tandem_core.grammar import check_spec
    except ImportError as e:
        log.debug("no grammar check at the gateway (%s): specs are only size-checked", e)
        return None
    return check_spec
