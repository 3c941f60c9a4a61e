"""What a policy (``reactive``, ``predictive``) sees of one decision in the making: the
observation, the counts and signals, the streaks, and the ways to answer (hold, issue moves,
step toward a target). ``planner.Turn`` is the one implementation; the policies depend on
this interface, not on the planner that calls them. Standard library only."""

from __future__ import annotations

from typing import Protocol, Sequence

from pdqueue.control.capacity import Capacity
from pdqueue.control.decision import Decision, Move
from pdqueue.control.observation import Observation
from pdqueue.control.signals import Signals


class Turn(Protocol):
    obs: Observation
    counts: dict[str, int]
    m: Signals
    signals: dict

    @property
    def capacity(self) -> Capacity: ...

    @property
    def summary(self) -> str: ...

    def streak(self, side: str) -> int: ...

    def confirmed(self, side: str) -> bool:
        """The side has been short ``confirm`` observations in a row."""
        ...

    def note(self, text: str) -> None: ...

    def plan(self, target: dict[str, int], max_moves: int) -> tuple[list[Move], list[str]]: ...

    def hold(self, reason: str, action: str = "hold") -> Decision: ...

    def issue(self, moves: Sequence[Move], action: str, reason: str) -> Decision: ...

    def step(self, target: dict[str, int], reason: str, blocked: str) -> Decision:
        """One move toward ``target``; if none can be made, a hold saying ``blocked`` and why."""
        ...
