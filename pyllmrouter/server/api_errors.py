"""Router errors -> HTTP status and OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pyllmrouter.errors import (Busy, LoadFailed, ModelRemoved, NeverFits, NotLoaded, QueueFull, QueueTimeout,
                                RequestFailed, RouterClosed, Unclaimed, UnknownModel, WorkerDied, Withdrawn)

__all__ = ["ApiError", "error_response", "from_router_error"]


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}
        self.extra = extra or {}


def error_response(e: ApiError) -> JSONResponse:
    body: dict[str, Any] = {"message": e.message, "type": e.type, "param": e.param, "code": e.code or e.status}
    body.update(e.extra)
    return JSONResponse({"error": body}, status_code=e.status, headers=e.headers)


def from_router_error(e: Exception) -> ApiError:
    if isinstance(e, Withdrawn):  # nobody reads it: the client is gone
        return ApiError(499, str(e), "client_closed_request", "client_closed_request")
    if isinstance(e, UnknownModel):
        return ApiError(404, str(e), code="model_not_found", param="model")
    if isinstance(e, ModelRemoved):
        return ApiError(404, str(e), code="model_removed", param="model")
    if isinstance(e, NotLoaded):
        return ApiError(400, str(e), code="model_not_loaded", param="model")
    if isinstance(e, NeverFits):
        return ApiError(507, str(e), "insufficient_memory", "model_too_large",
                        extra={"device": e.device, "needed_bytes": e.need, "capacity_bytes": e.capacity})
    if isinstance(e, QueueTimeout):
        return ApiError(503, str(e), "server_busy", "queue_timeout", headers={"Retry-After": "5"})
    if isinstance(e, QueueFull):  # as llama-swap (429 past a model's limit) and Ollama (503 past the server's)
        return ApiError(429 if e.scope == "model" else 503, str(e), "rate_limit_error" if e.scope == "model"
                        else "server_busy", "queue_full", headers={"Retry-After": "1"},
                        extra={"limit": e.limit, "waiting": e.waiting})
    if isinstance(e, Busy):
        return ApiError(429, str(e), "rate_limit_error", "busy", headers={"Retry-After": "5"})
    if isinstance(e, (WorkerDied, RouterClosed, Unclaimed)):
        return ApiError(503, str(e), "server_error", "unavailable", headers={"Retry-After": "1"})
    if isinstance(e, LoadFailed):
        return ApiError(500, str(e), "server_error", "load_failed")
    if isinstance(e, RequestFailed):
        if e.kind.startswith("HTTP "):  # llama.cpp's answer, through the Python API
            return ApiError(e.status, e.message, "server_error" if e.status >= 500 else "invalid_request_error")
        return ApiError(500, str(e), "server_error")
    return ApiError(500, f"{type(e).__name__}: {e}", "server_error")
