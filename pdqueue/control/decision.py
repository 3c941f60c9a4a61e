"""The planner's settings and what it answers: ``PlannerConfig``, ``Move``, ``Decision``.

``PlannerConfig``'s defaults are the planner's, wherever it runs: ``pdqueue up --adapt`` and
``pdqueue plan`` take their option defaults from it (workers/cli/common.py ``planner_options``),
so a planner built in Python and one started from the CLI decide alike."""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("reactive", "predictive")
"""The planner's policies (``PlannerConfig.mode``; the CLI's ``--mode`` choices)."""
MOVE_TIMEOUT_MIN_S = 60.0
"""The shortest time a move is waited for when ``PlannerConfig.move_timeout_s`` is not given."""


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    ttft_slo_ms: float = 4000.0
    tbt_slo_ms: float = 250.0
    mode: str = "reactive"            # "reactive" | "predictive"
    window_s: float = 30.0            # completions older than this are ignored
    min_dwell_s: float = 30.0         # a worker switched less than this ago is not moved
    cooldown_s: float = 10.0          # between decisions that move something
    # A move not applied by then is forgotten; None: ``max(MOVE_TIMEOUT_MIN_S, 3 x min_dwell_s)``
    # (a switch settles what the worker holds first, which takes longer with a longer dwell).
    move_timeout_s: float | None = None
    min_prefill: int = 0
    min_decode: int = 0
    min_colocated: int = 0
    allow_colocated: bool = True
    # reactive
    confirm: int = 2                  # consecutive observations before a side is "short"
    donor_headroom: float = 0.7       # a giving side's projected p90 must stay <= this x SLO
    backlog_high: int = 4             # queued entries per serving worker that mean "short"
    min_completions: int = 5          # fewer in the window: percentiles cannot breach
    kv_high: float = 0.9
    colocated_max_workers: int = 2    # go all-colocated only in clusters this small
    # predictive
    target_utilization: float = 0.7   # a split "fits" when every side is at most this busy
    keep_utilization: float = 0.85    # the current split is kept up to this
    min_gain: float = 0.1             # no split fits: move only if u drops by this fraction
    backlog_drain_s: float = 30.0     # queued work is spread over this in the demand
    tbt_step_frac: float = 0.8        # decode capacity: batch whose step <= this x TBT SLO
    max_batch: int = 64
    colocated_efficiency: float = 0.85
    max_moves: int = 2                # predictive: moves per decision
    default_prompt_tokens: float = 256.0  # used for queued work before any completion
    default_output_tokens: float = 64.0
    # capacity learning
    prefill_tok_s_prior: float = 250.0
    decode_base_ms_prior: float = 60.0
    decode_per_seq_ms_prior: float = 9.0
    ewma_alpha: float = 0.3
    decode_decay: float = 0.05
    min_rate_prompt_tokens: int = 16
    # elastic: per-worker TBT budgets and migrations of running decodes (elastic.py)
    elastic: bool = False
    budget_every_s: float = 10.0      # a worker's budget changes at most this often
    budget_step: float = 0.8          # tighter: x this; looser: / this
    budget_min_frac: float = 0.5      # budgets stay within [min, max] x the TBT target
    budget_max_frac: float = 2.0
    migrate_waiting: int = 2          # prompts waiting in a colocated engine that threaten its decodes
    migrate_every_s: float = 5.0      # per worker
    migrate_max: int = 8              # running decodes per migration

    def __post_init__(self) -> None:
        if self.move_timeout_s is None:
            object.__setattr__(self, "move_timeout_s", max(MOVE_TIMEOUT_MIN_S, 3 * self.min_dwell_s))
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'reactive' or 'predictive', got {self.mode!r}")
        for name in ("ttft_slo_ms", "tbt_slo_ms", "window_s", "prefill_tok_s_prior",
                     "decode_base_ms_prior", "backlog_drain_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("min_dwell_s", "cooldown_s", "move_timeout_s", "decode_per_seq_ms_prior"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0 < self.target_utilization <= self.keep_utilization:
            raise ValueError("need 0 < target_utilization <= keep_utilization")
        for name in ("donor_headroom", "ewma_alpha", "colocated_efficiency", "tbt_step_frac"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if not 0 <= self.decode_decay < 1:
            raise ValueError("decode_decay must be in [0, 1)")
        if self.confirm < 1 or self.max_moves < 1 or self.max_batch < 1:
            raise ValueError("confirm, max_moves and max_batch must be >= 1")
        if not 0 < self.budget_step < 1:
            raise ValueError("budget_step must be in (0, 1)")
        if not 0 < self.budget_min_frac <= 1 <= self.budget_max_frac:
            raise ValueError("need 0 < budget_min_frac <= 1 <= budget_max_frac")
        if self.budget_every_s < 0 or self.migrate_every_s < 0:
            raise ValueError("budget_every_s and migrate_every_s must be >= 0")
        if self.migrate_waiting < 1 or self.migrate_max < 1:
            raise ValueError("migrate_waiting and migrate_max must be >= 1")


@dataclass(frozen=True, slots=True)
class Move:
    """Switch ``worker_id`` from ``from_role`` to ``to_role``. The worker must refuse it
    unless its current role epoch is ``expected_epoch``."""
    worker_id: str
    from_role: str
    to_role: str
    expected_epoch: int

    def __str__(self) -> str:
        return f"{self.worker_id} {self.from_role} -> {self.to_role} (epoch {self.expected_epoch})"


@dataclass(frozen=True, slots=True)
class Decision:
    time: float
    counts: dict[str, int]            # workers per role once ``moves`` (and moves in flight) are done
    moves: tuple[Move, ...] = ()
    reason: str = ""
    action: str = "hold"              # move | repair | hold | wait | cooldown
    signals: dict[str, float | int | str | None] = field(default_factory=dict)
    budgets: tuple = ()               # elastic.Budget: TBT budgets to set (PlannerConfig.elastic)
    migrations: tuple = ()            # elastic.Migration: running decodes to move


__all__ = ["Decision", "Move", "PlannerConfig"]
