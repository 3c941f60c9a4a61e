"""Small statistics for the benches: percentiles, summaries, goodput.

Percentiles interpolate linearly between order statistics (numpy's default), so p99 of a
few hundred gaps is a real tail figure and p99 of five values is close to the maximum.
Imports the standard library only.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``; NaN when empty."""
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def summary(values: Iterable[float], qs: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """``{"p50": .., "p90": .., "p99": .., "mean": .., "max": .., "n": ..}`` (NaN-free: 0 if empty)."""
    data = sorted(values)
    if not data:
        return {**{f"p{q}": 0.0 for q in qs}, "mean": 0.0, "max": 0.0, "n": 0}
    out = {f"p{q}": percentile(data, q) for q in qs}
    out.update(mean=sum(data) / len(data), max=data[-1], n=len(data))
    return out


def gaps(times: Sequence[float]) -> list[float]:
    """Differences between consecutive times."""
    return [b - a for a, b in zip(times, times[1:])]


def meets_slo(ttft_ms: float, tbt_gaps_ms: Sequence[float], slo_ttft_ms: float, slo_tbt_ms: float) -> bool:
    """DistServe's per-request attainment: TTFT within its SLO and the p90 of the request's
    inter-token gaps within the TBT SLO (a request with one token has no gaps: TTFT only)."""
    if ttft_ms > slo_ttft_ms:
        return False
    return not tbt_gaps_ms or percentile(tbt_gaps_ms, 90) <= slo_tbt_ms


def round_floats(obj, digits: int = 3):
    """A copy of a JSON-like object with floats rounded (NaN/inf become None)."""
    if isinstance(obj, float):
        return round(obj, digits) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: round_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [round_floats(v, digits) for v in obj]
    return obj
