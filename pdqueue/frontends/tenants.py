"""Tenants of the gateway: who an API key is, its share, its rate limits and its service class.

``pdqueue serve --tenants FILE`` (TOML)::

    [tenants.chat]
    api_keys = ["sk-chat-1"]
    share = 3                  # weight of its hold on the open requests under overload
    requests_per_s = 20        # none: no limit
    tokens_per_s = 5000        # prompt + generated tokens; none: no limit
    burst_s = 2                # how many seconds of its rates it may use at once (default 1)
    service_class = "interactive"

Limits are token buckets enforced where the request enters, in each gateway process (N
gateways admit up to N times a rate). A request takes one request; tokens are charged when
its answer ends (the gateway knows a prompt's length only then) and a tenant in debt is
refused until it has paid it back. A refusal is a 429 in OpenAI's shape with
``Retry-After`` (whole seconds until the bucket allows the request). ``share``: while the
cluster's backlog is over ``--max-backlog``, a tenant under its share of the requests open
on this gateway is still admitted; one over it gets the 429. ``--api-key`` (one key, no
limits) is the tenant ``default``; with neither, every request is ``default``.
"""

from __future__ import annotations

import hashlib
import math
import time
import tomllib
from dataclasses import dataclass, field

from pdqueue.frontends.openai_compat import OpenAIError
from pdqueue.frontends.service_classes import SERVICE_CLASSES

__all__ = ["DEFAULT_TENANT", "RateLimited", "Tenant", "TenantError", "TenantState", "Tenants", "load_tenants"]

DEFAULT_TENANT = "default"
_FIELDS = {"api_keys", "share", "requests_per_s", "tokens_per_s", "burst_s", "service_class"}


class TenantError(ValueError):
    """A tenants file or option that cannot be used; the message names the place."""


@dataclass(frozen=True)
class Tenant:
    name: str
    api_keys: tuple[str, ...] = ()
    share: float = 1.0
    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    burst_s: float = 1.0
    service_class: str = "standard"


class Bucket:
    """A token bucket: ``rate`` per second, at most ``capacity``; it may go into debt."""

    def __init__(self, rate: float, capacity: float):
        self.rate, self.capacity = rate, capacity
        self.level, self.at = capacity, time.monotonic()

    def _fill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until ``need`` is there (0: now)."""
        self._fill(now)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._fill(now)
        self.level -= amount


@dataclass
class TenantState:
    """One tenant in this gateway: its buckets and the requests it has open."""
    tenant: Tenant
    requests: Bucket | None = None
    tokens: Bucket | None = None
    open: int = 0
    metrics: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        t = self.tenant
        if t.requests_per_s is not None:
            self.requests = Bucket(t.requests_per_s, max(1.0, t.requests_per_s * t.burst_s))
        if t.tokens_per_s is not None:
            self.tokens = Bucket(t.tokens_per_s, max(1.0, t.tokens_per_s * t.burst_s))

    @property
    def name(self) -> str:
        return self.tenant.name

    def started(self) -> None:
        self.open += 1
        if self.metrics is not None:
            self.metrics.tenant_started(self.name)

    def finished(self, status: int, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        """An answer of this tenant ended: its slot back, its tokens charged and counted."""
        self.open = max(0, self.open - 1)
        if self.tokens is not None:
            self.tokens.take(prompt_tokens + generated_tokens, time.monotonic())
        if self.metrics is not None:
            self.metrics.tenant_finished(self.name, status, prompt_tokens, generated_tokens)


def rate_limited(tenant: str, what: str, limit: str, wait_s: float) -> tuple[OpenAIError, int]:
    """The 429 and its Retry-After (whole seconds, at least 1)."""
    retry = max(1, math.ceil(wait_s))
    return OpenAIError(429, f"Rate limit reached for tenant {tenant!r} on {what}: limit {limit}. "
                            f"Retry after {retry} s.", "rate_limit_error", code="rate_limit_exceeded"), retry


class Tenants:
    """The tenants of one gateway, found by API key."""

    def __init__(self, tenants: list[Tenant], metrics=None):
        self.states = {t.name: TenantState(t, metrics=metrics) for t in tenants}
        self._by_key = {_digest(k): t.name for t in tenants for k in t.api_keys}
        self.open_auth = not self._by_key   # no key configured: every request is "default"
        if self.open_auth and DEFAULT_TENANT not in self.states:
            self.states[DEFAULT_TENANT] = TenantState(Tenant(DEFAULT_TENANT), metrics=metrics)

    def identify(self, authorization: str) -> TenantState | None:
        """The tenant of an ``Authorization`` header's bearer key, or None (a 401)."""
        if self.open_auth:
            return self.states[DEFAULT_TENANT]
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        name = self._by_key.get(_digest(token.strip()))
        return None if name is None else self.states[name]

    def admit(self, state: TenantState) -> None:
        """Take one request from ``state``'s limits; (OpenAIError 429, Retry-After) raised as
        ``RateLimited`` when it is over one."""
        now = time.monotonic()
        t = state.tenant
        waits = []
        if state.tokens is not None:
            waits.append((state.tokens.wait_s(min(1.0, state.tokens.capacity), now), "tokens per second",
                          f"{t.tokens_per_s:g}/s", "tokens"))
        if state.requests is not None:
            waits.append((state.requests.wait_s(1.0, now), "requests per second", f"{t.requests_per_s:g}/s",
                          "requests"))
        for wait, what, limit, kind in waits:
            if wait > 0:
                if state.metrics is not None:
                    state.metrics.tenant_limited(state.name, kind)
                raise RateLimited(*rate_limited(state.name, what, limit, wait))
        if state.requests is not None:
            state.requests.take(1.0, now)

    def exempt(self, state: TenantState) -> bool:
        """Admitted over the backlog limit: one of several tenants, under its share of the
        requests open on this gateway."""
        if len(self.states) < 2:
            return False
        total_share = sum(s.tenant.share for s in self.states.values())
        total_open = sum(s.open for s in self.states.values())
        return state.open < state.tenant.share / total_share * max(1, total_open)


class RateLimited(Exception):
    def __init__(self, error: OpenAIError, retry_after: int):
        super().__init__(error.message)
        self.error, self.retry_after = error, retry_after


def _digest(key: str) -> bytes:
    # Keys are looked up by their hash: a dict probe on the secret itself could leak it by timing.
    return hashlib.sha256(key.encode()).digest()


# ---- configuration -----------------------------------------------------------------------------

def _number(where: str, name: str, value, minimum_open: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > minimum_open:
        raise TenantError(f"{where}: {name} must be a number > {minimum_open:g}, got {value!r}")
    return float(value)


def _tenant(name: str, table, where: str) -> Tenant:
    if not isinstance(table, dict):
        raise TenantError(f"{where}: [tenants.{name}] must be a table")
    unknown = sorted(set(table) - _FIELDS)
    if unknown:
        raise TenantError(f"{where}: [tenants.{name}] has unknown field(s) {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(_FIELDS))})")
    keys = table.get("api_keys", [])
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k.strip() for k in keys):
        raise TenantError(f"{where}: [tenants.{name}] api_keys must be a non-empty list of keys")
    cls = table.get("service_class", "standard")
    if cls not in SERVICE_CLASSES:
        raise TenantError(f"{where}: [tenants.{name}] service_class must be one of {', '.join(SERVICE_CLASSES)}, "
                          f"got {cls!r}")
    rates = {n: (None if table.get(n) is None else _number(f"{where}: [tenants.{name}]", n, table[n]))
             for n in ("requests_per_s", "tokens_per_s")}
    return Tenant(name, tuple(k.strip() for k in keys), _number(f"{where}: [tenants.{name}]", "share",
                                                                table.get("share", 1)),
                  burst_s=_number(f"{where}: [tenants.{name}]", "burst_s", table.get("burst_s", 1)),
                  service_class=cls, **rates)


def load_tenants(path: str | None, api_key: str | None = None) -> list[Tenant]:
    """The tenants of ``--tenants FILE`` plus ``--api-key`` (tenant ``default``, no limits);
    TenantError with the file and field for anything wrong."""
    tenants: list[Tenant] = []
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise TenantError(f"--tenants {path}: cannot read it ({exc.strerror or exc})") from None
        except tomllib.TOMLDecodeError as exc:
            raise TenantError(f"--tenants {path}: not valid TOML ({exc})") from None
        table = data.get("tenants")
        if not isinstance(table, dict) or not table or set(data) - {"tenants"}:
            raise TenantError(f"--tenants {path}: expected [tenants.NAME] tables only "
                              "(see docs/api/gateway.md, Tenants)")
        tenants = [_tenant(name, t, f"--tenants {path}") for name, t in table.items()]
    if api_key:
        if any(t.name == DEFAULT_TENANT for t in tenants):
            raise TenantError(f"--api-key: the tenants file already has a tenant {DEFAULT_TENANT!r}; "
                              f"add the key to its api_keys instead")
        tenants.append(Tenant(DEFAULT_TENANT, (api_key,)))
    seen: dict[str, str] = {}
    for t in tenants:
        for k in t.api_keys:
            if k in seen:
                where = f"--tenants {path}" if path is not None else "--api-key"
                raise TenantError(f"{where}: the same API key is given to tenants {seen[k]!r} and {t.name!r}")
            seen[k] = t.name
    return tenants
