"""The gateway's HTTP errors, all in OpenAI's shape (``openai_compat.OpenAIError``)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from pdqueue.client import RequestFailed
from pdqueue.frontends import openai_compat as oai
from pdqueue.frontends.openai_compat import OpenAIError

__all__ = ["DRAINING", "RETRY_AFTER_S", "STOPPED", "error", "failure", "retry_after", "routing_error", "timeout",
           "unavailable"]

RETRY_AFTER_S = 5   # what a stopping gateway's 503 tells clients to wait (another gateway, or this one restarted)
DRAINING = ("the gateway is stopping: it finishes the answers it has and takes no new request; retry on "
            "another gateway or later")
STOPPED = "the gateway stopped before the answer was complete; its request is cancelled"


def error(exc: OpenAIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def failure(exc: RequestFailed) -> OpenAIError:
    return oai.worker_error(exc.code, exc.reason)


def timeout(timeout_s: float | None) -> OpenAIError:
    return OpenAIError(504, f"no complete answer within {timeout_s:g} s", "timeout_error", code="timeout")


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, "server_error", code="service_unavailable")


def retry_after(headers: dict, seconds: int = RETRY_AFTER_S) -> dict:
    # "close": a client's next try opens a new connection, which a load balancer can send elsewhere.
    return {**headers, "retry-after": str(seconds), "connection": "close"}


def routing_error(method: str, path: str, exc, served: list[str]) -> OpenAIError:
    """Starlette's 404 (no route) and 405 (a route, another method), in OpenAI's shape."""
    if exc.status_code == 404:
        return OpenAIError(404, f"Invalid URL ({method} {path}); this server serves {', '.join(served)}",
                           code="unknown_url")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return OpenAIError(405, f"{method} is not allowed on {path} (allowed: {allowed})", code="method_not_allowed")
    return OpenAIError(exc.status_code, str(exc.detail))
