"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every path out of the server that is not a success goes through here: our own ``APIError``s,
user-input ``ValueError``s from the engine (400), FastAPI's body validation (400, not its default
422), unknown routes, and anything unexpected (500, logged with its traceback).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import error_body

log = logging.getLogger("computron.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


class ModelNotFound(APIError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(404, f"unknown model {name!r}; known models: {', '.join(known) or 'none'}",
                         "model", "model_not_found")


class QueueFull(APIError):
    def __init__(self, name: str, depth: int, retry_after: int = 1):
        super().__init__(429, f"the queue of model {name!r} is full ({depth} requests waiting); retry later",
                         "model", "queue_full", {"Retry-After": str(retry_after)})


PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "top_logprobs", "n", "best_of")


def param_of(message: str, prompt: str = "prompt") -> str | None:
    """The request field an engine's error message is about: the field it starts with, or the
    prompt (or messages) for errors about its length, its ids or its template."""
    first = message.split(" ", 1)[0]
    if first in PARAMS:
        return first
    if message.startswith(("the prompt", "prompt", "chat template", "a chat message")):
        return prompt
    return None


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, TYPES.get(status, "server_error" if status >= 500 else
                                                      "invalid_request_error"), param, code),
                        status_code=status, headers=headers)


def _loc(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON{': ' + str(detail) if detail else ''}",
                                  None, "invalid_json")
        msgs = []
        for e in errors[:5]:
            where = _loc(e.get("loc", ()))
            msgs.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        if len(errors) > 5:
            msgs.append(f"and {len(errors) - 5} more")
        return error_response(400, "invalid request body: " + "; ".join(msgs), _loc(first.get("loc", ())),
                              "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            cause = exc.__cause__ or exc.__context__
            detail = (f"the request body could not be parsed: {cause}" if cause is not None and str(cause) else
                      "the request body could not be read: send JSON with 'Content-Type: application/json'")
        return error_response(exc.status_code, detail, None, None, getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError):
        return error_response(400, str(exc), None, "invalid_value")

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")


# ---- the OpenAPI document: the statuses each route really answers ---------------------------------
_ALL = (401, 503)  # a missing key; the server is starting (not /metrics, not /health)
STATUSES = {
    ("/health", "get"): (503,),
    ("/metrics", "get"): (401,),
    ("/v1/models", "get"): _ALL,
    ("/v1/models/{model_id}", "get"): (*_ALL, 404),
    ("/v1/completions", "post"): (*_ALL, 400, 404, 413, 429, 500),
    ("/v1/chat/completions", "post"): (*_ALL, 400, 404, 413, 429, 500),
}
ADMIN = (*_ALL, 400, 403, 404, 409, 413)  # 403: admin off, or a checkpoint outside the model directories


def document(app: FastAPI) -> None:
    """Make ``app.openapi()`` true: every error status a route sends, with the OpenAI error body
    (never FastAPI's 422, which this server does not send), and /metrics as Prometheus text."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        comps["Error"] = {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}}
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                statuses = ADMIN if path.startswith("/admin") else STATUSES.get((path, method), _ALL)
                for status in statuses:
                    responses[str(status)] = {"description": TYPES.get(status, "error"), **error}
        for path in ("/v1/completions", "/v1/chat/completions"):  # "stream": true
            schema["paths"][path]["post"]["responses"]["200"].setdefault("content", {})["text/event-stream"] = {
                "schema": {"type": "string"}}
        schema["paths"]["/health"]["get"]["responses"]["503"] = {
            "description": "starting", "content": {"application/json": {"schema": {"type": "object"}}}}
        schema["paths"]["/metrics"]["get"]["responses"]["200"] = {
            "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
