"""``GET /openapi.json``: the API as it is, for clients, generated SDKs and the fuzzer.

The handlers read their bodies themselves (a 413 before the body is whole, pydantic-core on the
raw bytes; see :mod:`.app`), so FastAPI sees no body parameter and would publish no request
schema. This module publishes the real ones: each request body is the JSON schema of the
pydantic model that parses it (the ``model`` field pinned to the model this server serves),
each answer the schema of the model that builds it, and every error OpenAI's
``{"error": {"message", "type", "param", "code"}}`` under the statuses the server can answer
with. ``tests/test_server_schema_fuzz.py`` fuzzes the server from this schema (schemathesis),
so a schema that lies fails a test.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter

from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    TokenizeRequest,
)

REF = "#/components/schemas/{model}"

ERROR_SCHEMA = {
    "type": "object", "title": "ErrorResponse", "additionalProperties": False,
    "required": ["error"],
    "properties": {"error": {
        "type": "object", "additionalProperties": False,
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string", "minLength": 1},
                       "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}

ERRORS = {  # status: when
    "400": "The body is not a valid request (its message and param say why).",
    "404": "The request names a model this server does not serve.",
    "413": "The body is larger than --max-request-bytes.",
    "500": "The engine failed on this request.",
}
GENERATION_ERRORS = {
    "429": "More requests are waiting than --max-waiting.",
    "503": "The server is shutting down, or the engine can no longer serve.",
}

TOKENIZE_RESPONSE = {
    "type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
    "properties": {"count": {"type": "integer", "minimum": 0},
                   "max_model_len": {"type": "integer"},
                   "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                   "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}},
                                            {"type": "null"}]}},
}
DETOKENIZE_RESPONSE = {"type": "object", "required": ["prompt"],
                       "properties": {"prompt": {"type": "string"}}}
MODELS_RESPONSE = {
    "type": "object", "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                       "created": {"type": "integer"}, "owned_by": {"type": "string"},
                       "root": {"type": "string"}, "parent": {"type": "null"},
                       "max_model_len": {"type": "integer"}}}}},
}
VERSION_RESPONSE = {"type": "object", "required": ["version"],
                    "properties": {"version": {"type": "string"}}}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(statuses: dict[str, str]) -> dict[str, Any]:
    return {status: {"description": why,
                     "content": _json({"$ref": REF.format(model="ErrorResponse")})}
            for status, why in statuses.items()}


class _Components:
    """Collects the models' schemas under ``components/schemas``."""

    def __init__(self, model_name: str) -> None:
        self.schemas: dict[str, Any] = {"ErrorResponse": ERROR_SCHEMA}
        self.model_name = model_name

    def add(self, model: type[BaseModel] | TypeAdapter, name: str, mode: str) -> dict[str, Any]:
        adapter = model if isinstance(model, TypeAdapter) else TypeAdapter(model)
        schema = adapter.json_schema(ref_template=REF, mode=mode)  # type: ignore[arg-type]
        self.schemas.update(schema.pop("$defs", {}))
        self.schemas[name] = schema
        return {"$ref": REF.format(model=name)}

    def pin_model(self, name: str, required: bool) -> None:
        """The ``model`` field takes the one name this server serves (another is a 404)."""
        served = {"type": "string", "enum": [self.model_name]}
        self.schemas[name]["properties"]["model"] = \
            served if required else {"anyOf": [served, {"type": "null"}]}


def openapi_schema(app: FastAPI, model_name: str) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="miniinfer's OpenAI-compatible server (chapter 10).")
    paths = schema["paths"]
    components = _Components(model_name)
    completion = components.add(CompletionRequest, "CompletionRequest", "validation")
    chat = components.add(ChatCompletionRequest, "ChatCompletionRequest", "validation")
    tokenize = components.add(TokenizeRequest, "TokenizeRequest", "validation")
    detokenize = components.add(DetokenizeRequest, "DetokenizeRequest", "validation")
    for name, required in (("CompletionRequest", True), ("ChatCompletionRequest", True),
                           ("TokenizeCompletionRequest", False), ("TokenizeChatRequest", False),
                           ("DetokenizeRequest", False)):
        components.pin_model(name, required)
    completion_response = components.add(CompletionResponse, "CompletionResponse",
                                         "serialization")
    chat_response = components.add(ChatCompletionResponse, "ChatCompletionResponse",
                                   "serialization")

    def post(path: str, body: dict[str, Any], answer: dict[str, Any], stream: bool) -> None:
        content = _json(answer)
        if stream:  # "stream": true answers with server-sent events
            content["text/event-stream"] = {"schema": {"type": "string"}}
        operation = paths[path]["post"]
        operation["requestBody"] = {"required": True, "content": _json(body)}
        operation["responses"] = {
            "200": {"description": "The answer.", "content": content},
            **_errors(ERRORS), **(_errors(GENERATION_ERRORS) if stream else {})}

    post("/v1/completions", completion, completion_response, stream=True)
    post("/v1/chat/completions", chat, chat_response, stream=True)
    post("/tokenize", tokenize, TOKENIZE_RESPONSE, stream=False)
    post("/detokenize", detokenize, DETOKENIZE_RESPONSE, stream=False)

    def get(path: str, answer: dict[str, Any], **more: Any) -> None:
        paths[path]["get"]["responses"] = {"200": {"description": "The answer.",
                                                   "content": answer}, **more}

    get("/health", {}, **_errors({"503": "The engine can no longer serve (the message says "
                                          "why); the server is about to exit."}))
    paths["/health"]["get"]["responses"]["200"]["description"] = "The engine can serve."
    del paths["/health"]["get"]["responses"]["200"]["content"]
    get("/version", _json(VERSION_RESPONSE))
    get("/metrics", {"text/plain": {"schema": {"type": "string"}}})
    get("/v1/models", _json(MODELS_RESPONSE))
    schema.setdefault("components", {})["schemas"] = components.schemas
    return schema


def install(app: FastAPI, model_name: str) -> None:
    """Serve :func:`openapi_schema` at ``/openapi.json`` (built once, on first request)."""
    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app, model_name)
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]
