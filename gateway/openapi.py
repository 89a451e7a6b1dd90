"""What /openapi.json says about the HTTP API: the request body of every POST endpoint (the
pydantic models of `schemas.py`) and the status codes each endpoint really returns, with
OpenAI's error shape.

The endpoints read their bodies as raw bytes (a byte limit, then the strict parse of
`jsonbody.py`), so FastAPI does not see a body parameter; `json_body` declares it through
`openapi_extra` and `install` adds the models to the schema's components. FastAPI's automatic
422 responses are removed: validation errors are 400 here. Generated clients, Swagger's "Try it
out" and the schema fuzz test (tests/integration/test_gateway_schema_fuzz.py) read this.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


_WHEN = {
    400: "Invalid request: bad JSON, unknown field, wrong type, value out of range; `param` names the field",
    401: "Missing or invalid API key",
    403: "Not allowed as the gateway is configured (the admin routes with API keys but no admin key)",
    404: "Model (or request id) not served here",
    413: "Request body larger than max_body_bytes",
    415: "Content-Type is not application/json",
    429: "Admission backlog, open streams or the API key's limits are full; see Retry-After",
    503: "Redis unreachable or predicted time to first token past its deadline; see Retry-After",
    504: "No first token or no end within the request's deadlines",
}
GENERATE = (400, 401, 404, 413, 415, 429, 503, 504)  # the completion endpoints
TOKENIZE = (400, 401, 404, 413, 415, 503)


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entries for these status codes, all with the error schema."""
    return {c: {"model": ErrorResponse, "description": _WHEN[c]} for c in codes}


def json_body(model: type[BaseModel], description: str = "") -> dict[str, Any]:
    """`openapi_extra` declaring a required JSON request body of this model."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "description": description or model.__doc__ or "",
                            "content": {"application/json": {"schema": schema}}}}


# One server-sent event as schema tools read a text/event-stream: `data` is a chunk's JSON (or
# "[DONE]"), `id` the token index (absent on the usage chunk and [DONE]).
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "id": {"type": "string"}, "event": {"type": "string"}}}


def sse_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/event-stream": {"schema": SSE_EVENT}}}


def completion_response(stream_doc: str) -> dict[int | str, dict[str, Any]]:
    """200 of the completion endpoints: a JSON object, or an SSE stream with `stream: true`."""
    obj = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
           "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                          "created": {"type": "integer"}, "model": {"type": "string"},
                          "choices": {"type": "array", "items": {"type": "object"}},
                          "usage": {"type": ["object", "null"]}}}
    return {200: {"description": f"The completion; {stream_doc}",
                  "content": {"application/json": {"schema": obj},
                              "text/event-stream": {"schema": SSE_EVENT}}}}


def response_object() -> dict[int | str, dict[str, Any]]:
    """200 of /v1/responses: a `response` object, or an SSE stream of Responses events."""
    obj = {"type": "object", "required": ["id", "object", "created_at", "model", "status", "output"],
           "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                          "created_at": {"type": "integer"}, "model": {"type": "string"},
                          "status": {"enum": ["completed", "incomplete"]},
                          "output": {"type": "array", "items": {"type": "object"}},
                          "usage": {"type": ["object", "null"]}}}
    return {200: {"description": "A `response` object; with `stream: true` an SSE stream of Responses events "
                                 "(`event: response.created` ... `event: response.completed`)",
                  "content": {"application/json": {"schema": obj}, "text/event-stream": {"schema": SSE_EVENT}}}}


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve an /openapi.json that includes `models` as components and has no 422 responses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.get("$defs", {}))
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
