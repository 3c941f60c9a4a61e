"""A consumer group's backlog: the one definition, for the planner's observer, ``pdqueue
status``, the metrics, the gateway, a worker's switch rules and ``up``'s drain.

An answered entry is acknowledged and deleted (``ownership.ack_and_write``), so what a request or
handoff stream holds is what its group has still to finish: ``held`` entries delivered to a
consumer and not acknowledged (the group's pending count) and ``waiting`` ones not yet
delivered (its lag; where Redis cannot tell the lag after deletions, the rest of the stream).
A stream that does not exist holds nothing; on a stream whose group does not exist yet every
entry is waiting.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple


class Backlog(NamedTuple):
    waiting: int        # not yet delivered to the group (its lag)
    held: int           # delivered to a consumer, not yet acknowledged (pending)

    @property
    def total(self) -> int:
        return self.waiting + self.held


def _name(value) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _group(groups, group: str) -> dict | None:
    if not isinstance(groups, list):      # no such stream
        return None
    return next((g for g in groups if _name(g.get("name", "")) == group), None)


def streams_backlog(r, streams: Iterable[str], group: str, *, not_held_by: str | None = None) -> Backlog:
    """The backlog of ``group`` over ``streams`` (summed), in one round trip. With
    ``not_held_by``, what that consumer holds is left out (a worker asking what the others
    would be left with)."""
    streams = list(streams)
    if not streams:
        return Backlog(0, 0)
    with r.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xinfo_groups(stream)
            pipe.xlen(stream)
            if not_held_by is not None:
                pipe.xpending(stream, group)
        replies = pipe.execute(raise_on_error=False)
    step = 2 if not_held_by is None else 3
    waiting = held = 0
    for i in range(0, len(replies), step):
        groups, length = replies[i], replies[i + 1]
        length = length if isinstance(length, int) else 0
        g = _group(groups, group)
        if g is None:                     # no group yet: everything waits (no stream: nothing)
            waiting += length
            continue
        pending = int(g.get("pending") or 0)
        lag = g.get("lag")
        # XINFO's lag is null after some deletions; acks delete entries, so the rest of the
        # stream is what waits
        waiting += int(lag) if lag is not None else max(0, length - pending)
        if not_held_by is not None and isinstance(replies[i + 2], dict):
            pending -= sum(int(c["pending"]) for c in replies[i + 2].get("consumers") or []
                           if _name(c["name"]) == not_held_by)
        held += max(0, pending)
    return Backlog(waiting, held)


def group_backlog(r, stream: str, group: str) -> Backlog:
    """The backlog of ``group`` on one stream: ``(waiting, held)``, i.e. (lag, pending)."""
    return streams_backlog(r, [stream], group)


__all__ = ["Backlog", "group_backlog", "streams_backlog"]
