"""Errors of the builtin engine and their one mapping to HTTP.

    AgentError                       (gpu_agent.errors: the package's one base)
    └── EngineError                  (status, OpenAI error type)
        ├── InvalidRequest           400 invalid_request_error   malformed body / params
        │   └── ContextTooLong       400 invalid_request_error   prompt + max_tokens > max_model_len
        ├── ModelNotFound            404 not_found_error         `model` names nothing served
        └── AdapterUnavailable       503 service_unavailable     cannot be made resident now

Errors of the agent core (`gpu_agent.errors.AgentError`) are translated here too, so the
server has exactly one place that turns an exception into a status and a JSON body.
"""
from __future__ import annotations

from typing import Any

from gpu_agent.errors import AgentError

__all__ = ["EngineError", "InvalidRequest", "ModelNotFound", "AdapterUnavailable",
           "ContextTooLong", "error_body", "http_error"]


class EngineError(AgentError):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(EngineError):
    status = 400
    type = "invalid_request_error"


class ContextTooLong(InvalidRequest):
    pass


class ModelNotFound(EngineError):
    status = 404
    type = "not_found_error"

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.", param="model", code="model_not_found")


class AdapterUnavailable(EngineError):
    status = 503
    type = "service_unavailable"


def error_body(status: int, message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param,
                      "code": code if code is not None else status}}


def http_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI-style body for any exception raised while serving a request."""
    from gpu_agent import errors as core

    if isinstance(exc, EngineError):
        return exc.status, error_body(exc.status, exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, (core.PoolExhausted, core.AdapterBusy, core.AdapterNotResident)):
        return 503, error_body(503, f"adapter pool: {exc}", "service_unavailable", "model")
    if isinstance(exc, core.AdapterNotFound):
        return 404, error_body(404, str(exc), "not_found_error", "model", "model_not_found")
    if isinstance(exc, core.AgentError):  # invalid adapter files, digest mismatch, fetch failures
        return 503, error_body(503, f"adapter cannot be served: {exc}", "service_unavailable", "model")
    return 500, error_body(500, "internal error", "internal_error")
