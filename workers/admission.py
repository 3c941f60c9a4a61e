"""Admission of the classes that yield (``pdqueue.protocol.ServiceClass.yields``: the batch
class): only into the capacity the higher classes leave.

A request role reads the other classes' streams (``requests:high``, interactive; its own
stream and ``requests``, standard) every turn; a yielding class's stream (``requests:batch``)
only as many entries as ``BatchGate.limit`` gives (the role asks for no more than the engine's
free background slots, ``EngineConfig.background_seqs``):

- no higher-class work waiting in the engine (a waiting request is one not yet admitted to
  a step: batch must not take the slot or the KV it would get);
- free KV blocks above ``reserve`` of the pool, so a burst of interactive prompts finds room
  without preempting anything;
- at most ``max_running`` batch requests in the engine at once (0: no cap beyond the KV).

So that batch never starves under a steady higher-class load, the gate also opens once every
``starve_s`` while batch work is held back (one entry, ``STARVE_TAKE``): the bounded share.
Pure: no Redis, no engine; the role passes in what it sees.
"""

from __future__ import annotations

from dataclasses import dataclass

STARVE_TAKE = 1
"""Batch entries taken by a starvation turn."""


@dataclass(slots=True)
class BatchGate:
    reserve: float = 0.2       # share of the KV pool kept free for the higher classes
    max_running: int = 0       # batch requests in the engine at once (0: bounded by the KV only)
    starve_s: float = 5.0      # a starved batch class still gets one entry this often (0: never)
    _last_open_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserve < 1.0:
            raise ValueError(f"batch KV reserve must be in [0, 1), got {self.reserve!r}")
        if self.max_running < 0:
            raise ValueError(f"batch max_running must be >= 0, got {self.max_running!r}")
        if self.starve_s < 0:
            raise ValueError(f"batch starve_s must be >= 0, got {self.starve_s!r}")

    def limit(self, *, waiting: int, kv_free: int, kv_total: int, batch_running: int,
              want: int, now_s: float) -> int:
        """How many batch entries to read now (0: the gate is shut)."""
        if want <= 0:
            return 0
        if self._last_open_s is None:
            self._last_open_s = now_s
        room = want
        if self.max_running:
            room = min(room, self.max_running - batch_running)
        if waiting == 0 and kv_total > 0 and kv_free > self.reserve * kv_total and room > 0:
            self._last_open_s = now_s
            return room
        if self.starve_s and now_s - self._last_open_s >= self.starve_s:
            self._last_open_s = now_s   # the bounded share: one entry, even past the reserve
            return STARVE_TAKE
        return 0
