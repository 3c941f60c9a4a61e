"""The gateway's Prometheus metrics: vLLM's names where the meaning is the same
(``vllm:e2e_request_latency_seconds``, ``vllm:time_to_first_token_seconds``, ...), with
``role="gateway"``, and vLLM's buckets (``pdqueue.telemetry.metrics``, the one home)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdqueue.frontends import openai_compat as oai
from pdqueue.protocol import Completion
from pdqueue.telemetry.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

__all__ = ["GatewayMetrics"]


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ("role", "model_name")
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from the request's arrival at the gateway "
                             "to its last byte.", labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from the request's arrival at the gateway "
                              "to its first token sent (streaming requests).", labels, buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two streamed chunks of an "
                             "answer, at the gateway.", labels, buckets=ITL_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Requests answered in full, by finish reason.",
                               (*labels, "finished_reason"), registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests answered.", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated for the requests answered.",
                                         labels, registry=r)
        self.requests = Counter("pdqueue:gateway_requests", "HTTP requests by endpoint and status code.",
                                ("role", "endpoint", "status"), registry=r)
        self.in_flight = Gauge("pdqueue:gateway_requests_in_flight", "Completion requests being answered.",
                               ("role",), registry=r)
        self.backlog = Gauge("pdqueue:gateway_backlog", "Request backlog of the cluster at the last poll "
                             "(lag + pending of the request streams).", ("role",), registry=r)
        tenant = ("role", "tenant")
        self.tenant_requests = Counter("pdqueue:gateway_tenant_requests", "Completion requests answered, by "
                                       "tenant and status code.", (*tenant, "status"), registry=r)
        self.tenant_prompt_tokens = Counter("pdqueue:gateway_tenant_prompt_tokens", "Prompt tokens of the "
                                            "tenant's requests answered.", tenant, registry=r)
        self.tenant_generation_tokens = Counter("pdqueue:gateway_tenant_generation_tokens", "Tokens generated "
                                                "for the tenant.", tenant, registry=r)
        self.tenant_rate_limited = Counter("pdqueue:gateway_tenant_rate_limited", "Requests refused with 429 "
                                           "by the tenant's limit (requests or tokens per second).",
                                           (*tenant, "limit"), registry=r)
        self.tenant_open = Gauge("pdqueue:gateway_tenant_requests_in_flight", "The tenant's completion "
                                 "requests being answered.", tenant, registry=r)

    def finished(self, model: str, c: Completion) -> None:
        self.success.labels("gateway", model, oai.finish_reason(c.finish_reason)).inc()
        self.prompt_tokens.labels("gateway", model).inc(c.num_prompt_tokens)
        self.generation_tokens.labels("gateway", model).inc(len(c.token_ids))

    def tenant_started(self, tenant: str) -> None:
        self.tenant_open.labels("gateway", tenant).inc()

    def tenant_finished(self, tenant: str, status: int, prompt_tokens: int, generated_tokens: int) -> None:
        self.tenant_open.labels("gateway", tenant).dec()
        self.tenant_requests.labels("gateway", tenant, str(status)).inc()
        if prompt_tokens or generated_tokens:
            self.tenant_prompt_tokens.labels("gateway", tenant).inc(prompt_tokens)
            self.tenant_generation_tokens.labels("gateway", tenant).inc(generated_tokens)

    def tenant_limited(self, tenant: str, limit: str) -> None:
        self.tenant_rate_limited.labels("gateway", tenant, limit).inc()
