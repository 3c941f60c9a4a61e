"""What the planner sees: one observation of a cluster of switchable workers.

Roles (``ROLES``): ``prefill`` reads the request streams and hands off, ``decode`` reads the
handoff streams, ``colocated`` reads the request streams and does both. A worker may be
switched only if its heartbeat says ``switchable``. ``pdqueue.control.observe`` builds an
``Observation`` from Redis; times are seconds on the observation's clock (Redis's: Unix
seconds, the clock of stream entry ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from pdqueue.protocol import ROLES, Role

PREFILL, DECODE, COLOCATED = Role.PREFILL.value, Role.DECODE.value, Role.COLOCATED.value


def count_roles(roles: Iterable[str]) -> dict[str, int]:
    """Workers per role (roles outside ``ROLES`` are not counted)."""
    out = {r: 0 for r in ROLES}
    for role in roles:
        if role in out:
            out[role] += 1
    return out


@dataclass(frozen=True, slots=True)
class WorkerObs:
    """One live worker as its heartbeat describes it."""
    worker_id: str
    role: str
    role_epoch: int = 0
    switchable: bool = False
    running: int = 0
    waiting: int = 0
    backlog: int = 0                 # decode: handoffs taken, not yet admitted
    fetching: int = 0                # decode: KV fetches in flight
    kv_free: int | None = None
    kv_total: int | None = None
    node: str = ""
    incarnation: str = ""
    beat_age_s: float = 0.0
    step_ms: float | None = None     # recent engine step time at ``running``, if reported
    role_since: float | None = None  # when it took its current role, if reported
    tbt_budget_ms: float | None = None  # colocated: the TBT budget its engine runs with (None: none)
    budgetable: bool = False         # it reports a TBT budget: it takes budget commands (chunked policy)
    draining: bool = False           # stopping or switching: takes no migrated decodes
    takes_prompts: bool = False      # decode: prefills prompts placed on it in its spare time

    @property
    def kv_used_frac(self) -> float | None:
        if not self.kv_total or self.kv_free is None:
            return None
        return max(0.0, min(1.0, (self.kv_total - self.kv_free) / self.kv_total))

    @property
    def busy(self) -> int:
        return self.running + self.waiting + self.backlog + self.fetching


@dataclass(frozen=True, slots=True)
class CompletionObs:
    """One entry of the ``done`` stream (times in ms, ``finish_time`` in s)."""
    finish_time: float
    ttft_ms: float
    tbt_p50_ms: float = 0.0
    tbt_max_ms: float = 0.0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    queue_ms: float = 0.0
    e2e_ms: float = 0.0
    transfer_path: str = ""          # "local" for colocated
    prefill_worker: str = ""
    decode_worker: str = ""
    finish_reason: str = ""
    request_id: str = ""

    @property
    def start_time(self) -> float:
        return self.finish_time - self.e2e_ms / 1000.0

    @property
    def tbt_ms(self) -> float | None:
        """Estimate of this request's p90 gap between tokens (None with fewer than two
        tokens): its largest gap when it had at most 9 gaps (then the nearest-rank p90 is
        the largest), else its median gap (a lower bound)."""
        gaps = self.num_output_tokens - 1
        if gaps < 1:
            return None
        return self.tbt_max_ms if gaps <= 9 else self.tbt_p50_ms


@dataclass(frozen=True, slots=True)
class Observation:
    """What the planner sees at ``time``."""
    time: float
    workers: tuple[WorkerObs, ...] = ()
    request_lag: int = 0             # request streams, group prefill: not yet delivered
    request_pending: int = 0         # delivered, not acknowledged (being prefilled)
    handoff_lag: int = 0             # handoff streams, group decode
    handoff_pending: int = 0
    completions: tuple[CompletionObs, ...] = ()
    window_s: float = 60.0           # how far back ``completions`` were read

    @property
    def request_backlog(self) -> int:
        return self.request_lag + self.request_pending

    @property
    def handoff_backlog(self) -> int:
        return self.handoff_lag + self.handoff_pending

    @property
    def queued_requests(self) -> int:
        """Requests nobody has started: stream lag + waiting in prefill/colocated engines."""
        return self.request_lag + sum(w.waiting for w in self.workers
                                      if w.role in (PREFILL, COLOCATED))

    @property
    def queued_handoffs(self) -> int:
        """Handoffs nobody is decoding yet: stream lag + decode workers' backlog/waiting."""
        return self.handoff_lag + sum(w.backlog + w.waiting for w in self.workers
                                      if w.role == DECODE)

    def counts(self) -> dict[str, int]:
        """Workers per role as reported (other roles are not counted)."""
        return count_roles(w.role for w in self.workers)

    def worker(self, worker_id: str) -> WorkerObs | None:
        for w in self.workers:
            if w.worker_id == worker_id:
                return w
        return None


__all__ = ["COLOCATED", "DECODE", "PREFILL", "ROLES", "CompletionObs", "Observation", "WorkerObs",
           "count_roles"]
