"""The strict parse that turns a raw request body into one of the pydantic bodies of
`schemas.py`: UTF-8 JSON only (no NaN/Infinity, no unpaired surrogates, bounded nesting), then
the model's validation, with every failure an `InvalidRequest` that names the field.

Separate from the bodies so that the parse (what the wire may carry) and the bodies (what the
API means) can each be read on their own; nothing here knows a field name.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from tandem_core.errors import InvalidRequest

MAX_JSON_DEPTH = 32


def _reject_constant(name: str) -> float:
    raise InvalidRequest(f"request body is not valid JSON: {name} is not a JSON number")


def load_json(raw: bytes) -> dict:
    """UTF-8 JSON object, bounded nesting, no surrogates; else InvalidRequest."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8: byte {e.start} ({e.reason})") from e
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise InvalidRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep") from e
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    _check_tree(data)
    return data


def _check_tree(data: dict) -> None:
    """Depth bound and well-formed Unicode everywhere (an escaped lone surrogate such as "\\ud800"
    is valid JSON but not text), without recursion."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep",
                                 param=path or None)
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, dict):
            for k, v in node.items():
                _check_text(k, path or "body")
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))


def _check_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{path[:200] or 'body'} contains an unpaired surrogate at character {e.start} (invalid Unicode)",
            param=path[:200] or None,
        ) from e


def parse_body(raw: bytes, model: type[BaseModel]):
    data = load_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _model_name(x: str) -> bool:
    """A union member's class name in an error's location (fields are snake_case)."""
    return x[:1].isupper() and x.isidentifier() and "_" not in x


def _loc(loc: tuple) -> str:
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif x not in _UNION_TAGS and "[" not in x and x != "body" and not _model_name(x):
            out += f".{x}" if out else x
    return out or "body"


def validation_error(e: ValidationError) -> InvalidRequest:
    err = e.errors(include_url=False)[0]
    field = _loc(err.get("loc", ()))[:200]
    if err.get("type") == "extra_forbidden":
        return InvalidRequest(f"unknown field {field!r}", param=field)
    if err.get("type") == "missing":
        return InvalidRequest(f"field {field!r} is required", param=field)
    return InvalidRequest(f"invalid value for {field!r}: {err.get('msg')}", param=field)
