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
from pdqueue.bench.serve_chaos import Event, chaos_text, parse_chaos
from pdqueue.bench.serve_load import Settings
from pdqueue.bench.serve_report import batch_failures, batch_lines
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
