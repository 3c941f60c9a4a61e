"""`pdqueue bench serve --workload multiturn`: conversations whose next turn resends the whole
history, sent once the last answer arrived, and their figures per turn.

The load. ``serve_load.plan_sessions`` plans, seeded and the same for every mode and run,
each session's arrival (Poisson, the rate in sessions/s), its number of turns and each turn's
new user tokens and answer length. ``run_sessions`` sends them: a session's first turn at its
arrival, each later turn ``Settings.think_s`` after the previous answer's done entry arrived,
its prompt the previous turn's prompt, then the previous answer, then the new user tokens
(``Conversation``). The answer is read back from the done entry's completion (its token
ids, as the worker generated them: the bench speaks token ids, so the history a chat client
would resend is exactly the tokens whose KV the workers computed), so the next turn's
history is the real one and its KV may be reused from the pool, the tiers or another worker.
A turn that fails ends its session; its turns not sent count as failed.

The figures (``turn_metrics``): every turn is a request as in the other workloads (TTFT,
TBT, e2e, from the client's clock; ``cached_tokens`` and ``kv_reused_tokens`` from the done
entry), over every turn and over turns 2 and later apart (``later_turns``: the turns a
history could help). Goodput counts turns within both SLOs per second of session arrivals
(the session rate times the mean number of such turns per session), so it compares across
modes at one rate as the other workloads' goodput does. ``by_turn`` gives TTFT and the
cached share by turn number, and the raw output one row per turn (``TURN_ROW``).

Imports the standard library and the bench's own modules; the client is passed in.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from pdqueue.bench.serve_client import Record, send_one
from pdqueue.bench.serve_load import Planned, Session, Settings
from pdqueue.bench.serve_report import metrics
from pdqueue.bench.stats import summary


class Conversation:
    """One session's history as a chat client keeps it: each prompt is the history so far
    and the turn's new user tokens; an answer is appended to the prompt it answered."""

    def __init__(self, session: Session):
        self.session = session
        self.history: tuple[int, ...] = ()

    def prompt(self, turn: int) -> tuple[int, ...]:
        """Turn ``turn``'s prompt (from 0): the history and its user tokens."""
        return self.history + self.session.user[turn]

    def answered(self, prompt: tuple[int, ...], answer_ids) -> None:
        self.history = tuple(prompt) + tuple(int(t) for t in answer_ids)


def _planned(session: Session, turn: int, at_s: float, prompt: tuple[int, ...]) -> Planned:
    return Planned(at_s, "first" if turn == 0 else "later", prompt, session.max_tokens[turn],
                   session=session.index, turn=turn + 1)


async def run_sessions(client, sessions: list[Session], settings: Settings,
                       on_done: Callable[[], None] = lambda: None) -> list[Record]:
    """Every session of ``sessions``, each from its arrival to its last answer (each turn at
    most ``settings.drain_timeout_s`` from its submission); one Record per planned turn, in
    session and turn order, ``planned.at_s`` when it was sent (from the start)."""
    start = time.perf_counter()
    by_session: list[list[Record]] = [[] for _ in sessions]

    async def converse(session: Session) -> None:
        delay = start + session.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        talk, records = Conversation(session), by_session[session.index]
        try:
            for turn in range(session.turns):
                prompt = talk.prompt(turn)
                planned = _planned(session, turn, time.perf_counter() - start, prompt)
                record = Record(planned)
                records.append(record)
                await send_one(client, planned, session.index * 16 + turn, record, settings.drain_timeout_s)
                on_done()
                if record.finished is None or record.completion is None:
                    break
                talk.answered(prompt, record.completion.token_ids)
                if settings.think_s and turn + 1 < session.turns:
                    await asyncio.sleep(settings.think_s)
        finally:   # the turns never sent (an earlier one failed, or the run was cut short)
            failed = len(records)
            for turn in range(len(records), session.turns):
                record = Record(_planned(session, turn, 0.0, ()))
                record.error = f"not sent: turn {failed} of its session failed"
                records.append(record)
                on_done()

    await asyncio.gather(*(converse(s) for s in sessions))
    return [r for records in by_session for r in records]


# One row per turn in the raw output (``raw[mode][rate]["turns"]``).
TURN_ROW = ("session", "turn", "prompt_tokens", "answer_tokens", "ttft_ms", "e2e_ms", "cached_tokens",
            "kv_reused_tokens", "error")


def _row(r: Record) -> list:
    c = r.completion
    answered = r.finished is not None and bool(r.token_times)
    return [r.planned.session, r.planned.turn, len(r.planned.prompt_ids), c.num_tokens if c is not None else 0,
            (r.token_times[0] - r.submitted) * 1e3 if answered else None,
            (r.finished - r.submitted) * 1e3 if answered else None,
            getattr(c, "cached_tokens", 0), getattr(c, "kv_reused_tokens", 0), r.error]


LATER_KEYS = ("requests", "completed", "failed", "ttft_ms", "tbt_ms", "e2e_ms", "goodput_rps", "slo_attainment",
              "prefix_cache_hit_rate", "decode_kv_reuse_rate")


def turn_metrics(records: list[Record], rate: float, settings: Settings) -> tuple[dict, dict]:
    """(figures, raw values) of one multi-turn run, or of several pooled (``rate``: sessions
    per second; a session is counted by its first turn, which every session has)."""
    sessions = sum(1 for r in records if r.planned.turn == 1)
    scale = rate / sessions if sessions else 0.0   # requests per second = rate x turns / sessions
    figures, raw = metrics(records, scale * len(records), settings)
    later = [r for r in records if r.planned.turn >= 2]
    later_figures, _ = metrics(later, scale * len(later), settings)
    figures["sessions"] = sessions
    figures["later_turns"] = {k: later_figures[k] for k in LATER_KEYS}
    ok = [r for r in records if r.finished is not None and r.token_times]
    figures["by_turn"] = {}
    for turn in sorted({r.planned.turn for r in records}):
        mine = [r for r in ok if r.planned.turn == turn]
        prompt = sum(len(r.planned.prompt_ids) for r in mine)
        figures["by_turn"][str(turn)] = {
            "requests": sum(1 for r in records if r.planned.turn == turn), "completed": len(mine),
            "ttft_ms": summary((r.token_times[0] - r.submitted) * 1e3 for r in mine),
            "prompt_tokens_mean": prompt / len(mine) if mine else 0.0,
            "cached_share": sum(r.completion.cached_tokens for r in mine) / prompt if prompt else 0.0,
            "kv_reused_share": sum(r.completion.kv_reused_tokens for r in mine) / prompt if prompt else 0.0}
    raw["turns"] = [_row(r) for r in records]
    return figures, raw


def turn_lines(result: dict) -> list[str]:
    """The multi-turn figures of each mode and rate, for the printed table: every turn, and
    turns 2 and later apart (TTFT, goodput, the prompt tokens served from the cache)."""
    if result.get("workload", {}).get("kind") != "multiturn":
        return []
    lines = ["multi-turn sessions (rate: sessions/s; goodput: turns/s within both SLOs; cached: prompt tokens "
             "not computed; reused: not fetched by the decode side)",
             f"{'mode':<25}{'rate':>6}{'sessions':>9}  {'TTFT p50/p99 all':>17}  {'turns>=2':>13}"
             f"  {'goodput all/>=2':>16}  {'cached all/>=2':>15}  {'reused >=2':>10}"]
    for mode, pooled in result["modes"].items():
        for rate, f in pooled["by_rate"].items():
            t, later = f["ttft_ms"], f.get("later_turns")
            if later is None:
                continue
            lt = later["ttft_ms"]
            lines.append(f"{mode:<25}{rate:>6}{f.get('sessions', 0):>9}  {t['p50']:>8.0f} {t['p99']:>8.0f}"
                         f"  {lt['p50']:>6.0f} {lt['p99']:>6.0f}  {f['goodput_rps']:>7.2f} {later['goodput_rps']:>8.2f}"
                         f"  {f['prefix_cache_hit_rate']:>6.0%} {later['prefix_cache_hit_rate']:>8.0%}"
                         f"  {later['decode_kv_reuse_rate']:>10.0%}")
    return lines
