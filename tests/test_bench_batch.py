"""`bench serve --batch-lines`' exactly-once check (``serve_batch.BatchBeside``) and the
``--chaos`` events it is run under (``serve_chaos``), without workers: answers written by
hand on the session's Redis, so that a missing, doubled or short answer is seen to fail the
check (tests/test_bench.py runs the whole bench with real faults, where it passes)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pdqueue.bench.serve_batch import BatchBeside
from pdqueue.bench.serve_chaos import Event, chaos_schedule, chaos_text, parse_chaos
from pdqueue.bench.serve_client import HttpCompletion, Record
from pdqueue.bench.serve_load import Planned, Settings
from pdqueue.bench.serve_report import (
    alternated,
    batch_failures,
    batch_lines,
    chaos_event_line,
    chaos_lines,
    metrics,
    window_figures,
    window_split,
)
from pdqueue.client import AsyncClient
from pdqueue.keys import Keys

TOKENS = 4


def _answer(r, keys: Keys, rid: str, tokens: int = TOKENS, copies: int = 1) -> None:
    """A worker's answer: ``done`` on out:<id> and its copy on the done stream."""
    fields = {"type": "done", "id": rid, "token_ids": json.dumps(list(range(tokens))), "finish_reason": "length"}
    for _ in range(copies):
        r.xadd(keys.out(rid), fields)
        r.xadd(keys.done, fields)


def _run(redis_url: str, r, answer) -> dict:
    """Queue 5 batch lines, ``answer(ids)`` them by hand, and check (finish)."""
    settings = Settings.for_model("tiny", batch_lines=5, batch_max_tokens=TOKENS)
    keys = Keys("check")

    async def run() -> dict:
        batch = BatchBeside(redis_url, "check", settings, 1.0)
        async with AsyncClient(redis_url, "check") as client:
            started = time.time()
            await batch.start(client)
            answer(sorted(batch.ids), keys)
            return await batch.finish(started, time.time(), 0.0, timeout_s=2.0)

    return asyncio.run(run())


def test_every_line_answered_once_passes(redis_url, r):
    figures = _run(redis_url, r, lambda ids, keys: [_answer(r, keys, rid) for rid in ids])
    assert figures["exactly_once"] and figures["answered"] == figures["lines"] == 5, figures
    assert figures["duplicates"] == figures["missing"] == figures["out_not_once"] == figures["short"] == 0


def test_a_missing_doubled_or_short_answer_fails_the_check(redis_url, r):
    def answer(ids, keys):
        _answer(r, keys, ids[0])
        _answer(r, keys, ids[1], copies=2)                                   # doubled
        r.xadd(keys.out(ids[2]), {"type": "error", "reason": "lost", "code": "internal"})   # never answered
        _answer(r, keys, ids[3], tokens=TOKENS - 1)                          # short
        _answer(r, keys, ids[4])

    figures = _run(redis_url, r, answer)
    assert not figures["exactly_once"]
    assert (figures["answered"], figures["duplicates"], figures["missing"]) == (4, 1, 1), figures
    assert (figures["out_not_once"], figures["out_errors"], figures["short"]) == (2, 1, 1), figures
    result = {"modes": {"disagg": {"by_rate": {"2": {"batch": figures}}}}}
    assert batch_failures(result) == ["disagg @ 2"]
    assert any(line.startswith("!! FAILED: disagg @ 2: batch lines NOT answered exactly once") for line in
               batch_lines(result)), batch_lines(result)


def test_chaos_events_are_parsed():
    assert parse_chaos("kill-worker,restart-redis") == (Event("kill-worker"), Event("restart-redis"))
    events = parse_chaos(" kill-worker:prefill@5 , restart-redis@7.5")
    assert events == (Event("kill-worker", 5.0, "prefill"), Event("restart-redis", 7.5))
    assert chaos_text(events) == "kill-worker:prefill@5,restart-redis@7.5"
    for bad in ("", "kill", "restart-redis:decode", "kill-worker:gateway", "kill-worker@x", "kill-worker@-1"):
        with pytest.raises(ValueError):
            parse_chaos(bad)


def test_rolling_restart_and_zero_capacity_are_parsed():
    events = parse_chaos("rolling-restart, zero-capacity, zero-capacity:5@12")
    assert events == (Event("rolling-restart"), Event("zero-capacity"), Event("zero-capacity", 12.0, None, 5.0))
    assert chaos_text(events) == "rolling-restart,zero-capacity,zero-capacity:5@12"
    for bad in ("rolling-restart:decode", "zero-capacity:x", "zero-capacity:-1", "zero-capacity:decode"):
        with pytest.raises(ValueError):
            parse_chaos(bad)
    assert chaos_schedule(False, 3) == [False]   # no chaos: one plain run, whatever N
    assert chaos_schedule(True, 0) == [True]
    assert chaos_schedule(True, 2) == [False, True, False, True]


def _record(at_s: float, ttft_s: float | None, start: float = 1000.0) -> Record:
    """A request that arrived ``at_s`` after ``start`` (perf_counter) with that TTFT (None:
    unanswered), three tokens 10 ms apart."""
    r = Record(Planned(at_s, "short", (5, 6, 7), 3), submitted=start + at_s)
    if ttft_s is not None:
        first = start + at_s + ttft_s
        r.token_times = [first, first + 0.01, first + 0.02]
        r.token_entry_ms = [0, 10, 20]
        r.finished = first + 0.02
        r.completion = HttpCompletion(num_tokens=3)
    else:
        r.error = "TimeoutError: no answer"
    return r


def test_the_window_of_a_roll_or_an_outage_and_runs_side_by_side():
    settings = Settings.for_model("tiny", rates=[2.0], batch_lines=4)
    records = [_record(0.5, 0.05), _record(2.0, 3.0), _record(4.0, 1.0), _record(4.5, None), _record(9.0, 0.05)]
    events = [{"event": "kill-worker", "at_s": 1.0},   # no window
              {"event": "zero-capacity", "at_s": 1.5, "until_s": 5.0}]
    inside, rest, unanswered = window_split(records, 1000.0, events)
    assert [round(t) for t in inside] == [3000, 1000] and [round(t) for t in rest] == [50, 50] and unanswered == 1

    def run(with_chaos: bool) -> tuple[dict, dict]:
        figures, raw = metrics(records if with_chaos else records[:1] + records[-1:], 2.0, settings)
        figures["records"], raw["timeline"] = list(records), []
        figures["batch"] = {"lines": 4, "answered": 4, "duplicates": 0, "missing": 0, "out_not_once": 0, "short": 0,
                            "answered_in_window": 2, "exactly_once": True, "tok_s_in_window": 10.0,
                            "idle_share_used": None, "all_answered_after_s": 3.0}
        if with_chaos:
            figures["chaos"] = [dict(events[1], stopped=["prefill-0-aaaa"], started=["prefill-0-bbbb"],
                                     outage_end_s=3.5, capacity_back_s=5.0)]
            figures.update(window_figures(inside, rest, unanswered, [[1.5, 5.0]]))
            raw["window_ttft"] = (inside, rest)
        return figures, raw

    runs = [run(False), run(True), run(False), run(True)]
    runs[3][0]["batch"] = dict(runs[3][0]["batch"], duplicates=1, exactly_once=False)
    figures, raw = alternated(runs, 2.0, settings)
    assert [(s["run"], s["chaos"]) for s in figures["runs"]] == [(1, False), (2, True), (3, False), (4, True)]
    assert figures["requests"] == 10 and figures["failed"] == 2   # the chaos runs' requests, pooled
    assert figures["chaos_window"]["requests"] == 6 and figures["chaos_window"]["unanswered"] == 2
    assert round(figures["chaos_window"]["ttft_ms"]["p99"]) > 2900 > figures["chaos_window"]["ttft_rest_ms"]["p99"]
    assert [e["run"] for e in figures["chaos"]] == [2, 4]
    assert figures["batch"]["lines"] == 16 and figures["batch"]["duplicates"] == 1
    assert not figures["batch"]["exactly_once"]   # one run's doubled line fails the whole rate
    with_, without = figures["versus"]["with"], figures["versus"]["without"]
    assert with_["runs"] == without["runs"] == 2 and with_["errors"] == 1 and without["errors"] == 0
    assert without["ttft_p99_window_ms"] is None and with_["ttft_p99_window_ms"] > with_["ttft_p99_rest_ms"]
    assert with_["doubled"] == 0.5 and without["goodput_rps"] > with_["goodput_rps"]
    text = "\n".join(chaos_lines(figures))
    assert "arrived during the roll/outage: 6 (2 unanswered)" in text and text.count("median") == 2, text
    assert "zero-capacity at 1.5 s: stopped prefill-0-aaaa (warm), started prefill-0-bbbb at 3.5 s, capacity " \
           "back at 5.0 s" in chaos_event_line(figures["chaos"][0])
