"""The gateway's HTTP errors, all in OpenAI's shape (``openai_compat.OpenAIError``)."""

from __future__ import annotations

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdqueue.client import RequestFailed
from pdqueue.frontends import openai_compat as oai
from pdqueue.frontends.openai_compat import OpenAIError

__all__ = ["DRAINING", "RETRY_AFTER_S", "STOPPED", "error", "failure", "redis_failure", "retry_after", "routing_error",
           "tenant_route", "timeout", "unavailable"]

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


def redis_failure(exc: Exception, api: str) -> OpenAIError:
    """A Redis error of one of the gateway's stored APIs (``api``: "Batch API", "Responses API")
    as the 503 it answers; a refused command (NOPERM) says which ACL user the gateway needs."""
    if isinstance(exc, redis.ResponseError):   # NOPERM: an ACL user made before the API had its keys
        return unavailable(f"Redis refused the {api}'s command ({exc}): give the gateway the `gateway` user of a "
                           f"current `pdqueue acl` (or the admin user)")
    return unavailable(f"cannot reach the cluster's Redis: {exc}")


def tenant_route(gw, endpoint: str, api: str, handler):
    """A route of a stored API: ``handler(request, tenant name)``, its OpenAI errors and Redis
    failures answered in OpenAI's shape, the answer counted under ``endpoint``."""
    async def call(request: Request) -> Response:
        try:
            response = await handler(request, gw.admission.tenant_of(request).name)
        except OpenAIError as exc:
            response = error(exc)
        except (redis.RedisError, OSError) as exc:
            response = error(redis_failure(exc, api))
        return gw.count(endpoint, response)
    return call
