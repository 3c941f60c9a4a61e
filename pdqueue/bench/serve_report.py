"""`pdqueue bench serve`'s figures and report: per mode and rate (``metrics``), per phase,
pooled over the rates; the claims checked against them (TBT p99/p50, the prefix-caching
targets, the adaptive mode's goodput) and the printed table. Pure functions of the records."""

from __future__ import annotations

import math

from pdqueue.bench.serve_client import Record
from pdqueue.bench.serve_load import (
    ASSISTANT_LEN,
    CONVERSATIONS,
    MAX_TURNS,
    SYSTEM_LEN,
    SYSTEM_PROMPTS,
    TURNS,
    USER_LEN,
    USER_TOKENS,
    Settings,
)
from pdqueue.bench.serve_modes import PREFIX_MODES
from pdqueue.bench.stats import gaps, meets_slo, percentile, summary


def latencies(answered: list[Record], settings: Settings) -> tuple[list[float], list[list[float]], int]:
    """Of answered requests (a token or more): each one's TTFT (ms, from its submission), each
    one's gaps between tokens (ms, as the client saw them), and how many met both SLOs
    (``meets_slo``). ``metrics`` and the tenants' figures (``serve_tenants``) both count so."""
    ttft = [(r.token_times[0] - r.submitted) * 1e3 for r in answered]
    per_request_gaps = [[g * 1e3 for g in gaps(r.token_times)] for r in answered]
    met = sum(meets_slo(t, g, settings.slo_ttft_ms, settings.slo_tbt_ms) for t, g in zip(ttft, per_request_gaps))
    return ttft, per_request_gaps, met


def metrics(records: list[Record], rate: float, settings: Settings) -> tuple[dict, dict]:
    """(figures of one mode at one rate, raw values for the plots)."""
    ok = [r for r in records if r.finished is not None and r.token_times]
    ttft, per_request_gaps, met = latencies(ok, settings)
    tbt = [g for request in per_request_gaps for g in request]
    tbt_server = [g for r in ok for g in gaps(r.token_entry_ms)]
    span = (max(r.finished for r in ok) - min(r.submitted for r in records)) if ok else math.inf
    prefill_ms = [r.completion.prefill_ms for r in ok]   # NaN from an OpenAI server: left out below
    second = [r for r in ok if len(r.token_times) > 1]
    gap01 = [(r.token_times[1] - r.token_times[0]) * 1e3 for r in second]
    steady = [g for r in second for g in gaps(r.token_times[1:])]
    figures = {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "ttft_ms": summary(ttft), "tbt_ms": summary(tbt), "tbt_server_ms": summary(tbt_server),
        "e2e_ms": summary((r.finished - r.submitted) * 1e3 for r in ok),
        "gap01_ms": summary(gap01), "ttst_ms": summary((r.token_times[1] - r.submitted) * 1e3 for r in second),
        "tbt_after_first_ms": summary(g * 1e3 for g in steady),
        "ttft_long_ms": summary(t for t, r in zip(ttft, ok) if r.planned.kind == "long"),
        "ttft_short_ms": summary(t for t, r in zip(ttft, ok) if r.planned.kind == "short"),
        "throughput_tok_s": sum(len(r.token_times) for r in ok) / span,
        "slo_attainment": met / len(records) if records else 0.0,
        "goodput_rps": rate * met / len(records) if records else 0.0,
        "queue_overhead_ms": summary(t - p for t, p in zip(ttft, prefill_ms) if not math.isnan(p)),
        "queue_ms": summary(r.completion.queue_ms for r in ok if not math.isnan(r.completion.queue_ms)),
        "prefill_ms": summary(p for p in prefill_ms if not math.isnan(p)),
        "transfer_ms": summary(r.completion.transfer_ms for r in ok if r.completion.transfer_path not in ("", "local")),
    }
    prompt_tokens = sum(len(r.planned.prompt_ids) for r in ok)
    cached = sum(getattr(r.completion, "cached_tokens", 0) or 0 for r in ok)
    reused = sum(getattr(r.completion, "kv_reused_tokens", 0) or 0 for r in ok)
    figures["prefix_cache_hit_rate"] = cached / prompt_tokens if prompt_tokens else 0.0      # prefill side
    figures["decode_kv_reuse_rate"] = reused / prompt_tokens if prompt_tokens else 0.0      # KV not fetched
    figures["tbt_p99_over_p50"] = figures["tbt_ms"]["p99"] / figures["tbt_ms"]["p50"] if tbt else None
    # per request (aligned with ttft_ms): the p90 of its gaps, so another SLO set can be judged later
    p90_gap = [percentile(g, 90) if g else 0.0 for g in per_request_gaps]
    return figures, {"ttft_ms": ttft, "tbt_ms": tbt, "p90_gap_ms": p90_gap, "requests": len(records)}



def phase_metrics(records: list[Record], settings: Settings) -> dict:
    """Figures per phase (goodput at the phase's rate) and over the whole run (requests that
    met both SLOs per second of arrivals)."""
    out = {"by_phase": []}
    for index, ph in enumerate(settings.phases):
        figures, _ = metrics([r for r in records if r.planned.phase == index], ph.rate, settings)
        out["by_phase"].append({"name": ph.name, "long_fraction": ph.long_fraction, "rate": ph.rate,
                                "duration_s": ph.duration_s, **figures})
    total_s = sum(ph.duration_s for ph in settings.phases)
    overall, _ = metrics(records, len(records) / total_s if total_s else 0.0, settings)
    out["overall"] = overall
    return out



def rate_key(rate: float) -> str:
    return f"{rate:g}"



def pool_rates(by_rate: dict, raw: dict, settings: Settings) -> dict:
    """Mode-level figures pool the requests of every rate; ``by_rate`` keeps each rate. A
    phased run's figures are its overall ones, with ``by_phase``."""
    idle = by_rate.pop("idle_overhead_ms")
    if "phases" in by_rate:
        phases = by_rate.pop("phases")
        phases.pop("records")
        return {**phases["overall"], "by_phase": phases["by_phase"], "idle_overhead_ms": idle, "by_rate": {}}
    records = [r for figures in by_rate.values() for r in figures.pop("records")]
    mean_rate = sum(settings.rates) / len(settings.rates)
    pooled, _ = metrics(records, mean_rate, settings)
    pooled["goodput_rps"] = sum(f["goodput_rps"] for f in by_rate.values()) / len(by_rate)
    pooled["idle_overhead_ms"] = idle
    pooled["by_rate"] = by_rate
    return pooled


def claim(result: dict) -> dict:
    """The seeds' claim, per rate: disaggregation keeps p99 TBT near its p50 while colocated
    p99 TBT grows with the prefills in its batches. "holds": disagg's p99/p50 is below 2 and
    below every colocated mode's; "partly": below every colocated mode's but not below 2."""
    out = {}
    for rate in map(rate_key, result["rates"]):
        ratios = {m: result["modes"][m]["by_rate"][rate]["tbt_p99_over_p50"] for m in result["modes"]}
        entry = {f"{m}_tbt_p99_over_p50": v for m, v in ratios.items()}
        d = ratios.get("disagg")
        others = [v for m, v in ratios.items() if m != "disagg" and v is not None]
        if d is not None and others:
            entry["verdict"] = ("holds" if d < 2.0 else "partly") if all(d < v for v in others) else "does not hold"
        entry.update(prefix_claim(result, rate))
        out[rate] = entry
    return out


def prefix_claim(result: dict, rate: str) -> dict:
    """Issue 15's targets where the prefix modes ran: caching alone (cache-blind) at least 2x
    lower TTFT p50 than caching off; cache-aware routing at least 1.5x lower than cache-blind."""
    modes = result["modes"]
    p50 = {m: modes[m]["by_rate"][rate]["ttft_ms"]["p50"] for m in PREFIX_MODES if m in modes}
    out = {f"{m}_hit_rate": modes[m]["by_rate"][rate]["prefix_cache_hit_rate"] for m in p50}
    if p50.get("prefix-off") and p50.get("prefix-blind"):
        out["caching_ttft_p50_speedup"] = p50["prefix-off"] / p50["prefix-blind"]
        out["caching_target_2x"] = out["caching_ttft_p50_speedup"] >= 2.0
    if p50.get("prefix-blind") and p50.get("prefix-aware"):
        out["routing_ttft_p50_speedup"] = p50["prefix-blind"] / p50["prefix-aware"]
        out["routing_target_1_5x"] = out["routing_ttft_p50_speedup"] >= 1.5
    return out


def workload_dict(settings: Settings) -> dict:
    w = settings.workload
    return {"short_prompt": w.short_prompt, "short_output": w.short_output, "long_prompt": w.long_prompt,
            "long_output": w.long_output, "long_fraction": w.long_fraction, "seed": settings.seed,
            "requests_per_rate": {rate_key(r): settings.requests_at(r) for r in settings.rates},
            "warmup": settings.warmup, "chunk_tokens": settings.chunk_tokens,
            "placed_chunk_tokens": settings.placed_chunk_tokens, "late_last": settings.late_last,
            "threads_per_worker": 1,
            "sampling": "greedy, ignore_eos", "kind": settings.workload_kind,
            **({"system_prompts": SYSTEM_PROMPTS, "system_len": SYSTEM_LEN, "conversations": CONVERSATIONS,
                "user_len": USER_LEN, "assistant_len": ASSISTANT_LEN, "max_turns": MAX_TURNS}
               if settings.workload_kind == "prefix" else {}),
            **({"rate_unit": "sessions/s", "sessions_per_rate": {rate_key(r): settings.requests_at(r)
                                                                 for r in settings.rates},
                "turns": TURNS, "user_tokens": USER_TOKENS, "answer_tokens": w.short_output,
                "think_s": settings.think_s, "kv_host_tier_mb": settings.kv_host_tier_mb,
                "kv_disk_gb": settings.kv_disk_gb} if settings.workload_kind == "multiturn" else {}),
            **({"runs": settings.runs, "order": "the modes by turns, fresh workers each run"}
               if settings.runs > 1 else {})}


def phase_claim(result: dict) -> dict:
    """The adaptive mode's targets (where it ran): in every phase at least 0.9x the best
    fixed mode's goodput for that phase, and over the whole run at least 1.2x the best
    single fixed mode's."""
    modes = result["modes"]
    if "adaptive" not in modes or len(modes) < 2:
        return {}
    fixed = {m: f for m, f in modes.items() if m != "adaptive"}
    out = {"by_phase": []}
    for index, ph in enumerate(result["phases"]):
        best_mode = max(fixed, key=lambda m: fixed[m]["by_phase"][index]["goodput_rps"])
        best = fixed[best_mode]["by_phase"][index]["goodput_rps"]
        got = modes["adaptive"]["by_phase"][index]["goodput_rps"]
        out["by_phase"].append({"phase": ph["name"], "best_fixed": best_mode, "best_fixed_goodput": best,
                                "adaptive_goodput": got, "ratio": got / best if best else None,
                                "met": got >= 0.9 * best})
    best_mode = max(fixed, key=lambda m: fixed[m]["goodput_rps"])
    best, got = fixed[best_mode]["goodput_rps"], modes["adaptive"]["goodput_rps"]
    out["overall"] = {"best_fixed": best_mode, "best_fixed_goodput": best, "adaptive_goodput": got,
                      "ratio": got / best if best else None, "met": got >= 1.2 * best}
    return out


def format_phase_table(result: dict) -> str:
    slo = result["slo"]
    lines = [f"model {result['model']}; SLO: TTFT <= {slo['ttft_ms']:g} ms, p90 TBT <= {slo['tbt_ms']:g} ms; "
             f"phases " + ", ".join(f"{p['name']} ({p['long_fraction']:.0%} documents, {p['rate']:g} req/s, "
                                      f"{p['duration_s']:g} s)" for p in result["phases"]),
             f"{'mode':<25}{'phase':>8}{'done':>8}  {'TTFT p50/p99 ms':>16}  {'tok0->1 p50/p99':>16}"
             f"  {'TBT p50/p99 ms':>15}{'goodput':>9}{'attain':>8}"]
    for mode, pooled in result["modes"].items():
        for f in pooled["by_phase"] + [dict(pooled, name="all")]:
            t, g, b = f["ttft_ms"], f["gap01_ms"], f["tbt_ms"]
            lines.append(f"{mode:<25}{f['name']:>8}{f['completed']:>4}/{f['requests']:<3}  "
                         f"{t['p50']:>7.0f} {t['p99']:>7.0f}  {g['p50']:>7.0f} {g['p99']:>7.0f}  "
                         f"{b['p50']:>6.0f} {b['p99']:>7.0f}{f['goodput_rps']:>9.2f}{f['slo_attainment']:>8.0%}")
    c = result.get("claim") or {}
    for entry in c.get("by_phase", []):
        lines.append(f"adaptive in {entry['phase']}: {entry['adaptive_goodput']:.2f} req/s against the best fixed "
                     f"({entry['best_fixed']}) {entry['best_fixed_goodput']:.2f}: "
                     f"{(entry['ratio'] or 0):.2f}x (target >= 0.9x: {'met' if entry['met'] else 'NOT met'})")
    if "overall" in c:
        o = c["overall"]
        lines.append(f"adaptive overall: {o['adaptive_goodput']:.2f} req/s against the best fixed ({o['best_fixed']}) "
                     f"{o['best_fixed_goodput']:.2f}: {(o['ratio'] or 0):.2f}x (target >= 1.2x: "
                     f"{'met' if o['met'] else 'NOT met'})")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    if result.get("phases"):
        return format_phase_table(result)
    slo = result["slo"]
    lines = [f"model {result['model']}; SLO: TTFT <= {slo['ttft_ms']:g} ms, p90 TBT <= {slo['tbt_ms']:g} ms; "
             f"workload {result['workload']}",
             f"{'mode':<25}{'rate':>6}{'done':>6}  {'TTFT p50/p90/p99 ms':>24}  {'TBT p50/p90/p99 ms':>22}"
             f"{'tok/s':>8}{'goodput':>9}{'attain':>8}  {'queue ovh p50/p99':>18}  {'tok0->1 p50/p99':>16}"
             f"  {'TTST p50/p99':>14}"]
    for mode, pooled in result["modes"].items():
        for rate, f in pooled["by_rate"].items():
            t, b, q, g, s2 = f["ttft_ms"], f["tbt_ms"], f["queue_overhead_ms"], f["gap01_ms"], f["ttst_ms"]
            lines.append(f"{mode:<25}{rate:>6}{f['completed']:>3}/{f['requests']:<2}  "
                         f"{t['p50']:>7.0f} {t['p90']:>7.0f} {t['p99']:>7.0f}  "
                         f"{b['p50']:>6.0f} {b['p90']:>6.0f} {b['p99']:>7.0f}"
                         f"{f['throughput_tok_s']:>8.1f}{f['goodput_rps']:>9.2f}{f['slo_attainment']:>8.0%}  "
                         f"{q['p50']:>8.1f} {q['p99']:>8.1f}  {g['p50']:>7.0f} {g['p99']:>7.0f}"
                         f"  {s2['p50']:>6.0f} {s2['p99']:>6.0f}")
    lines += batch_lines(result)
    for rate, entry in result["claim"].items():
        ratios = ", ".join(f"{k.removesuffix('_tbt_p99_over_p50')} {v:.1f}x" for k, v in entry.items()
                           if k != "verdict" and v is not None)
        lines.append(f"claim at {rate} req/s (TBT p99/p50: {ratios}): {entry.get('verdict', 'n/a')}")
    idle = {m: p["idle_overhead_ms"] for m, p in result["modes"].items()}
    lines.append("queue overhead with idle workers (client TTFT - prefill_ms), p50/p99 ms: "
                 + ", ".join(f"{m} {v['p50']:.1f}/{v['p99']:.1f}" for m, v in idle.items()))
    return "\n".join(lines)


def batch_lines(result: dict) -> list[str]:
    """The batch figures of each mode and rate (``--batch-lines``; serve_batch.py), with the
    faults of ``--chaos`` (serve_chaos.py), and a loud line where a batch line was not
    answered exactly once."""
    lines = []
    for mode, pooled in result["modes"].items():
        for rate, f in pooled["by_rate"].items():
            b = f.get("batch")
            if not b:
                continue
            share = b["idle_share_used"]
            lines.append(f"batch {mode} @ {rate}: {b['answered']}/{b['lines']} answered, {b['duplicates']} duplicates, "
                         f"{b['missing']} missing, {b['out_not_once']} out:<id> not one done, {b['short']} short; "
                         f"{b['answered_in_window']} in the online window ({b['tok_s_in_window']:.1f} tok/s, "
                         f"{'n/a' if share is None else f'{share:.2f}'} of the capacity left)")
            for e in f.get("chaos", ()):
                lines.append(f"  chaos: {chaos_event_line(e)}")
            lines += chaos_lines(f)
            if not b["exactly_once"]:
                lines.append(f"!! FAILED: {mode} @ {rate}: batch lines NOT answered exactly once "
                             f"({b['missing']} missing, {b['duplicates']} duplicates, {b['out_not_once']} out:<id> "
                             f"not ending in one done, {b['short']} with another number of tokens)")
    return lines


def chaos_event_line(e: dict) -> str:
    """One chaos event's record (serve_chaos.Chaos.run) in words."""
    run = f"run {e['run']}: " if "run" in e else ""
    if "error" in e:
        return f"{run}{e['event']} at {e['at_s']:.1f} s failed: {e['error']}"
    if e["event"] == "rolling-restart":
        replaced = ", ".join(r["old"] for r in e["replaced"]) or "none"
        return (f"{run}rolling-restart at {e['at_s']:.1f} s: {e['status']} in {e['took_s']:.1f} s, "
                f"{len(e['replaced'])} workers replaced ({replaced} -> {', '.join(e['new_workers']) or 'none'}); "
                f"workers only (no gateway)" + (f"; FAILED: {e['failure']}" if "failure" in e else ""))
    if e["event"].startswith("zero-capacity"):
        back = e.get("capacity_back_s")
        return (f"{run}{e['event']} at {e['at_s']:.1f} s: stopped {', '.join(e['stopped'])} (warm), started "
                f"{', '.join(e['started'])} at {e['outage_end_s']:.1f} s, capacity back at "
                + (f"{back:.1f} s" if back is not None else "NOT back"))
    if "worker_id" in e:
        back = e.get("back_after_s")
        return (f"{run}{e['event']} at {e['at_s']:.1f} s: SIGKILL {e['worker_id']} ({e['role']}, pid {e['pid']}), "
                + (f"back (restarted by the supervisor) {back:.1f} s later" if back is not None else "not back"))
    return f"{run}{e['event']} at {e['at_s']:.1f} s: Redis away {e['away_s']:.2f} s (pid {e['old_pid']} -> {e['pid']})"


# ---- --chaos rolling-restart / zero-capacity: the window, the baseline --------------------------

def window_split(records: list[Record], started_perf: float, events: list[dict]) -> tuple[list, list, int]:
    """The TTFTs (ms) of the answered requests that arrived within an event's window
    (``at_s`` .. ``until_s`` after the run's start, ``started_perf`` on the records' clock) and
    of the others; and how many in a window went unanswered."""
    windows = [(e["at_s"], e["until_s"]) for e in events if e.get("until_s") is not None]
    inside, rest, lost = [], [], 0
    for r in records:
        t = r.submitted - started_perf
        within = any(a <= t <= b for a, b in windows)
        if r.finished is None or not r.token_times:
            lost += within
            continue
        (inside if within else rest).append((r.token_times[0] - r.submitted) * 1e3)
    return inside, rest, lost


def window_figures(inside: list, rest: list, unanswered: int, windows: list) -> dict:
    return {"chaos_window": {"windows_s": windows, "requests": len(inside) + unanswered, "unanswered": unanswered,
                             "ttft_ms": summary(inside), "ttft_rest_ms": summary(rest)}}


def run_summary(figures: dict, index: int) -> dict:
    """One run of a rate in a few figures (``--chaos-alternate``)."""
    b, w = figures.get("batch") or {}, figures.get("chaos_window")
    return {"run": index, "chaos": "chaos" in figures, "goodput_rps": figures["goodput_rps"],
            "ttft_p50_ms": figures["ttft_ms"]["p50"], "ttft_p99_ms": figures["ttft_ms"]["p99"],
            "tbt_p50_ms": figures["tbt_ms"]["p50"], "tbt_p99_ms": figures["tbt_ms"]["p99"],
            "errors": figures["failed"], "lost": b.get("missing", 0), "doubled": b.get("duplicates", 0),
            "out_not_once": b.get("out_not_once", 0),
            "ttft_p99_window_ms": w["ttft_ms"]["p99"] if w else None,
            "ttft_p99_rest_ms": w["ttft_rest_ms"]["p99"] if w else None}


VERSUS = ("goodput_rps", "ttft_p50_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p99_ms", "errors", "lost", "doubled",
          "ttft_p99_window_ms", "ttft_p99_rest_ms")


def alternated(runs: list[tuple[dict, dict]], rate: float, settings: Settings) -> tuple[dict, dict]:
    """A rate's runs with and without the chaos (``--chaos-alternate``) as one rate's figures:
    those of the chaos runs' requests pooled (batch: every run's lines, the exactly-once check
    over all of them; the windows' TTFTs pooled), each run's summary (``runs``) and the
    medians of each kind of run side by side (``versus``)."""
    from pdqueue.bench.stats import median

    chaos = [(f, raw) for f, raw in runs if "chaos" in f]
    records = [r for f, _ in chaos for r in f["records"]]
    figures, raw = metrics(records, rate, settings)
    figures["records"] = records
    raw["timeline"] = chaos[0][1]["timeline"] if chaos else []
    figures["batch"] = combined_batch([f["batch"] for f, _ in runs if f.get("batch")])
    figures["chaos"] = [dict(e, run=i + 1) for i, (f, _) in enumerate(runs) for e in f.get("chaos", ())]
    inside = [t for _, r in chaos for t in r.get("window_ttft", ((), ()))[0]]
    rest = [t for _, r in chaos for t in r.get("window_ttft", ((), ()))[1]]
    unanswered = sum(f.get("chaos_window", {}).get("unanswered", 0) for f, _ in chaos)
    figures.update(window_figures(inside, rest, unanswered,
                                  [w for f, _ in chaos for w in f.get("chaos_window", {}).get("windows_s", [])]))
    figures["runs"] = [run_summary(f, i + 1) for i, (f, _) in enumerate(runs)]
    figures["versus"] = {}
    for kind, with_chaos in (("without", False), ("with", True)):
        chosen = [s for s in figures["runs"] if s["chaos"] == with_chaos]
        known = {k: [s[k] for s in chosen] for k in VERSUS}
        figures["versus"][kind] = {k: median(v) if v and None not in v else None for k, v in known.items()}
        figures["versus"][kind]["runs"] = len(chosen)
    return figures, raw


def combined_batch(batches: list[dict]) -> dict:
    """Several runs' batch figures as one: counts summed, exactly once if every run was."""
    out = {k: sum(b[k] for b in batches) for k in ("lines", "answered", "duplicates", "missing", "out_not_once",
                                                   "short", "answered_in_window")}
    shares = [b["idle_share_used"] for b in batches if b["idle_share_used"] is not None]
    out.update(exactly_once=all(b["exactly_once"] for b in batches), runs=len(batches),
               tok_s_in_window=sum(b["tok_s_in_window"] for b in batches) / len(batches),
               idle_share_used=sum(shares) / len(shares) if shares else None,
               all_answered_after_s=max((b["all_answered_after_s"] or 0.0) for b in batches))
    return out


def chaos_lines(f: dict) -> list[str]:
    """The TTFT of the requests that arrived during a roll or an outage against the others, and
    with ``--chaos-alternate`` each run and the medians side by side."""
    lines = []
    w = f.get("chaos_window")
    if w:
        a, b = w["ttft_ms"], w["ttft_rest_ms"]
        lines.append(f"  arrived during the roll/outage: {w['requests']} ({w['unanswered']} unanswered), TTFT p50/p99 "
                     f"{a['p50']:.0f}/{a['p99']:.0f} ms; the others: TTFT p50/p99 {b['p50']:.0f}/{b['p99']:.0f} ms")
    if len(f.get("runs", ())) > 1:
        lines.append(f"  {'run':>5} {'chaos':>6} {'goodput':>8} {'TTFT p50/p99':>14} {'TBT p50/p99':>13} {'errors':>7}"
                     f" {'lost':>5} {'doubled':>8} {'TTFT p99 window/rest':>21}")
        for s in f["runs"] + [dict(v, run=k) for k, v in f["versus"].items()]:
            chaos = "yes" if s.get("chaos") or s["run"] == "with" else "no"
            win = (f"{s['ttft_p99_window_ms']:.0f}/{s['ttft_p99_rest_ms']:.0f}"
                   if s["ttft_p99_window_ms"] is not None else "-")
            lines.append(f"  {s['run'] if isinstance(s['run'], int) else 'median':>5} {chaos:>6} "
                         f"{s['goodput_rps']:>8.2f} {s['ttft_p50_ms']:>6.0f}/{s['ttft_p99_ms']:<7.0f} "
                         f"{s['tbt_p50_ms']:>5.0f}/{s['tbt_p99_ms']:<7.0f} {s['errors']:>7g} {s['lost']:>5g} "
                         f"{s['doubled']:>8g} {win:>21}")
    return lines


def batch_failures(result: dict) -> list[str]:
    """``mode @ rate`` of each run whose batch lines were not all answered exactly once."""
    return [f"{mode} @ {rate}" for mode, pooled in result.get("modes", {}).items()
            for rate, f in pooled.get("by_rate", {}).items()
            if f.get("batch") and not f["batch"]["exactly_once"]]
