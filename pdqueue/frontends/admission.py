"""Whether the gateway takes a request, checked before anything is submitted
(``Gateway.admission``): no I/O but a poll of the cluster view on the path to an error.

- ``tenant_of``: the tenant of the request's API key (``Authorization: Bearer``); 401
  otherwise (tenants.py).
- ``admit``: the model the request names (or the first served) and its info, answered from
  ``ClusterView`` (polled in the background, at no round trip): 429 while the cluster's
  backlog is over ``max_backlog`` (a tenant under its share of the open requests is still
  admitted), 503 when Redis cannot be reached, 404 for a model not served. No worker to take
  the request is no reason to refuse it: it is admitted against the models last seen served
  and waits in the queue (capacity.py).
- ``admit_fresh``: ``admit``, with a 503 or 404 that a view older than ``FRESH_S`` gives
  checked again against a new poll first.

Used by the completions, chat, Responses and Batch routes alike (gateway.py, responses.py,
batch_api.py). Its own object because the checks are their own job: the routes only ask.
"""

from __future__ import annotations

import time

from starlette.requests import Request

from pdqueue.frontends import http_errors as errs
from pdqueue.frontends import openai_compat as oai
from pdqueue.frontends.capacity import models_meanwhile
from pdqueue.frontends.cluster_view import ClusterView
from pdqueue.frontends.openai_compat import OpenAIError
from pdqueue.frontends.tenants import RateLimited, Tenants, TenantState

FRESH_S = 0.05   # a view this old is good enough to answer 503/404 without polling again


class Admission:
    def __init__(self, config, view: ClusterView, tenants: Tenants):
        """``config``: the gateway's (``GatewayConfig``: ``max_backlog``, ``capacity_wait_s``)."""
        self.config = config
        self.view = view
        self.tenants = tenants

    def tenant_of(self, request: Request) -> TenantState:
        """The tenant of the request's API key; OpenAIError 401 for none."""
        tenant = self.tenants.identify(request.headers.get("authorization", ""))
        if tenant is None:
            raise self._unauthorized()
        request.state.tenant = tenant
        return tenant

    def _unauthorized(self) -> OpenAIError:
        return OpenAIError(401, "Incorrect API key provided (send it as 'Authorization: Bearer KEY').",
                           "invalid_request_error", code="invalid_api_key")

    async def admit_fresh(self, parsed: oai.Parsed, tenant: TenantState) -> tuple[str, dict]:
        """``admit``; a 503 or 404 that a view older than ``FRESH_S`` gives is checked again
        against a new poll first (workers that registered since, as right after ``up``'s
        "ready:"): one round trip, on a path that is otherwise an error."""
        try:
            return self.admit(parsed, tenant)
        except OpenAIError as exc:
            if exc.status not in (503, 404) or time.monotonic() - self.view.polled_at < FRESH_S:
                raise
        await self.view.refresh()
        return self.admit(parsed, tenant)

    def admit(self, parsed: oai.Parsed, tenant: TenantState) -> tuple[str, dict]:
        """The model name and its info; OpenAIError 429, 503 or 404 otherwise. Over the
        backlog limit, a tenant under its share of the open requests is still admitted."""
        view = self.view
        limit = self.config.max_backlog
        if limit is not None and view.backlog_now() > limit and not self.tenants.exempt(tenant):
            raise RateLimited(OpenAIError(429, f"the cluster's request backlog ({view.backlog_now()}) is over the "
                                               f"limit ({limit}); retry later", "rate_limit_error",
                                          code="rate_limit_exceeded"), retry_after=1)   # polled every 0.25 s
        if not view.ok:
            raise errs.unavailable("the gateway cannot reach the cluster's Redis")
        models = view.models()
        if not view.serving():   # the request will wait for capacity (capacity.py)
            models = models_meanwhile(view, parsed.model, self.config.capacity_wait_s)
        name = parsed.model
        if name is None:
            if not models:
                raise errs.unavailable("no model is served")
            name = sorted(models)[0]
        if name not in models:
            raise OpenAIError(404, f"The model `{name}` does not exist. Served: {', '.join(sorted(models))}.",
                              "invalid_request_error", "model", "model_not_found")
        return name, models[name]
