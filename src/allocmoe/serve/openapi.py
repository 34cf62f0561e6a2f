"""What /openapi.json says the server answers, made true: every status a route sends (and no 422,
which FastAPI lists by default but this server turns into 400), the error JSON's shape, and the
content types (a stream is text/event-stream, /metrics is Prometheus text)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .metrics import CONTENT_TYPE


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """The error JSON of OpenAI's and vLLM's servers."""
    error: ErrorDetail


WHY = {400: "bad request: malformed JSON, a wrong or unsupported field, a prompt past the context",
       401: "missing or wrong API key (when the server has one)",
       404: "no such model or plan",
       408: "the body did not arrive within --request-timeout",
       413: "the body is larger than --max-request-bytes",
       500: "the generation failed inside the server (a bug: see its log)",
       503: "the queue is full, or the server is shutting down (Retry-After)"}


# before OpenAPI 3.2 a text/event-stream schema describes each event
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a chunk's JSON, an error JSON, or [DONE]"}}}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": WHY[code]} for code in codes}


def generation_responses(kind: str) -> dict[int | str, dict[str, Any]]:
    ok = {200: {"description": f"a {kind} object (JSON), or with stream=true server-sent events of chunks "
                               "ending in `data: [DONE]`",
                "content": {"application/json": {"schema": {"type": "object"}},
                            "text/event-stream": {"schema": SSE_EVENT}}}}
    return {**ok, **error_responses(400, 401, 404, 408, 413, 500, 503)}


METRICS_RESPONSES = {200: {"description": "Prometheus text exposition",
                           "content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}}}


def tidy_openapi(app) -> None:
    """Drop FastAPI's 422 (never sent) and its schemas; the rest comes from the routes' `responses`."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi
