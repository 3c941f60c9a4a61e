"""The planner: how many workers of each role a cluster of switchable workers should run,
so that the prefill:decode split follows the load. Observations in, decisions and their
reasons out; no I/O, no clock (time comes from the observation), standard library only.
``pdqueue.control.observe.observe`` builds an ``Observation`` from Redis; whoever acts on a
``Decision`` (the actuator) is someone else.

Roles (``ROLES``): ``prefill`` (reads the request streams, hands off), ``decode`` (reads
the handoff streams), ``colocated`` (reads the request streams and does both, like a plain
engine). A worker may be switched only if its heartbeat says ``switchable``.

Inputs (``Observation``)
    time (s), the live workers (``WorkerObs``: role, ``role_epoch``, ``switchable``, load),
    the request streams' lag/pending (group ``prefill``), the handoff streams' lag/pending
    (group ``decode``), and the completions of the recent window (``CompletionObs``).
    Derived: ``queued_requests`` (request lag + what prefill/colocated engines hold
    waiting) and ``queued_handoffs`` (handoff lag + what decode workers took but have not
    admitted or scheduled).

Signals (computed per decision from the window, ``PlannerConfig.window_s``)
    TTFT p90 over completions; TBT p90 over completions of an estimate of each request's
    p90 gap (exact, its largest gap, when it had at most 9 gaps; its median gap otherwise,
    a lower bound); prompt and output tokens/s over the active part of the window.
    The percentiles use only completions that finished after the last role change the
    planner saw (a window still full of the old split's TTFTs would otherwise cause a
    second move for the same problem), and need ``min_completions`` samples before they
    can declare a breach; the queue signals need none.

Outputs (``Decision``)
    ``counts`` (role -> workers once the moves are done), ``moves`` (``Move(worker_id,
    from_role, to_role, expected_epoch)``), ``action`` (``move``, ``repair``, ``hold``,
    ``wait``, ``cooldown``), ``reason`` (one sentence with the numbers that decided) and
    ``signals`` (the same numbers as a dict).

Hard rules (tested)
    - Nobody left to serve a backlog: some prefill or colocated worker must remain (the
      requests need one); if a prefill worker remains, or the handoff streams hold
      entries, some decode worker must remain. Several moves in one decision are checked
      in every order they might complete in (every subset applied).
    - ``min_prefill``/``min_decode``/``min_colocated`` are kept.
    - Only ``switchable`` workers are moved; at most one move per decision in reactive
      mode (``max_moves`` in predictive mode).
    - A worker switched less than ``min_dwell_s`` ago (by this planner, counted from when
      the move was issued and again from when it is seen applied; or by anyone: a changed
      ``role_epoch`` counts) is not moved. A worker seen for the first time is free to
      move unless its heartbeat reports when it took its role (``role_since``).
    - No moves within ``cooldown_s`` of the last decision that moved something; holds do
      not restart the cooldown. While a move is in flight (issued, and the worker still
      reports the epoch it names) nothing else is decided; a move not applied within
      ``move_timeout_s`` (refused as stale, lost, ...) is forgotten, as is one whose
      worker disappears or restarts. ``move_refused`` forgets one at once.
    - A move names the ``role_epoch`` the worker last reported, so a worker whose epoch
      has moved on refuses a stale command.
    - A state that already breaks a rule (the prefill worker died, ...) is repaired first,
      with one move, within the same dwell/cooldown limits.

Reactive mode (Dynamo's "SLO breaches and backlog, one step at a time")
    Prefill is short when TTFT p90 > SLO, or when the queued requests are at least
    ``backlog_high`` per prefill-capable worker and not shrinking since the last
    observation. Decode is short when TBT p90 > SLO, or the queued handoffs are at least
    ``backlog_high`` per decode worker and not shrinking, or decode KV use is at least
    ``kv_high`` with handoffs waiting. A side counts as short only after ``confirm``
    consecutive observations say so (the streaks restart after each move or settled
    move). Then:
    - prefill short -> one decode -> prefill, if decode can spare one: at least two decode
      workers, fewer handoffs queued than decode workers, KV under ``kv_high``, and the
      TBT p90 projected with one decode worker fewer (the measured step-time model: each
      remaining worker takes its share of the running sequences) at most
      ``donor_headroom`` x SLO;
    - decode short -> one prefill -> decode, if prefill can spare one: at least two
      prefill-capable workers, fewer requests queued than those, and the TTFT p90 scaled
      by k/(k-1) at most ``donor_headroom`` x SLO;
    - both short -> hold ("overloaded: add workers"); neither -> hold.
    The asymmetry is the hysteresis: a side gets a worker at the SLO, but gives one only
    when its projected p90 stays at 70 % of its SLO, so borderline observations cannot
    flip a worker back and forth, and ``confirm`` filters single noisy windows.

    Colocated, from the measurements on 2 cores with SmolLM2: with 25 % long documents at
    2 req/s, 1 prefill + 1 decode had the best goodput (1.88 req/s against 1.06/1.31 for
    2 colocated; TTFT p90 2.9 s was within the 4 s SLO and colocated broke TBT p90), but
    with 50 % documents at 1 req/s the single prefill worker saturated (TTFT p90 5.1 s)
    and 2 colocated won (0.84 against 0.72). So: when prefill is short, the last decode
    worker cannot be spared (one decode worker), decode is within its SLO (TBT p90 <= SLO,
    not short in this observation, no handoffs queued: the measured disaggregated TBT p90
    was 201 ms there, colocated 175 ms) and the cluster has at most
    ``colocated_max_workers`` workers (default 2: what was measured; one decode worker in
    a big cluster wastes little), the planner goes all-colocated. And when a cluster with
    colocated workers breaks TBT (a prefill-first engine stalls its decodes for whole
    prompts) it goes back: with no decode worker, and if TTFT would hold with one
    prefill-capable worker fewer, one switchable colocated worker -> decode and the
    others -> prefill; with a decode worker that has nothing queued, the switchable
    colocated workers -> prefill (the prefill-capable count stays); with busy decode
    workers, one colocated worker -> decode. Transitions of several moves are made one
    move per decision, in the only order that keeps the hard rules (1P+1D -> 1C+1D -> 2C:
    prefill first, then the decode worker once its handoffs are drained; 2C -> 1C+1D ->
    1P+1D); a transition pauses while the opposite side is short and is abandoned once
    that is confirmed. On the measured numbers the planner stays disaggregated at 25 %
    documents and goes colocated at 50 %; going back from 2C needs colocated TBT p90 over
    250 ms with TTFT p90 under 1.4 s (2 x 1.4 s <= 70 % of 4 s), which the 25 % case at
    2 req/s met (282 and 1357 ms).

Predictive mode (Dynamo's "demand over measured capacity")
    Demand: prompt and output tokens/s over the window, plus the queued requests and
    handoffs (times the mean prompt/output length) spread over ``backlog_drain_s``.
    Capacity (learned, per worker, see ``Capacity``): prefill tokens/s; decode tokens/s
    at the largest batch whose predicted step time stays under ``tbt_step_frac`` x TBT SLO
    (capped at ``max_batch``); a colocated worker does ``colocated_efficiency`` of a
    dedicated one's work. For each candidate split of the switchable workers (every
    prefill/decode split, and all-colocated) the utilization u is the busiest side's
    demand/capacity, with requests shared between prefill and colocated workers as evenly
    as possible. Rules, in order (hysteresis band ``target_utilization`` <= u <=
    ``keep_utilization``):
    1. a disaggregated current split with u <= keep_utilization is kept;
    2. with colocated workers, go back to a disaggregated split that fits (u <=
       target_utilization), since disaggregation gave the shorter TBT tail when it fits;
    3. a current split with colocated workers and u <= keep_utilization is kept;
    4. otherwise a disaggregated split that fits, else all-colocated if it fits (among
       several: the fewest moves, then the lowest u); if none fits, the lowest u if it
       beats the current one by ``min_gain``, else hold ("overloaded: add workers").
    Non-switchable workers keep their roles in every candidate. The model does not
    predict colocated TBT (prefill stalls); ``colocated_efficiency`` and the preference
    for disaggregation stand in for it.
    Moves toward the target are issued up to ``max_moves`` per decision, in an order that
    keeps the hard rules in every subset.

Capacity learning (both modes, so a switch to predictive starts informed)
    Each completion is used once. Prefill tokens/s per worker: per observation the p90 of
    the new completions' ``num_prompt_tokens / prefill_ms`` (prompts of at least 16
    tokens, from prefill workers when there are any, else colocated ones: prefill_ms runs
    from the worker reading the request to its first token, so it includes queueing
    inside the worker and the upper quantile is closest to the bare speed); when requests
    are queued (the prefill side is saturated) the window's prompt throughput per
    prefill-capable worker is also a sample, and the larger wins. The first sample
    replaces the prior; later ones are folded in with ``ewma_alpha``. Decode step time =
    ``base + per_seq x batch``: points (batch, step ms) come from a decode worker's
    heartbeat ``step_ms`` at its ``running`` (if the worker reports it) or else from new
    completions' median gap at their decode worker's current ``running``; the points decay
    by ``decode_decay`` per observation. With enough spread in batch sizes (variance >= 4)
    both parameters are fitted; otherwise the prior's shape is scaled to the data.

Time: every time is seconds on the observation's clock (``observe`` uses Redis's clock:
Unix seconds, the same clock as stream entry ids).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Mapping, Sequence

PREFILL = "prefill"
DECODE = "decode"
COLOCATED = "colocated"
ROLES = (PREFILL, DECODE, COLOCATED)


# ---------------------------------------------------------------------------------------
# Observations
# ---------------------------------------------------------------------------------------

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
        return _count(w.role for w in self.workers)

    def worker(self, worker_id: str) -> WorkerObs | None:
        for w in self.workers:
            if w.worker_id == worker_id:
                return w
        return None


# ---------------------------------------------------------------------------------------
# Configuration, decisions, capacity
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PlannerConfig:
    ttft_slo_ms: float = 4000.0
    tbt_slo_ms: float = 250.0
    mode: str = "reactive"            # "reactive" | "predictive"
    window_s: float = 60.0            # completions older than this are ignored
    min_dwell_s: float = 60.0         # a worker switched less than this ago is not moved
    cooldown_s: float = 20.0          # between decisions that move something
    move_timeout_s: float = 60.0      # a move not applied by then is forgotten
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

    def __post_init__(self) -> None:
        if self.mode not in ("reactive", "predictive"):
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


@dataclass(frozen=True, slots=True)
class Capacity:
    """Measured (or prior) capacity of one worker per role."""
    prefill_tok_s: float
    decode_base_ms: float
    decode_per_seq_ms: float
    prefill_samples: int = 0
    decode_samples: int = 0

    def step_ms(self, batch: float) -> float:
        """Predicted decode step time (= gap between tokens) at ``batch`` sequences."""
        return self.decode_base_ms + self.decode_per_seq_ms * max(0.0, batch)

    def decode_batch(self, step_limit_ms: float, max_batch: int) -> int:
        """The largest batch whose step stays within ``step_limit_ms`` (0 if none)."""
        if self.decode_per_seq_ms <= 0:
            return max_batch if self.step_ms(1) <= step_limit_ms else 0
        b = math.floor((step_limit_ms - self.decode_base_ms) / self.decode_per_seq_ms + 1e-9)
        return max(0, min(max_batch, b))

    def decode_tok_s(self, step_limit_ms: float, max_batch: int) -> float:
        """Output tokens/s of one decode worker at that batch (at batch 1 if even batch 1
        is over the limit: then the SLO cannot be met, only the throughput counts)."""
        b = max(1, self.decode_batch(step_limit_ms, max_batch))
        return b * 1000.0 / max(1e-6, self.step_ms(b))


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------

def _count(roles) -> dict[str, int]:
    out = {r: 0 for r in ROLES}
    for role in roles:
        if role in out:
            out[role] += 1
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def _fmt_counts(c: Mapping[str, int]) -> str:
    parts = [f"{c[PREFILL]}P", f"{c[DECODE]}D"]
    if c[COLOCATED]:
        parts.append(f"{c[COLOCATED]}C")
    return "+".join(parts)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ms"


def violations(counts: Mapping[str, int], handoff_backlog: int,
               config: PlannerConfig | None = None) -> list[str]:
    """The hard rules ``counts`` would break (empty when it is a valid state)."""
    p, d, c = counts[PREFILL], counts[DECODE], counts[COLOCATED]
    out = []
    if p + d + c == 0:
        return out
    if p + c == 0:
        out.append("no prefill or colocated worker would read the requests")
    if d == 0 and p > 0:
        out.append("prefill workers without a decode worker")
    elif d == 0 and handoff_backlog > 0:
        out.append(f"{handoff_backlog} handoffs without a decode worker")
    if config is not None:
        for role, least in ((PREFILL, config.min_prefill), (DECODE, config.min_decode),
                            (COLOCATED, config.min_colocated)):
            if counts[role] < least:
                out.append(f"fewer than {least} {role} worker(s)")
    return out


@dataclass(frozen=True, slots=True)
class _Metrics:
    counts: dict
    total: int
    completions: int
    measured: int                     # completions since the last role change (percentiles)
    ttft_p90_ms: float | None
    tbt_p90_ms: float | None
    tbt_samples: int
    prompt_tok_s: float
    output_tok_s: float
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    span_s: float
    queued_requests: int
    queued_handoffs: int
    handoff_backlog: int
    decode_running: int
    decode_kv_used: float | None

    def summary(self, config: PlannerConfig) -> str:
        return (f"TTFT p90 {_ms(self.ttft_p90_ms)} (SLO {config.ttft_slo_ms:.0f} ms), "
                f"TBT p90 {_ms(self.tbt_p90_ms)} (SLO {config.tbt_slo_ms:.0f} ms), "
                f"{self.queued_requests} requests and {self.queued_handoffs} handoffs queued, "
                f"{self.completions} completions in {self.span_s:.0f} s"
                + (f" ({self.measured} since the last role change)"
                   if self.measured != self.completions else ""))

    def as_dict(self) -> dict:
        return {"ttft_p90_ms": self.ttft_p90_ms, "tbt_p90_ms": self.tbt_p90_ms,
                "completions": self.completions, "measured": self.measured, "prompt_tok_s": round(self.prompt_tok_s, 3),
                "output_tok_s": round(self.output_tok_s, 3), "queued_requests": self.queued_requests,
                "queued_handoffs": self.queued_handoffs, "handoff_backlog": self.handoff_backlog,
                "decode_running": self.decode_running, "decode_kv_used": self.decode_kv_used,
                "span_s": round(self.span_s, 3)}


# ---------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------

class Planner:
    """Decides role counts and moves from observations (see the module docstring).

    State kept between calls (all driven by observation time): the last time it moved
    something, each worker's last switch, the moves in flight, the "short" streaks, the
    last queue sizes, a multi-move transition in progress, and the capacity estimates.
    """

    def __init__(self, config: PlannerConfig | None = None):
        self.config = config or PlannerConfig()
        self._last_move_time: float | None = None
        self._last_switch: dict[str, float] = {}
        self._known: dict[str, tuple[str, int, str]] = {}   # id -> (incarnation, epoch, role)
        self._pending: dict[str, tuple[Move, float]] = {}   # id -> (move, issued at)
        self._streak = {PREFILL: 0, DECODE: 0}
        self._prev_queues: tuple[int, int] | None = None
        self._route: tuple[dict, str, str] | None = None     # (target counts, direction, why)
        self._notes: list[str] = []
        self._last_change: float | None = None                # a role change was last seen
        # capacity
        self._prefill_tok_s = self.config.prefill_tok_s_prior
        self._prefill_samples = 0
        self._dsum = [0.0] * 5                                # S0, Sx, Sy, Sxx, Sxy (decayed)
        self._decode_samples = 0
        self._seen: dict[str, float] = {}

    # ---- public --------------------------------------------------------------------------
    @property
    def pending(self) -> dict[str, Move]:
        """Moves issued and not yet seen applied, by worker id."""
        return {wid: move for wid, (move, _t) in self._pending.items()}

    @property
    def capacity(self) -> Capacity:
        base, per_seq = self._decode_fit()
        return Capacity(self._prefill_tok_s, base, per_seq, self._prefill_samples,
                        self._decode_samples)

    def last_switch(self, worker_id: str) -> float | None:
        return self._last_switch.get(worker_id)

    def move_refused(self, worker_id: str) -> None:
        """The actuator learned that the move in flight for ``worker_id`` failed or was
        refused: forget it now instead of waiting for ``move_timeout_s``. The dwell it
        started stays."""
        self._pending.pop(worker_id, None)

    def decide(self, obs: Observation) -> Decision:
        cfg = self.config
        self._notes = []
        self._track_workers(obs)
        completions = tuple(c for c in obs.completions if c.finish_time >= obs.time - cfg.window_s)
        counts = self._effective_counts(obs)
        self._learn(obs, completions, counts)
        m = self._metrics(obs, completions, counts)
        short_p, short_d = self._shortages(m)
        self._streak[PREFILL] = self._streak[PREFILL] + 1 if short_p else 0
        self._streak[DECODE] = self._streak[DECODE] + 1 if short_d else 0
        self._prev_queues = (m.queued_requests, m.queued_handoffs)
        signals = m.as_dict() | {"prefill_streak": self._streak[PREFILL],
                                 "decode_streak": self._streak[DECODE]}

        if self._pending:
            flight = ", ".join(str(mv) for mv, _t in self._pending.values())
            return self._decision(obs, counts, (), "wait",
                                  f"waiting for {flight} to be applied; {m.summary(cfg)}", signals)
        if self._last_move_time is not None and obs.time - self._last_move_time < cfg.cooldown_s:
            return self._decision(
                obs, counts, (), "cooldown",
                f"cooldown: last move {obs.time - self._last_move_time:.0f} s ago < "
                f"{cfg.cooldown_s:.0f} s; {m.summary(cfg)}", signals)
        broken = violations(counts, m.handoff_backlog, cfg)
        if broken:
            return self._repair(obs, counts, m, broken, signals)
        if cfg.mode == "predictive":
            return self._predictive(obs, counts, m, signals)
        return self._reactive(obs, counts, m, short_p, short_d, signals)

    # ---- bookkeeping ---------------------------------------------------------------------
    def _track_workers(self, obs: Observation) -> None:
        now = obs.time
        live = {w.worker_id: w for w in obs.workers}
        resolved = False
        for wid, (move, issued) in list(self._pending.items()):
            w = live.get(wid)
            known = self._known.get(wid)
            if w is None:
                self._notes.append(f"{wid} disappeared before its move applied")
                del self._pending[wid]
            elif known is not None and w.incarnation != known[0]:
                self._notes.append(f"{wid} restarted before its move applied")
                del self._pending[wid]
            elif w.role_epoch != move.expected_epoch or w.role == move.to_role:
                del self._pending[wid]
                resolved = True
                self._last_change = now
            elif now - issued > self.config.move_timeout_s:
                self._notes.append(f"move {move} not applied in {now - issued:.0f} s: forgotten")
                del self._pending[wid]
        for wid, w in live.items():
            known = self._known.get(wid)
            if known is not None and known[0] == w.incarnation and (
                    known[1] != w.role_epoch or known[2] != w.role):
                # switched (by us or anyone): the dwell starts now, or when it says it did
                since = w.role_since if w.role_since is not None else now
                self._last_switch[wid] = max(self._last_switch.get(wid, since), since)
                self._last_change = now
            elif (known is None or known[0] != w.incarnation) and w.role_since is not None:
                self._last_switch[wid] = w.role_since
            self._known[wid] = (w.incarnation, w.role_epoch, w.role)
        for wid in [wid for wid in self._known if wid not in live]:
            del self._known[wid]
        for wid in [wid for wid, t in self._last_switch.items()
                    if wid not in live and now - t > self.config.min_dwell_s]:
            del self._last_switch[wid]
        if resolved:
            self._streak = {PREFILL: 0, DECODE: 0}

    def _effective_role(self, w: WorkerObs) -> str:
        pending = self._pending.get(w.worker_id)
        return pending[0].to_role if pending else w.role

    def _effective_counts(self, obs: Observation) -> dict[str, int]:
        return _count(self._effective_role(w) for w in obs.workers)

    def _dwelling(self, w: WorkerObs, now: float) -> float | None:
        """Seconds since its last switch if that is under ``min_dwell_s``, else None."""
        t = self._last_switch.get(w.worker_id)
        if t is not None and now - t < self.config.min_dwell_s:
            return max(0.0, now - t)
        return None

    # ---- signals -------------------------------------------------------------------------
    def _metrics(self, obs: Observation, completions: tuple[CompletionObs, ...],
                 counts: dict[str, int]) -> _Metrics:
        cfg = self.config
        # percentiles only from what finished under the current roles
        since = self._last_change if self._last_change is not None else -math.inf
        recent = [c for c in completions if c.finish_time >= since]
        ttft = [c.ttft_ms for c in recent if c.num_output_tokens > 0]
        tbt = [t for t in (c.tbt_ms for c in recent) if t is not None]
        if completions:
            first = min(c.start_time for c in completions)
            span = max(1.0, min(cfg.window_s, obs.time - first))
        else:
            span = cfg.window_s
        prompt = sum(c.num_prompt_tokens for c in completions)
        output = sum(c.num_output_tokens for c in completions)
        decoders = [w for w in obs.workers if w.role == DECODE]
        kv = [f for f in (w.kv_used_frac for w in decoders) if f is not None]
        n = len(completions)
        return _Metrics(
            counts=counts, total=sum(counts.values()), completions=n, measured=len(ttft),
            ttft_p90_ms=percentile(ttft, 90), tbt_p90_ms=percentile(tbt, 90),
            tbt_samples=len(tbt), prompt_tok_s=prompt / span, output_tok_s=output / span,
            mean_prompt_tokens=prompt / n if n else None,
            mean_output_tokens=output / n if n else None, span_s=span,
            queued_requests=obs.queued_requests, queued_handoffs=obs.queued_handoffs,
            handoff_backlog=obs.handoff_backlog,
            decode_running=sum(w.running for w in decoders),
            decode_kv_used=max(kv) if kv else None)

    def _shortages(self, m: _Metrics) -> tuple[list[str], list[str]]:
        """Why each side is short in this observation (empty lists: it is not)."""
        cfg = self.config
        c = m.counts
        prev_req, prev_hand = self._prev_queues if self._prev_queues else (0, 0)
        short_p, short_d = [], []
        if m.measured >= cfg.min_completions and m.ttft_p90_ms is not None \
                and m.ttft_p90_ms > cfg.ttft_slo_ms:
            short_p.append(f"TTFT p90 {m.ttft_p90_ms:.0f} ms > {cfg.ttft_slo_ms:.0f} ms SLO")
        serving = max(1, c[PREFILL] + c[COLOCATED])
        if m.queued_requests >= cfg.backlog_high * serving and m.queued_requests >= prev_req:
            short_p.append(f"{m.queued_requests} requests queued (>= {cfg.backlog_high} per "
                           f"prefill-capable worker, was {prev_req})")
        if m.tbt_samples >= cfg.min_completions and m.tbt_p90_ms is not None \
                and m.tbt_p90_ms > cfg.tbt_slo_ms:
            short_d.append(f"TBT p90 {m.tbt_p90_ms:.0f} ms > {cfg.tbt_slo_ms:.0f} ms SLO")
        serving = max(1, c[DECODE])
        if c[DECODE] and m.queued_handoffs >= cfg.backlog_high * serving \
                and m.queued_handoffs >= prev_hand:
            short_d.append(f"{m.queued_handoffs} handoffs queued (>= {cfg.backlog_high} per "
                           f"decode worker, was {prev_hand})")
        if m.decode_kv_used is not None and m.decode_kv_used >= cfg.kv_high and m.queued_handoffs:
            short_d.append(f"decode KV {m.decode_kv_used:.0%} used with "
                           f"{m.queued_handoffs} handoffs waiting")
        return short_p, short_d

    def _decode_spare(self, m: _Metrics) -> tuple[bool, str]:
        """Can decode give a worker to prefill? (ok, the numbers)"""
        cfg = self.config
        d = m.counts[DECODE]
        if d - 1 < max(1, cfg.min_decode):
            return False, f"only {d} decode worker(s)"
        if m.queued_handoffs >= d:
            return False, f"{m.queued_handoffs} handoffs queued for {d} decode workers"
        if m.decode_kv_used is not None and m.decode_kv_used >= cfg.kv_high:
            return False, f"decode KV {m.decode_kv_used:.0%} used"
        cap = self.capacity
        if m.tbt_samples >= cfg.min_completions and m.tbt_p90_ms is not None:
            now_tbt, label = m.tbt_p90_ms, "TBT p90"
        else:
            now_tbt, label = cap.step_ms(m.decode_running / d), "predicted step"
        projected = now_tbt + cap.decode_per_seq_ms * m.decode_running * (1 / (d - 1) - 1 / d)
        limit = cfg.donor_headroom * cfg.tbt_slo_ms
        text = (f"decode {label} {now_tbt:.0f} ms -> {projected:.0f} ms projected with "
                f"{d - 1} decode worker(s), {m.decode_running} running (limit {limit:.0f} ms)")
        return projected <= limit, text

    def _prefill_spare(self, m: _Metrics, giver: str) -> tuple[bool, str]:
        """Can the prefill-capable side (prefill + colocated) lose one ``giver`` worker?"""
        cfg = self.config
        k = m.counts[PREFILL] + m.counts[COLOCATED]
        least = cfg.min_prefill if giver == PREFILL else cfg.min_colocated
        if k < 2 or m.counts[giver] - 1 < least:
            return False, f"only {k} prefill-capable worker(s)"
        if m.queued_requests >= k:
            return False, f"{m.queued_requests} requests queued for {k} prefill-capable workers"
        limit = cfg.donor_headroom * cfg.ttft_slo_ms
        if m.measured < cfg.min_completions or m.ttft_p90_ms is None:
            return True, f"TTFT not measured, {m.queued_requests} requests queued"
        projected = m.ttft_p90_ms * k / (k - 1)
        return projected <= limit, (f"TTFT p90 {m.ttft_p90_ms:.0f} ms -> {projected:.0f} ms "
                                    f"projected with {k - 1} prefill-capable worker(s) "
                                    f"(limit {limit:.0f} ms)")

    # ---- capacity learning ---------------------------------------------------------------
    def _learn(self, obs: Observation, completions: tuple[CompletionObs, ...],
               counts: dict[str, int]) -> None:
        cfg = self.config
        new = []
        for c in completions:
            key = c.request_id or f"{c.finish_time:.3f}:{c.ttft_ms:.3f}:{c.e2e_ms:.3f}"
            if key not in self._seen:
                self._seen[key] = c.finish_time
                new.append(c)
        horizon = obs.time - 2 * cfg.window_s
        self._seen = {k: t for k, t in self._seen.items() if t >= horizon}
        roles = {w.worker_id: w for w in obs.workers}

        # prefill tokens/s per worker
        rated = [c for c in new if c.num_prompt_tokens >= cfg.min_rate_prompt_tokens and c.prefill_ms > 0]
        disagg = [c for c in rated if c.transfer_path != "local"]
        rates = [c.num_prompt_tokens * 1000.0 / c.prefill_ms for c in (disagg or rated)]
        sample = percentile(rates, 90) if rates else None
        k = counts[PREFILL] + cfg.colocated_efficiency * counts[COLOCATED]
        if obs.queued_requests > 0 and k > 0 and len(completions) >= cfg.min_completions:
            first = min(c.start_time for c in completions)
            span = max(1.0, min(cfg.window_s, obs.time - first))
            throughput = sum(c.num_prompt_tokens for c in completions) / span / k
            sample = max(sample or 0.0, throughput)
        if sample:
            if self._prefill_samples == 0:
                self._prefill_tok_s = sample
            else:
                a = cfg.ewma_alpha
                self._prefill_tok_s = a * sample + (1 - a) * self._prefill_tok_s
            self._prefill_samples += 1

        # decode step time vs batch
        points = [(float(w.running), float(w.step_ms)) for w in obs.workers
                  if w.role == DECODE and w.step_ms and w.running >= 1]
        if not points:
            for c in new:
                w = roles.get(c.decode_worker)
                if w is not None and w.role == DECODE and c.num_output_tokens >= 3 and c.tbt_p50_ms > 0:
                    points.append((float(max(1, w.running)), c.tbt_p50_ms))
        if points:
            keep = 1 - cfg.decode_decay
            s = [v * keep for v in self._dsum]
            wgt = 1.0 / len(points)
            for x, y in points:
                s[0] += wgt
                s[1] += wgt * x
                s[2] += wgt * y
                s[3] += wgt * x * x
                s[4] += wgt * x * y
            self._dsum = s
            self._decode_samples += len(points)

    def _decode_fit(self) -> tuple[float, float]:
        cfg = self.config
        b0, k0 = cfg.decode_base_ms_prior, cfg.decode_per_seq_ms_prior
        s0, sx, sy, sxx, sxy = self._dsum
        if s0 <= 1e-9:
            return b0, k0
        mx, my = sx / s0, sy / s0
        var = sxx / s0 - mx * mx
        if var >= 4.0:
            slope = (sxy / s0 - mx * my) / var
            if slope > 0:
                return max(0.0, my - slope * mx), slope
        # little spread in batch sizes: keep the prior's shape, scale it to the data
        num = b0 * sy + k0 * sxy
        den = b0 * b0 * s0 + 2 * b0 * k0 * sx + k0 * k0 * sxx
        scale = num / den if den > 0 else 1.0
        return b0 * scale, k0 * scale

    # ---- moves ---------------------------------------------------------------------------
    def _pick(self, obs: Observation, role: str, exclude: set[str]) -> tuple[WorkerObs | None, str]:
        """The least busy switchable worker of ``role`` free to move, or why there is none."""
        candidates, dwelling = [], []
        for w in obs.workers:
            if w.role != role or w.worker_id in exclude or w.worker_id in self._pending:
                continue
            if not w.switchable:
                continue
            age = self._dwelling(w, obs.time)
            if age is not None:
                dwelling.append(f"{w.worker_id} switched {age:.0f} s ago < "
                                f"{self.config.min_dwell_s:.0f} s dwell")
                continue
            candidates.append(w)
        if candidates:
            return min(candidates, key=lambda w: (w.busy, w.worker_id)), ""
        if dwelling:
            return None, "; ".join(dwelling)
        return None, f"no switchable {role} worker"

    def _safe(self, counts: dict[str, int], moves: list[Move], handoff_backlog: int) -> str | None:
        """None if every subset of ``moves`` applied to ``counts`` keeps the hard rules
        (the moves may complete in any order), else what would break."""
        for size in range(1, len(moves) + 1):
            for subset in combinations(moves, size):
                after = dict(counts)
                for mv in subset:
                    after[mv.from_role] -= 1
                    after[mv.to_role] += 1
                broken = violations(after, handoff_backlog, self.config)
                if broken:
                    return "; ".join(broken)
        return None

    def _plan_moves(self, obs: Observation, counts: dict[str, int], target: Mapping[str, int],
                    max_moves: int, handoff_backlog: int) -> tuple[list[Move], list[str]]:
        """Up to ``max_moves`` moves from ``counts`` toward ``target``; and why not more."""
        moves: list[Move] = []
        blocked: list[str] = []
        cur = dict(counts)
        used: set[str] = set()
        while len(moves) < max_moves:
            chosen = None
            blocked = []
            for frm in ROLES:
                for to in ROLES:
                    if frm == to or cur[frm] <= target[frm] or cur[to] >= target[to]:
                        continue
                    w, why = self._pick(obs, frm, used)
                    if w is None:
                        blocked.append(f"{frm} -> {to}: {why}")
                        continue
                    mv = Move(w.worker_id, frm, to, w.role_epoch)
                    broken = self._safe(counts, moves + [mv], handoff_backlog)
                    if broken:
                        blocked.append(f"{w.worker_id} {frm} -> {to} would leave {broken}")
                        continue
                    chosen = mv
                    break
                if chosen:
                    break
            if chosen is None:
                break
            moves.append(chosen)
            used.add(chosen.worker_id)
            cur[chosen.from_role] -= 1
            cur[chosen.to_role] += 1
        return moves, blocked

    def _issue(self, obs: Observation, counts: dict[str, int], moves: Sequence[Move],
               action: str, reason: str, signals: dict) -> Decision:
        for mv in moves:
            self._pending[mv.worker_id] = (mv, obs.time)
            self._last_switch[mv.worker_id] = obs.time
        self._last_move_time = obs.time
        self._streak = {PREFILL: 0, DECODE: 0}
        after = dict(counts)
        for mv in moves:
            after[mv.from_role] -= 1
            after[mv.to_role] += 1
        text = f"{reason}: " + ", ".join(str(mv) for mv in moves)
        return self._decision(obs, after, tuple(moves), action, text, signals)

    def _decision(self, obs: Observation, counts: dict[str, int], moves: tuple[Move, ...],
                  action: str, reason: str, signals: dict) -> Decision:
        if self._notes:
            reason = f"{reason} [{'; '.join(self._notes)}]"
        return Decision(obs.time, dict(counts), moves, reason, action, dict(signals))

    # ---- repair --------------------------------------------------------------------------
    def _repair(self, obs: Observation, counts: dict[str, int], m: _Metrics,
                broken: list[str], signals: dict) -> Decision:
        """One move that turns an invalid state into a valid one, if any."""
        tried = []
        order = (PREFILL, DECODE, COLOCATED) if self.config.allow_colocated else (PREFILL, DECODE)
        for to in order:
            for frm in ROLES:
                if frm == to or counts[frm] == 0:
                    continue
                w, why = self._pick(obs, frm, set())
                if w is None:
                    tried.append(f"{frm} -> {to}: {why}")
                    continue
                after = dict(counts)
                after[frm] -= 1
                after[to] += 1
                still = violations(after, m.handoff_backlog, self.config)
                if still:
                    tried.append(f"{w.worker_id} {frm} -> {to} would leave {'; '.join(still)}")
                    continue
                self._route = None
                return self._issue(obs, counts, [Move(w.worker_id, frm, to, w.role_epoch)],
                                   "repair", f"repair: {'; '.join(broken)} ({m.summary(self.config)})",
                                   signals)
        return self._decision(obs, counts, (), "hold",
                              f"cannot repair: {'; '.join(broken)}; "
                              f"{'; '.join(tried) or 'no worker to move'}", signals)

    # ---- reactive ------------------------------------------------------------------------
    def _reactive(self, obs: Observation, counts: dict[str, int], m: _Metrics,
                  short_p: list[str], short_d: list[str], signals: dict) -> Decision:
        cfg = self.config
        hot_p = self._streak[PREFILL] >= cfg.confirm
        hot_d = self._streak[DECODE] >= cfg.confirm
        p, d, c = counts[PREFILL], counts[DECODE], counts[COLOCATED]

        if self._route is not None:
            target, direction, why = self._route
            if counts == target:
                self._route = None
            elif (direction == PREFILL and hot_d) or (direction == DECODE and hot_p):
                self._notes.append(f"abandoned the transition to {_fmt_counts(target)}: "
                                   f"{'; '.join(short_d if direction == PREFILL else short_p)}")
                self._route = None
            elif (direction == PREFILL and short_d) or (direction == DECODE and short_p):
                against = short_d if direction == PREFILL else short_p
                return self._decision(
                    obs, counts, (), "hold",
                    f"pausing {_fmt_counts(counts)} -> {_fmt_counts(target)} ({why}): "
                    f"{'; '.join(against)}; {m.summary(cfg)}", signals)
            else:
                moves, blocked = self._plan_moves(obs, counts, target, 1, m.handoff_backlog)
                head = f"continuing {_fmt_counts(counts)} -> {_fmt_counts(target)} ({why}); {m.summary(cfg)}"
                if moves:
                    return self._issue(obs, counts, moves, "move", head, signals)
                return self._decision(obs, counts, (), "hold",
                                      f"{head}; blocked: {'; '.join(blocked)}", signals)

        if hot_p and hot_d:
            return self._decision(
                obs, counts, (), "hold",
                f"overloaded: prefill short ({'; '.join(short_p)}) and decode short "
                f"({'; '.join(short_d)}); no split helps, add workers", signals)

        if hot_p:
            why = "; ".join(short_p)
            ok, spare = self._decode_spare(m)
            if ok:
                target = {PREFILL: p + 1, DECODE: d - 1, COLOCATED: c}
                moves, blocked = self._plan_moves(obs, counts, target, 1, m.handoff_backlog)
                if moves:
                    return self._issue(obs, counts, moves, "move",
                                       f"prefill short: {why}; decode can spare one: {spare}", signals)
                return self._decision(obs, counts, (), "hold",
                                      f"prefill short: {why}; but {'; '.join(blocked)}", signals)
            route = self._colocated_route(obs, counts, m, d)
            if route is not None:
                target, detail = route
                return self._start_route(obs, counts, m, target, PREFILL,
                                         f"prefill short: {why}; {spare}, {detail}", signals)
            return self._decision(obs, counts, (), "hold",
                                  f"prefill short: {why}; but decode cannot spare one: {spare}",
                                  signals)

        if hot_d:
            why = "; ".join(short_d)
            switch = [w for w in obs.workers if w.role == COLOCATED and w.switchable]
            kv_ok = m.decode_kv_used is None or m.decode_kv_used < cfg.kv_high
            if switch and d >= 1 and m.queued_handoffs < d and kv_ok:
                # colocated workers stall their own decodes: they turn prefill and the
                # decode workers (nothing queued for them) take their sequences; the
                # prefill-capable count stays
                s = len(switch)
                target = {PREFILL: p + s, DECODE: d, COLOCATED: c - s}
                return self._start_route(obs, counts, m, target, DECODE,
                                         f"decode short: {why}; back to disaggregated, "
                                         f"{m.queued_handoffs} handoffs queued for {d} decode "
                                         f"worker(s)", signals)
            if switch and d >= 1:
                # the decode workers are busy too: one colocated worker joins them
                target = {PREFILL: p, DECODE: d + 1, COLOCATED: c - 1}
                return self._start_route(obs, counts, m, target, DECODE,
                                         f"decode short: {why}; {m.queued_handoffs} handoffs "
                                         f"queued for {d} decode worker(s)", signals)
            if switch and p + c >= 2:
                ok, spare = self._prefill_spare(m, COLOCATED)
                if ok:
                    s = len(switch)
                    target = {PREFILL: p + s - 1, DECODE: d + 1, COLOCATED: c - s}
                    return self._start_route(obs, counts, m, target, DECODE,
                                             f"decode short: {why}; back to disaggregated, "
                                             f"prefill can spare one: {spare}", signals)
                return self._decision(obs, counts, (), "hold",
                                      f"decode short: {why}; but prefill cannot spare one: "
                                      f"{spare}", signals)
            ok, spare = self._prefill_spare(m, PREFILL)
            if ok and p >= 1:
                target = {PREFILL: p - 1, DECODE: d + 1, COLOCATED: c}
                moves, blocked = self._plan_moves(obs, counts, target, 1, m.handoff_backlog)
                if moves:
                    return self._issue(obs, counts, moves, "move",
                                       f"decode short: {why}; prefill can spare one: {spare}", signals)
                return self._decision(obs, counts, (), "hold",
                                      f"decode short: {why}; but {'; '.join(blocked)}", signals)
            return self._decision(obs, counts, (), "hold",
                                  f"decode short: {why}; but prefill cannot spare one: {spare}",
                                  signals)

        pending = []
        if short_p:
            pending.append(f"prefill short {self._streak[PREFILL]}/{cfg.confirm} ({'; '.join(short_p)})")
        if short_d:
            pending.append(f"decode short {self._streak[DECODE]}/{cfg.confirm} ({'; '.join(short_d)})")
        state = "not yet confirmed: " + ", ".join(pending) if pending else "healthy"
        if m.measured < cfg.min_completions and m.completions:
            state += (f" (percentiles not judged: {m.measured} < {cfg.min_completions} "
                      f"completions since the last role change)")
        return self._decision(obs, counts, (), "hold",
                              f"hold {_fmt_counts(counts)}, {state}: {m.summary(cfg)}", signals)

    def _colocated_route(self, obs: Observation, counts: dict[str, int], m: _Metrics,
                         d: int) -> tuple[dict, str] | None:
        """All-colocated target when the last decode worker cannot be spared, decode has
        headroom and the cluster is small enough; else None."""
        cfg = self.config
        total = sum(counts.values())
        if not cfg.allow_colocated or total > cfg.colocated_max_workers or counts[COLOCATED] == total:
            return None
        if d - 1 >= max(1, cfg.min_decode):      # decode could spare one but its SLO forbids
            return None
        if cfg.min_prefill or cfg.min_decode:
            return None
        if any(not w.switchable for w in obs.workers if w.role in (PREFILL, DECODE)):
            return None
        if m.queued_handoffs >= max(1, d) or self._streak[DECODE]:
            return None
        if m.tbt_samples >= cfg.min_completions and m.tbt_p90_ms is not None \
                and m.tbt_p90_ms > cfg.tbt_slo_ms:
            return None
        target = {PREFILL: 0, DECODE: 0, COLOCATED: total}
        tbt = _ms(m.tbt_p90_ms if m.tbt_samples else None)
        return target, (f"decode within its SLO (TBT p90 {tbt} <= {cfg.tbt_slo_ms:.0f} ms, "
                        f"{m.queued_handoffs} handoffs queued), {total} workers: all colocated")

    def _start_route(self, obs: Observation, counts: dict[str, int], m: _Metrics,
                     target: dict, direction: str, why: str, signals: dict) -> Decision:
        moves, blocked = self._plan_moves(obs, counts, target, 1, m.handoff_backlog)
        if not moves:
            return self._decision(obs, counts, (), "hold",
                                  f"{why}; {_fmt_counts(counts)} -> {_fmt_counts(target)} "
                                  f"blocked: {'; '.join(blocked)}", signals)
        if sum(abs(target[r] - counts[r]) for r in ROLES) > 2:   # more than this one move
            self._route = (dict(target), direction, why.split(";")[0])
        return self._issue(obs, counts, moves, "move",
                           f"{why}; {_fmt_counts(counts)} -> {_fmt_counts(target)}", signals)

    # ---- predictive ----------------------------------------------------------------------
    def _utilization(self, counts: Mapping[str, int], need_p: float, need_d: float) -> float:
        """The busiest side's load (1.0 = saturated) for ``counts``; ``need_*`` are the
        demand in workers' worth at 100 % (demand / one worker's capacity)."""
        p, d, c = counts[PREFILL], counts[DECODE], counts[COLOCATED]
        ce = c * self.config.colocated_efficiency

        def at(x: float) -> float:
            worst = 0.0
            for load, n in (((1 - x) * need_p, p), ((1 - x) * need_d, d), (x * (need_p + need_d), ce)):
                if load <= 1e-12:
                    continue
                if n <= 0:
                    return math.inf
                worst = max(worst, load / n)
            return worst

        if c == 0:
            return at(0.0)
        if p == 0:
            return at(1.0)
        return min(at(i / 100) for i in range(101))

    def _predictive(self, obs: Observation, counts: dict[str, int], m: _Metrics,
                    signals: dict) -> Decision:
        cfg = self.config
        cap = self.capacity
        if m.completions == 0 and m.queued_requests == 0 and m.queued_handoffs == 0:
            return self._decision(obs, counts, (), "hold",
                                  f"hold {_fmt_counts(counts)}: idle (no completions in "
                                  f"{cfg.window_s:.0f} s, nothing queued)", signals)
        mean_p = m.mean_prompt_tokens if m.mean_prompt_tokens is not None else cfg.default_prompt_tokens
        mean_o = m.mean_output_tokens if m.mean_output_tokens is not None else cfg.default_output_tokens
        prompt_demand = m.prompt_tok_s + m.queued_requests * mean_p / cfg.backlog_drain_s
        output_demand = m.output_tok_s + m.queued_handoffs * mean_o / cfg.backlog_drain_s
        step_limit = cfg.tbt_step_frac * cfg.tbt_slo_ms
        batch = cap.decode_batch(step_limit, cfg.max_batch)
        decode_tok_s = cap.decode_tok_s(step_limit, cfg.max_batch)
        need_p = prompt_demand / cap.prefill_tok_s
        need_d = output_demand / decode_tok_s

        fixed = _count(w.role for w in obs.workers if not w.switchable)  # nothing is in flight here
        movable = sum(counts.values()) - sum(fixed.values())
        candidates = []
        for ps in range(movable + 1):
            candidates.append({PREFILL: fixed[PREFILL] + ps, DECODE: fixed[DECODE] + movable - ps,
                               COLOCATED: fixed[COLOCATED]})
        if cfg.allow_colocated and movable:
            candidates.append({PREFILL: fixed[PREFILL], DECODE: fixed[DECODE],
                               COLOCATED: fixed[COLOCATED] + movable})
        candidates = [cand for cand in candidates if not violations(cand, 0, cfg)]

        def moves_to(cand):
            return sum(max(0, counts[r] - cand[r]) for r in ROLES)

        def colocated(cand):
            return cand[COLOCATED] > fixed[COLOCATED]

        u_cur = self._utilization(counts, need_p, need_d)
        scored = [(cand, self._utilization(cand, need_p, need_d)) for cand in candidates]
        fits = [(cand, u) for cand, u in scored if u <= cfg.target_utilization]
        disagg_fits = [(cand, u) for cand, u in fits if not colocated(cand)]
        cur_colocated = counts[COLOCATED] > fixed[COLOCATED]

        def best(options):
            return min(options, key=lambda cu: (moves_to(cu[0]), colocated(cu[0]), cu[1],
                                                -cu[0][PREFILL]))

        head = (f"demand {prompt_demand:.0f} prompt tok/s + {output_demand:.1f} output tok/s "
                f"({m.completions} completions in {m.span_s:.0f} s, {m.queued_requests} requests / "
                f"{m.queued_handoffs} handoffs queued) over capacity {cap.prefill_tok_s:.0f} prefill "
                f"tok/s and {decode_tok_s:.0f} decode tok/s per worker (batch {max(1, batch)} at "
                f"{cap.step_ms(max(1, batch)):.0f} ms): needs {need_p / cfg.target_utilization:.2f} "
                f"prefill + {need_d / cfg.target_utilization:.2f} decode workers at "
                f"{cfg.target_utilization:.0%}; current {_fmt_counts(counts)} at {_u(u_cur)}")
        signals = signals | {"prompt_demand_tok_s": round(prompt_demand, 3),
                             "output_demand_tok_s": round(output_demand, 3),
                             "prefill_tok_s": round(cap.prefill_tok_s, 3),
                             "decode_tok_s": round(decode_tok_s, 3),
                             "utilization": None if math.isinf(u_cur) else round(u_cur, 4)}
        if not movable:
            return self._decision(obs, counts, (), "hold", f"{head}; no switchable worker", signals)

        target, why = None, ""
        if not cur_colocated and u_cur <= cfg.keep_utilization:
            why = f"keep: {_u(u_cur)} <= {cfg.keep_utilization:.0%}"
        elif cur_colocated and disagg_fits:
            target, u = best(disagg_fits)
            why = f"back to disaggregated: {_fmt_counts(target)} fits at {_u(u)}"
        elif cur_colocated and u_cur <= cfg.keep_utilization:
            why = f"keep: {_u(u_cur)} <= {cfg.keep_utilization:.0%}, no disaggregated split fits"
        elif fits:
            target, u = best(disagg_fits or fits)
            why = f"{_fmt_counts(target)} fits at {_u(u)}"
        elif scored:
            lowest = min(u for _c, u in scored)
            if lowest < u_cur * (1 - cfg.min_gain):
                target, u = best([(cand, u) for cand, u in scored if u <= lowest * 1.0001])
                why = f"nothing fits, overloaded: {_fmt_counts(target)} is the least busy at {_u(u)}"
            else:
                why = f"overloaded: no split does better than {_u(lowest)}; add workers"
        if target is None or target == counts:
            return self._decision(obs, counts, (), "hold", f"{head}; {why or 'hold'}", signals)
        moves, blocked = self._plan_moves(obs, counts, target, cfg.max_moves, m.handoff_backlog)
        if not moves:
            return self._decision(obs, counts, (), "hold",
                                  f"{head}; {why}, blocked: {'; '.join(blocked)}", signals)
        return self._issue(obs, counts, moves, "move", f"{head}; {why}", signals)


def _u(u: float) -> str:
    return "u=inf" if math.isinf(u) else f"u={u:.2f}"


__all__ = ["COLOCATED", "DECODE", "PREFILL", "ROLES", "Capacity", "CompletionObs", "Decision",
           "Move", "Observation", "Planner", "PlannerConfig", "WorkerObs", "percentile",
           "violations"]
