"""The numbers a decision is made from: percentiles and rates over the recent window, the
queues, and which side of the split is short.

TTFT p90 is taken over completions; TBT p90 over completions of an estimate of each
request's p90 gap (``CompletionObs.tbt_ms``); prompt and output tokens/s over the active part
of the window. The percentiles use only completions that finished after the last role
change (a window still full of the old split's TTFTs would cause a second move for the same
problem) and need ``min_completions`` samples before they can declare a breach; the queue
signals need none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from pdqueue.control.decision import PlannerConfig
from pdqueue.control.observation import COLOCATED, DECODE, PREFILL, CompletionObs, Observation


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def fmt_counts(c: Mapping[str, int]) -> str:
    parts = [f"{c[PREFILL]}P", f"{c[DECODE]}D"]
    if c[COLOCATED]:
        parts.append(f"{c[COLOCATED]}C")
    return "+".join(parts)


def fmt_ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ms"


def fmt_u(u: float) -> str:
    return "u=inf" if math.isinf(u) else f"u={u:.2f}"


def active_span(completions: Sequence[CompletionObs], now: float, window_s: float) -> float:
    """Seconds of the window the completions cover: from the first one's start (>= 1 s)."""
    if not completions:
        return window_s
    first = min(c.start_time for c in completions)
    return max(1.0, min(window_s, now - first))


@dataclass(frozen=True, slots=True)
class Signals:
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

    def ttft_breach(self, cfg: PlannerConfig) -> bool:
        return (self.measured >= cfg.min_completions and self.ttft_p90_ms is not None
                and self.ttft_p90_ms > cfg.ttft_slo_ms)

    def tbt_breach(self, cfg: PlannerConfig) -> bool:
        return (self.tbt_samples >= cfg.min_completions and self.tbt_p90_ms is not None
                and self.tbt_p90_ms > cfg.tbt_slo_ms)

    def summary(self, config: PlannerConfig) -> str:
        return (f"TTFT p90 {fmt_ms(self.ttft_p90_ms)} (SLO {config.ttft_slo_ms:.0f} ms), "
                f"TBT p90 {fmt_ms(self.tbt_p90_ms)} (SLO {config.tbt_slo_ms:.0f} ms), "
                f"{self.queued_requests} requests and {self.queued_handoffs} handoffs queued, "
                f"{self.completions} completions in {self.span_s:.0f} s"
                + (f" ({self.measured} since the last role change)"
                   if self.measured != self.completions else ""))

    def as_dict(self) -> dict:
        return {"ttft_p90_ms": self.ttft_p90_ms, "tbt_p90_ms": self.tbt_p90_ms,
                "completions": self.completions, "measured": self.measured,
                "prompt_tok_s": round(self.prompt_tok_s, 3), "output_tok_s": round(self.output_tok_s, 3),
                "queued_requests": self.queued_requests, "queued_handoffs": self.queued_handoffs,
                "handoff_backlog": self.handoff_backlog, "decode_running": self.decode_running,
                "decode_kv_used": self.decode_kv_used, "span_s": round(self.span_s, 3)}


def measure(obs: Observation, completions: tuple[CompletionObs, ...], counts: dict[str, int],
            window_s: float, since: float | None) -> Signals:
    """The signals of ``obs``; percentiles only from completions finished at or after
    ``since`` (the last role change seen; None: all)."""
    since = -math.inf if since is None else since
    recent = [c for c in completions if c.finish_time >= since]
    ttft = [c.ttft_ms for c in recent if c.num_output_tokens > 0]
    tbt = [t for t in (c.tbt_ms for c in recent) if t is not None]
    span = active_span(completions, obs.time, window_s)
    prompt = sum(c.num_prompt_tokens for c in completions)
    output = sum(c.num_output_tokens for c in completions)
    decoders = [w for w in obs.workers if w.role == DECODE]
    kv = [f for f in (w.kv_used_frac for w in decoders) if f is not None]
    n = len(completions)
    return Signals(
        counts=counts, total=sum(counts.values()), completions=n, measured=len(ttft),
        ttft_p90_ms=percentile(ttft, 90), tbt_p90_ms=percentile(tbt, 90),
        tbt_samples=len(tbt), prompt_tok_s=prompt / span, output_tok_s=output / span,
        mean_prompt_tokens=prompt / n if n else None,
        mean_output_tokens=output / n if n else None, span_s=span,
        queued_requests=obs.queued_requests, queued_handoffs=obs.queued_handoffs,
        handoff_backlog=obs.handoff_backlog,
        decode_running=sum(w.running for w in decoders),
        decode_kv_used=max(kv) if kv else None)


def shortages(m: Signals, cfg: PlannerConfig,
              prev_queues: tuple[int, int] | None) -> tuple[list[str], list[str]]:
    """Why each side is short in this observation (empty lists: it is not). Prefill is short
    on a TTFT breach or when the queued requests are at least ``backlog_high`` per
    prefill-capable worker and not shrinking; decode on a TBT breach, the same rule for
    queued handoffs per decode worker, or decode KV at ``kv_high`` with handoffs waiting."""
    c = m.counts
    prev_req, prev_hand = prev_queues if prev_queues else (0, 0)
    short_p, short_d = [], []
    if m.ttft_breach(cfg):
        short_p.append(f"TTFT p90 {m.ttft_p90_ms:.0f} ms > {cfg.ttft_slo_ms:.0f} ms SLO")
    serving = max(1, c[PREFILL] + c[COLOCATED])
    if m.queued_requests >= cfg.backlog_high * serving and m.queued_requests >= prev_req:
        short_p.append(f"{m.queued_requests} requests queued (>= {cfg.backlog_high} per "
                       f"prefill-capable worker, was {prev_req})")
    if m.tbt_breach(cfg):
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


__all__ = ["Signals", "active_span", "fmt_counts", "fmt_ms", "fmt_u", "measure", "percentile",
           "shortages"]
