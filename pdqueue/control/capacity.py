"""What one worker can do, learned from completions and heartbeats (both planner modes learn,
so a switch to predictive starts informed).

Prefill tokens/s per worker: per observation the p90 of the new completions'
``num_prompt_tokens / prefill_ms`` (prompts of at least ``min_rate_prompt_tokens``, from
prefill workers when there are any, else colocated ones). ``prefill_ms`` runs from the worker
reading the request to its first token, so it includes queueing inside the worker; the upper
quantile is closest to the bare speed. When requests are queued (prefill is saturated) the
window's prompt throughput per prefill-capable worker is a sample too, and the larger wins.
The first sample replaces the prior, later ones are folded in with ``ewma_alpha``.

Decode step time = ``base + per_seq x batch``: points (batch, step ms) come from a decode
worker's heartbeat ``step_ms`` at its ``running``, or else from new completions' median gap
at their decode worker's current ``running``; the points decay by ``decode_decay`` per
observation. With enough spread in batch sizes (variance >= 4) both parameters are fitted,
otherwise the prior's shape is scaled to the data (one batch size cannot separate them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdqueue.control.decision import PlannerConfig
from pdqueue.control.observation import COLOCATED, DECODE, PREFILL, CompletionObs, Observation
from pdqueue.control.signals import active_span, percentile


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


class CapacityModel:
    """The running estimates behind ``Capacity``; each completion is used once."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self._prefill_tok_s = config.prefill_tok_s_prior
        self._prefill_samples = 0
        self._dsum = [0.0] * 5            # S0, Sx, Sy, Sxx, Sxy of (batch, step ms), decayed
        self._decode_samples = 0
        self._seen: dict[str, float] = {}

    @property
    def capacity(self) -> Capacity:
        base, per_seq = self._decode_fit()
        return Capacity(self._prefill_tok_s, base, per_seq, self._prefill_samples,
                        self._decode_samples)

    def learn(self, obs: Observation, completions: tuple[CompletionObs, ...],
              counts: dict[str, int]) -> None:
        new = self._new(obs, completions)
        self._learn_prefill(obs, completions, new, counts)
        self._learn_decode(obs, new)

    def _new(self, obs: Observation, completions: tuple[CompletionObs, ...]) -> list[CompletionObs]:
        new = []
        for c in completions:
            key = c.request_id or f"{c.finish_time:.3f}:{c.ttft_ms:.3f}:{c.e2e_ms:.3f}"
            if key not in self._seen:
                self._seen[key] = c.finish_time
                new.append(c)
        horizon = obs.time - 2 * self.config.window_s
        self._seen = {k: t for k, t in self._seen.items() if t >= horizon}
        return new

    def _learn_prefill(self, obs: Observation, completions: tuple[CompletionObs, ...],
                       new: list[CompletionObs], counts: dict[str, int]) -> None:
        cfg = self.config
        rated = [c for c in new if c.num_prompt_tokens >= cfg.min_rate_prompt_tokens and c.prefill_ms > 0]
        disagg = [c for c in rated if c.transfer_path != "local"]
        rates = [c.num_prompt_tokens * 1000.0 / c.prefill_ms for c in (disagg or rated)]
        sample = percentile(rates, 90) if rates else None
        k = counts[PREFILL] + cfg.colocated_efficiency * counts[COLOCATED]
        if obs.queued_requests > 0 and k > 0 and len(completions) >= cfg.min_completions:
            span = active_span(completions, obs.time, cfg.window_s)
            throughput = sum(c.num_prompt_tokens for c in completions) / span / k
            sample = max(sample or 0.0, throughput)
        if sample:
            if self._prefill_samples == 0:
                self._prefill_tok_s = sample
            else:
                a = cfg.ewma_alpha
                self._prefill_tok_s = a * sample + (1 - a) * self._prefill_tok_s
            self._prefill_samples += 1

    def _learn_decode(self, obs: Observation, new: list[CompletionObs]) -> None:
        points = [(float(w.running), float(w.step_ms)) for w in obs.workers
                  if w.role == DECODE and w.step_ms and w.running >= 1]
        if not points:
            roles = {w.worker_id: w for w in obs.workers}
            for c in new:
                w = roles.get(c.decode_worker)
                if w is not None and w.role == DECODE and c.num_output_tokens >= 3 and c.tbt_p50_ms > 0:
                    points.append((float(max(1, w.running)), c.tbt_p50_ms))
        if not points:
            return
        keep = 1 - self.config.decode_decay
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


__all__ = ["Capacity", "CapacityModel"]
