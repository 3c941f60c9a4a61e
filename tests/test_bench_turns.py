"""`pdqueue bench serve --workload multiturn` and `--runs`: the sessions' plan (seeded, the
lengths and counts it promises, Poisson arrivals), the history each turn resends (the last
prompt, the answer read back from the completion, the new user tokens), the figures per
turn and over repeated runs (pure), and a small run end to end on tiny workers without and
with the KV tiers (processes, real Redis)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from pdqueue.bench.serve_load import TURNS, USER_TOKENS, Planned, Settings, plan_sessions
from pdqueue.protocol import Completion, FinishReason
from tests.cluster import ROOT


def settings(**kw) -> Settings:
    return Settings.for_model("smollm2", workload_kind="multiturn", **kw)


# ---- the plan (pure) ----------------------------------------------------------------------

def test_sessions_are_seeded_and_keep_their_ranges():
    s = settings()
    sessions = plan_sessions(s, 0.5, 400)
    assert sessions == plan_sessions(s, 0.5, 400)   # the same list for every mode and run
    assert sessions != plan_sessions(settings(seed=1), 0.5, 400)
    assert sessions[:5] != plan_sessions(s, 1.0, 5)
    assert [x.index for x in sessions] == list(range(400))
    assert {x.turns for x in sessions} == set(range(TURNS[0], TURNS[1] + 1))   # uniform over 3..6: each seen
    for x in sessions:
        assert len(x.max_tokens) == x.turns
        assert all(USER_TOKENS[0] <= len(u) <= USER_TOKENS[1] for u in x.user)
        assert all(s.workload.short_output[0] <= n <= s.workload.short_output[1] for n in x.max_tokens)
        assert all(3 <= t < s.workload.vocab_size for u in x.user for t in u)
    lengths = [len(u) for x in sessions for u in x.user]
    assert min(lengths) < 40 and max(lengths) > 248   # the whole range, not a corner of it


def test_sessions_arrive_by_poisson_at_the_rate():
    arrivals = [x.at_s for x in plan_sessions(settings(), 2.0, 3000)]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    mean = sum(gaps) / len(gaps)
    assert 0.47 < mean < 0.53   # 1 / rate
    # exponential gaps: their standard deviation is their mean (a fixed spacing would have none)
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert 0.9 * mean < sd < 1.1 * mean


def test_each_turn_resends_the_last_prompt_and_its_answer_then_new_text():
    from pdqueue.bench.serve_turns import Conversation

    (session,) = plan_sessions(settings(), 1.0, 1)
    talk, prompts = Conversation(session), []
    for turn in range(session.turns):
        prompts.append(talk.prompt(turn))
        talk.answered(prompts[-1], [1000 + turn] * session.max_tokens[turn])
    assert prompts[0] == session.user[0]
    for turn in range(1, session.turns):
        answer = (1000 + turn - 1,) * session.max_tokens[turn - 1]
        assert prompts[turn] == prompts[turn - 1] + answer + session.user[turn]
        assert len(prompts[turn]) > len(prompts[turn - 1]) + USER_TOKENS[0]


class _Handle:
    def __init__(self, prompt, max_tokens):
        # an answer that depends on the prompt: its last tokens, reversed, repeated
        self.answer = tuple((list(reversed(prompt[-7:])) * max_tokens)[:max_tokens])
        self.completion = None
        self.request_id = f"r{len(prompt)}"

    async def stream(self, timeout=None):
        from pdqueue.protocol import ResultEvent, ResultType

        for i, token in enumerate(self.answer):
            await asyncio.sleep(0.001)
            yield ResultEvent(ResultType.TOKEN, f"{int(time.time() * 1000)}-{i}", i, (token,))
        self.completion = Completion(self.request_id, "", self.answer, FinishReason.LENGTH,
                                     num_prompt_tokens=0, cached_tokens=3, kv_reused_tokens=2)


class _AnsweringClient:
    """The client's side of pdqueue as send_one uses it (submit, then the stream and the
    completion), answering each prompt at once: what run_sessions sends, and when."""

    def __init__(self, fail_at: tuple[int, int] | None = None):
        self.sent: list[tuple[float, tuple[int, ...], int]] = []
        self.answered: dict[tuple[int, ...], tuple[float, tuple[int, ...]]] = {}
        self.fail_at = fail_at

    async def submit(self, *, prompt_ids, max_tokens, seed, **_kw):
        self.sent.append((time.perf_counter(), tuple(prompt_ids), seed))
        if self.fail_at is not None and seed == self.fail_at[0] * 16 + self.fail_at[1]:
            raise RuntimeError("refused")
        handle = _Handle(tuple(prompt_ids), max_tokens)
        return handle


def test_the_runner_sends_each_turn_after_the_last_answer_with_that_answer_in_its_history():
    from pdqueue.bench.serve_turns import run_sessions, turn_metrics

    s = settings(think_s=0.02)
    sessions = plan_sessions(s, 50.0, 4)
    client = _AnsweringClient()
    records = asyncio.run(run_sessions(client, sessions, s))
    assert [(r.planned.session, r.planned.turn) for r in records] == \
        [(x.index, t + 1) for x in sessions for t in range(x.turns)]
    by_key = {(r.planned.session, r.planned.turn): r for r in records}
    for x in sessions:
        first = by_key[(x.index, 1)]
        assert first.planned.prompt_ids == x.user[0] and first.completion is not None
        for turn in range(2, x.turns + 1):
            last, this = by_key[(x.index, turn - 1)], by_key[(x.index, turn)]
            answer = tuple(last.completion.token_ids)
            assert answer == _Handle(last.planned.prompt_ids, x.max_tokens[turn - 2]).answer   # read back
            assert this.planned.prompt_ids == last.planned.prompt_ids + answer + x.user[turn - 1]
            assert this.submitted >= last.finished + 0.02   # after the answer, and the think time
    assert len(client.sent) == len(records) and all(r.error is None for r in records)
    figures, raw = turn_metrics(records, 50.0, s)
    assert figures["sessions"] == 4 and figures["completed"] == len(records)
    later = [r for r in records if r.planned.turn >= 2]
    assert figures["later_turns"]["requests"] == len(later)
    assert figures["prefix_cache_hit_rate"] == pytest.approx(
        3 * len(records) / sum(len(r.planned.prompt_ids) for r in records))
    assert set(figures["by_turn"]) == {str(t) for t in range(1, max(x.turns for x in sessions) + 1)}
    rows = [dict(zip(("session", "turn", "prompt_tokens", "answer_tokens"), row)) for row in raw["turns"]]
    for row, r in zip(rows, records):
        assert row["prompt_tokens"] == len(r.planned.prompt_ids) and row["answer_tokens"] == r.planned.max_tokens


def test_a_failed_turn_ends_its_session_and_the_rest_count_as_failed():
    from pdqueue.bench.serve_turns import run_sessions, turn_metrics

    s = settings()
    sessions = plan_sessions(s, 50.0, 2)
    records = asyncio.run(run_sessions(_AnsweringClient(fail_at=(0, 1)), sessions, s))   # session 0, turn 2
    mine = [r for r in records if r.planned.session == 0]
    assert len(mine) == sessions[0].turns
    assert mine[0].error is None and "refused" in mine[1].error
    assert all(r.error.startswith("not sent: turn 2") for r in mine[2:])
    figures, _ = turn_metrics(records, 50.0, s)
    assert figures["requests"] == sum(x.turns for x in sessions)
    assert figures["failed"] == sessions[0].turns - 1
    assert figures["later_turns"]["failed"] == sessions[0].turns - 1


def _record(session: int, turn: int, ttft_s: float, cached: int = 0) -> "object":
    from pdqueue.bench.serve_client import Record

    r = Record(Planned(0.0, "later", (5,) * 100, 3, session=session, turn=turn))
    r.submitted, r.token_times, r.finished = 10.0, [10.0 + ttft_s, 10.1 + ttft_s, 10.2 + ttft_s], 10.3 + ttft_s
    r.completion = Completion("x", "", (1, 2, 3), FinishReason.LENGTH, cached_tokens=cached)
    return r


def test_runs_pool_their_requests_and_give_each_run_and_the_spread():
    from pdqueue.bench.serve_runs import combined, runs_lines
    from pdqueue.bench.serve_turns import turn_metrics

    s = settings(runs=3)
    runs = []
    for ttft_s in (0.1, 0.2, 5.0):   # the third run misses the TTFT SLO (4 s) on every turn
        records = [_record(0, 1, ttft_s), _record(0, 2, ttft_s, 50), _record(1, 1, ttft_s)]
        figures, raw = turn_metrics(records, 0.5, s)
        figures["records"], raw["timeline"] = records, [{"t": ttft_s}]
        runs.append(({"idle_overhead_ms": {"p50": 1.0}, "0.5": figures}, {"0.5": raw}))
    by_rate, raw = combined(runs, s, turn_metrics)
    f = by_rate["0.5"]
    assert f["requests"] == 9 and f["sessions"] == 6 and len(f["records"]) == 9
    assert [x["run"] for x in f["runs"]] == [1, 2, 3]
    # 2 sessions, 3 turns each run, at 0.5 sessions/s: 0.75 turns/s, all within the SLOs or none
    assert [x["goodput_rps"] for x in f["runs"]] == pytest.approx([0.75, 0.75, 0.0])
    assert f["goodput_rps"] == pytest.approx(0.5)   # pooled: 6 of 9 turns
    assert f["spread"]["goodput_rps"] == pytest.approx({"min": 0.0, "median": 0.75, "max": 0.75})
    assert f["spread"]["later_ttft_p50_ms"]["max"] == pytest.approx(5000.0)
    assert f["later_turns"]["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert raw["0.5"]["timeline"] == [{"t": 0.1}]
    assert all("records" in by["0.5"] for by, _ in runs)   # the runs' own figures kept for the next combine
    lines = runs_lines({"modes": {"disagg": {"by_rate": by_rate}}})
    assert len(lines) == 1 + 3 + 3 and "runs of disagg @ 0.5" in lines[0]


def test_the_kept_modes_pass_their_options_and_the_tiers_one_fresh_directory_per_start(tmp_path):
    from pdqueue.bench.serve_modes import SCRATCH, mode_workers

    s = settings(kv_host_tier_mb=64, kv_disk_gb=0.5)
    workers = mode_workers("disagg-tiers", s, tmp_path)
    assert [role for role, _ in workers] == ["prefill", "decode"]
    for _, extra in workers:
        at = extra.index("--kv-disk-dir")
        assert extra[at + 1] == f"{tmp_path}/kv" and SCRATCH not in " ".join(extra)
        assert extra[extra.index("--kv-host-tier-mb") + 1] == "64" and extra[extra.index("--kv-disk-gb") + 1] == "0.5"
        assert extra[extra.index("--kv-pull") + 1] == "never"
    for mode, pull in (("disagg-recompute", "never"), ("disagg-pull", "always"), ("colocated-chunked-pull", "always")):
        for _, extra in mode_workers(mode, s, tmp_path):
            assert "--kv-disk-dir" not in extra and extra[extra.index("--kv-pull") + 1] == pull
    assert all("--kv-pull" not in extra for _, extra in mode_workers("disagg", s, tmp_path))   # the default


# ---- end to end (processes) ---------------------------------------------------------------

@pytest.mark.processes
@pytest.mark.timeout(240)
def test_serve_multiturn_smoke_without_and_with_the_tiers(tmp_path):
    """Three sessions on tiny workers, the split keeping the last turn three ways (the pools
    only, the KV tiers, pulled): every turn answered, each turn's prompt the last one's, its
    answer and the new user tokens (by length; the plan gives the user tokens), the previous
    prompt served from the prefill worker's cache; with the tiers or the pull the answers'
    blocks too (more cached)."""
    proc = subprocess.run([sys.executable, "-m", "workers.cli", "bench", "serve", "--model", "tiny",
                           "--workload", "multiturn", "--rates", "2", "--num-requests", "3", "--warmup", "1",
                           "--kv-host-tier-mb", "16", "--kv-disk-gb", "0.1", "--json", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert set(result["modes"]) == {"disagg-recompute", "disagg-tiers", "disagg-pull"}
    assert result["workload"]["kind"] == "multiturn" and result["workload"]["rate_unit"] == "sessions/s"
    sessions = plan_sessions(Settings.for_model("tiny", workload_kind="multiturn"), 2.0, 3)
    cached_later = {}
    for mode, pooled in result["modes"].items():
        f = pooled["by_rate"]["2"]
        assert f["sessions"] == 3 and f["completed"] == f["requests"] == sum(x.turns for x in sessions), f["errors"]
        assert f["later_turns"]["completed"] == f["requests"] - 3
        assert f["later_turns"]["ttft_ms"]["p50"] > 0 and f["goodput_rps"] > 0
        rows = [dict(zip(("session", "turn", "prompt_tokens", "answer_tokens", "ttft_ms", "e2e_ms", "cached_tokens",
                          "kv_reused_tokens", "error"), row)) for row in result["raw"][mode]["2"]["turns"]]
        by_key = {(row["session"], row["turn"]): row for row in rows}
        for x in sessions:
            for turn in range(2, x.turns + 1):
                last, this = by_key[(x.index, turn - 1)], by_key[(x.index, turn)]
                assert last["answer_tokens"] == x.max_tokens[turn - 2]
                assert this["prompt_tokens"] == last["prompt_tokens"] + last["answer_tokens"] + len(x.user[turn - 1])
                assert this["cached_tokens"] >= last["prompt_tokens"] // 16 * 16, (mode, this, last)
        cached_later[mode] = sum(row["cached_tokens"] for row in rows if row["turn"] >= 2)
    assert cached_later["disagg-tiers"] > cached_later["disagg-recompute"], cached_later
    assert cached_later["disagg-pull"] > cached_later["disagg-recompute"], cached_later
    assert (tmp_path / "serve.json").exists()
