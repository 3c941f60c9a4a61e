"""The colocated role: prefill and decode in one engine (the baseline pdqueue is measured
against, and a complete server on its own).

A request here, from XADD to done:

    requests:high, then requests (group prefill), at most min(free batch slots, 16) at a time
      -> accept:   Intake (workers/intake.py) admits it into the engine (``inflight``), or
                   answers it at once (expired, cancelled, duplicate, invalid)
      -> step:     every token goes to out:<id> through the publisher
      -> publish:  on finish, one unit: the last token, and the request entry finished
                   (once: ack_and_write) with done on out:<id> and its copy on ``done``
                   (``transfer_path`` local)
      -> stop:     every ~100 ms, cancelled or expired requests end at once (blocks freed)
                   with a done entry of reason cancelled/expired; before every step, a
                   classed request past its deadline with no token out yet is answered
                   deadline_exceeded (``RequestRole.refuse_late``)

Dropped (another worker took the entry over): aborted, no answer.

Stopping (a warm stop, a switch): the requests decoding here move to a decode worker with
their KV and tokens so far, when one takes work (workers/migration.py: the request entry is
finished with a handoff, as a prefill worker's would be); the others finish here.
"""

from __future__ import annotations

from pdqueue.control.commands import MIGRATE
from pdqueue.engine.config import PrefillPolicy
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.protocol import Handoff, encode_handoff
from pdqueue.protocol import Role as RoleName
from workers.common import Every, now_ms
from workers.compat import sender_fields
from workers.kv_holds import KVHolds
from workers.migration import Migrator
from workers.role import RequestRole, RoleHost

CHECK_EVERY_S = 0.1   # cancel keys and deadlines of the requests in hand


class ColocatedRole(RequestRole):
    name = RoleName.COLOCATED.value

    def start(self, shell: RoleHost) -> None:
        super().start(shell)
        self.engine = LLMEngine(shell.loaded, shell.config.engine, kv_cache=shell.kv_pool())
        self.holds = KVHolds(shell, self.engine)   # finished requests' KV, for the next turn's puller
        self.migrator = Migrator(shell, self.engine) if shell.config.migrate else None
        self._check = Every(CHECK_EVERY_S)
        self._migrate: tuple[int, str] | None = None         # (count, command id) asked by a planner

    def load(self) -> dict:
        load = {**super().load(), "step_ms": round(self.step_s * 1000, 2),
                "prefix_cache_queries": self.engine.prefix_cache_queries,
                "prefix_cache_hits": self.engine.prefix_cache_hits,
                "migrated_out": self.migrator.moved if self.migrator is not None else 0, **self.holds.load()}
        load["kv_free"] += self.holds.reclaimable()   # given back on demand (workers/kv_holds.py)
        if self.engine.config.policy == PrefillPolicy.CHUNKED:   # it takes budget commands (0: none)
            load["tbt_budget_ms"] = self.engine.scheduler.tbt.target_ms or 0
        return load

    def read_limit(self) -> int:
        """No more than the free batch slots: the rest stays in Redis for other workers."""
        return min(self.shell.config.engine.max_num_seqs - self.engine.num_running,
                   self.shell.config.max_batch_requests)

    def housekeeping(self) -> None:
        """Before each step: moves when stopping; every ~100 ms: end cancelled and expired
        requests (blocks freed, done published)."""
        self.holds.relieve()
        if self.migrator is not None:
            self.migrator.free_released()
            if not self.shell.accepting and self.inflight:
                self.migrate_out()
            elif self._migrate is not None:
                self._migrate_asked()
        if not self._check.due():
            return
        self.end_stopped(self.inflight)

    # ---- the planner's levers (commands: workers/switching.py) -----------------------------
    def set_tbt_budget(self, tbt_slo_ms: float | None) -> str | None:
        """The chunked policy's TBT target from now on (None: chunks fill the token budget);
        why not, if it cannot."""
        try:
            self.engine.set_tbt_target(tbt_slo_ms)
        except ValueError as e:
            return str(e)
        return None

    def migrate_some(self, count: int, command_id: str) -> str | None:
        """Move up to ``count`` running decodes to a decode worker at the next step boundary
        (``done`` with ``moved`` then); why not, if it cannot."""
        if self.migrator is None:
            return "migration is off (--no-migrate)"
        if self._migrate is not None:
            return f"a migration ({self._migrate[1]}) is in progress"
        if self.migrator.peer_stream() is None:
            return "no decode worker takes work"
        self._migrate = (count, command_id)
        return None

    def _migrate_asked(self) -> None:
        (count, command_id), self._migrate = self._migrate, None
        target = self.migrator.peer_stream()
        moved = self.migrate_out(target, count) if target is not None else 0
        self.shell.answer_command(MIGRATE, command_id, "done", moved=moved, to=target or "")

    def migrate_out(self, target: str | None = None, limit: int | None = None) -> int:
        """The requests past their first token go on on a decode worker (all of them when not
        accepting; else up to ``limit`` to ``target``, those with the fewest tokens so far:
        the most gaps left). Returns how many moved."""
        if target is None:
            self.migrator.announce()
            target = self.migrator.target()
            if target is None:
                return 0
        running = sorted(self.inflight.items(), key=lambda kv: len(kv[1].token_times_ms))
        moved = 0
        with self.shell.unit() as unit:
            for rid, it in running:
                if limit is not None and moved >= limit:
                    break
                exported = self.migrator.export(rid) if it.token_times_ms else None
                if exported is None:
                    continue
                seq, ticket = exported
                del self.inflight[rid]
                req, first = it.request, it.token_times_ms[0]
                handoff = Handoff(request=req, prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids),
                                  seed=it.params.seed, ticket=ticket, prefill_worker=self.shell.worker_id,
                                  enqueued_ms=req.enqueued_ms, prefill_start_ms=it.read_ms, prefill_end_ms=first,
                                  first_token_ms=first, cached_tokens=seq.cached_tokens,
                                  **sender_fields(self.engine))
                unit.handoff(it.stream, it.entry_id, rid, target, encode_handoff(handoff))
                moved += 1
        return moved

    def drain(self) -> None:
        super().drain()
        if self.migrator is not None:
            self.migrator.drain()

    def close(self) -> None:
        if self._migrate is not None:   # stopped or switched before the next step boundary
            self.shell.answer_command(MIGRATE, self._migrate[1], "failed", reason="the role stopped first")
            self._migrate = None
        if self.migrator is not None:
            self.migrator.close()
        if getattr(self, "holds", None) is not None:
            self.holds.close()
        super().close()

    def publish(self, outputs) -> None:
        t = now_ms()
        with self.shell.unit() as unit:
            for out in outputs:
                self.publish_local(unit, out, t)
                if out.finished:
                    self.holds.hold(unit, out.seq)
