"""`pdqueue bench serve --runs N`: each mode measured N times, the modes by turns (run 1 of
every mode, then run 2 of every mode, ...), each run on fresh workers; a mode's figures are
those of its runs' requests pooled, with each run's summary (``runs``) and the spread of
each summary figure over the runs (``spread``: min, median, max).

Taking the modes by turns puts each mode's runs at several points of the bench's time, so
that a shared machine's slow minutes (another job, a warm page cache) fall on every mode
alike instead of on one mode's block of runs; the spread says how far one run's figure may
be trusted. Pure functions of the runs' figures and records.
"""

from __future__ import annotations

from typing import Callable

from pdqueue.bench.stats import median

# What a run's summary holds: (name, path into a rate's figures).
SUMMARY = (("goodput_rps", ("goodput_rps",)), ("ttft_p50_ms", ("ttft_ms", "p50")), ("ttft_p99_ms", ("ttft_ms", "p99")),
           ("tbt_p50_ms", ("tbt_ms", "p50")), ("tbt_p99_ms", ("tbt_ms", "p99")), ("failed", ("failed",)),
           ("cached_share", ("prefix_cache_hit_rate",)),
           # the multi-turn workload's turns 2 and later (serve_turns.py)
           ("later_goodput_rps", ("later_turns", "goodput_rps")),
           ("later_ttft_p50_ms", ("later_turns", "ttft_ms", "p50")),
           ("later_ttft_p99_ms", ("later_turns", "ttft_ms", "p99")),
           ("later_cached_share", ("later_turns", "prefix_cache_hit_rate")))


def _at(figures: dict, path: tuple[str, ...]):
    for name in path:
        if not isinstance(figures, dict) or name not in figures:
            return None
        figures = figures[name]
    return figures


def run_summary(figures: dict, run: int) -> dict:
    """One run of one rate in a few figures (those its workload has)."""
    out = {"run": run}
    for name, path in SUMMARY:
        value = _at(figures, path)
        if value is not None:
            out[name] = value
    return out


def combined(runs: list[tuple[dict, dict]], settings, figures_of: Callable) -> tuple[dict, dict]:
    """One mode's runs, each ``(by_rate, raw)`` as ``serve_bench`` measures a mode (figures with
    their ``records``), as one such pair: per rate, ``figures_of(records, rate, settings)`` of
    every run's records, its ``runs`` and ``spread``; the timeline of the first run, and a
    multi-turn run's rows (``raw["turns"]``) as one list per run. The
    runs' own dicts are left as they were (the bench combines again after each run)."""
    first_by_rate, first_raw = runs[0]
    by_rate, raw = {"idle_overhead_ms": first_by_rate["idle_overhead_ms"]}, {}
    for key in (k for k in first_by_rate if k != "idle_overhead_ms"):
        records = [r for by, _ in runs for r in by[key]["records"]]
        figures, raw[key] = figures_of(records, float(key), settings)
        raw[key]["timeline"] = first_raw[key].get("timeline", [])
        if "turns" in raw[key]:   # the multi-turn rows, by run (a session's index repeats in every run)
            raw[key]["turns"] = [rw[key]["turns"] for _, rw in runs]
        summaries = [run_summary(by[key], i + 1) for i, (by, _) in enumerate(runs)]
        figures["runs"] = summaries
        figures["spread"] = {name: {"min": min(v), "median": median(v), "max": max(v)}
                             for name, _ in SUMMARY
                             if (v := [s[name] for s in summaries if s.get(name) is not None])}
        figures["records"] = records
        by_rate[key] = figures
    return by_rate, raw


def runs_lines(result: dict) -> list[str]:
    """Each mode's runs at each rate, and the spread, for the printed table."""
    lines = []
    for mode, pooled in result["modes"].items():
        for rate, f in pooled.get("by_rate", {}).items():
            runs = f.get("runs") or []
            if len(runs) < 2:
                continue
            later = "later_ttft_p50_ms" in runs[0]
            lines.append(f"runs of {mode} @ {rate}: {'run':>6} {'goodput':>8} {'TTFT p50/p99':>14}"
                         + (f" {'turns>=2 goodput':>17} {'TTFT p50/p99':>14} {'cached':>7}" if later else ""))
            spread = f.get("spread", {})
            rows = runs + [{"run": q, **{k: v[q] for k, v in spread.items()}} for q in ("min", "median", "max")]
            for s in rows:
                line = (f"{'':>{len(f'runs of {mode} @ {rate}: ')}}{s['run']!s:>6} {s.get('goodput_rps', 0):>8.2f} "
                        f"{s.get('ttft_p50_ms', 0):>6.0f}/{s.get('ttft_p99_ms', 0):<7.0f}")
                if later:
                    line += (f" {s.get('later_goodput_rps', 0):>17.2f} {s.get('later_ttft_p50_ms', 0):>6.0f}/"
                             f"{s.get('later_ttft_p99_ms', 0):<7.0f} {s.get('later_cached_share', 0):>7.0%}")
                lines.append(line)
    return lines
