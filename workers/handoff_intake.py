"""What a handoff entry becomes as the decode role takes it in (``DecodeRole.intake``).

For each entry read (or taken over: ``resumed``), in one unit (workers/answers.py):

- one of another kind (KV format, model or wire version) is passed on to its kind's stream
  and never run here (``Rerouter``, workers/compat.py);
- one that cannot run here is dead-lettered: malformed, deleted, token ids beyond the
  vocabulary, more output tokens than ``max_tokens``, a prompt the engine can never hold
  (``read_handoff``, ``handoff_problem``);
- a second delivery of a request in hand is acknowledged, unless it is the very entry in
  hand again (its first delivery lost at a Redis failover: the job answers it);
- one taken over from another worker first catches up with what ``out:<id>`` shows
  (``caught_up``), and is acknowledged if it was answered already;
- the rest become jobs: ``take(stream, entry_id, handoff)``, the role's, called in order,
  so a later entry of the same request finds the job an earlier one made.

Its own object because the intake is its own job: the role's step only hands it entries.

Imports pdqueue.protocol; the engine only to check a handoff against it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from pdqueue.protocol import ErrorCode, Handoff, HandoffError, as_str, decode_handoff, entry_id_ms

if TYPE_CHECKING:
    from pdqueue.engine.llm_engine import LLMEngine
    from workers.compat import Rerouter
    from workers.role import RoleHost

log = logging.getLogger("pdqueue.decode")


class HandoffIntake:
    def __init__(self, shell: RoleHost, engine: LLMEngine, rerouter: Rerouter):
        self.shell = shell
        self.engine = engine
        self.rerouter = rerouter

    def accept(self, entries: list, resumed: bool, held: dict,
               take: Callable[[str, str, Handoff], None]) -> None:
        """Take ``entries`` in (``held``: the jobs in hand, by request id)."""
        with self.shell.unit() as unit:
            for stream, entry_id, fields in entries:
                elsewhere = self.rerouter.target(fields)   # of another kind: never run here
                if elsewhere:
                    unit.handoff(stream, entry_id, as_str(fields.get(b"id", b"")), elsewhere, fields)
                    continue
                h, problem = read_handoff(fields, self.engine)
                if problem:
                    unit.reject(stream, entry_id, fields, h and h.request.id, f"bad handoff: {problem}",
                                ErrorCode.BAD_REQUEST)
                    continue
                if h.request.id in held:   # a second delivery of a request in hand
                    # The very entry in hand again (its first delivery lost at a Redis
                    # failover): it is pending for us once more, and the job answers it.
                    if held[h.request.id].entry_id != entry_id:
                        unit.ack(stream, entry_id, h.request.id)
                    continue
                if resumed:
                    h = caught_up(self.shell.r, self.shell.keys, h)
                    if h is None:   # already answered
                        unit.ack(stream, entry_id)
                        continue
                take(stream, entry_id, h)


def read_handoff(fields, engine: LLMEngine) -> tuple[Handoff | None, str | None]:
    """The handoff in a stream entry (None if malformed) and what is wrong with it, if anything."""
    if fields is None:
        return None, "entry was deleted"
    try:
        h = decode_handoff(fields)
    except HandoffError as exc:
        return None, str(exc)
    return h, handoff_problem(h, engine)


def handoff_problem(h: Handoff, engine: LLMEngine) -> str | None:
    """What makes a (well-formed) handoff impossible to run on ``engine``, or None. (One of
    another KV identity never gets here: ``Rerouter`` passed it on.)"""
    vocab = engine.model_config.vocab_size
    if any(t >= vocab for t in h.prompt_ids) or any(t >= vocab for t in h.output_ids):
        return f"token ids beyond the vocabulary ({vocab})"
    if len(h.output_ids) > h.request.max_tokens:
        return "more output tokens than max_tokens"
    return engine.check_prompt(len(h.prompt_ids) + len(h.output_ids))


def caught_up(r, keys, h: Handoff) -> Handoff | None:
    """Resume from what ``out:<id>`` already shows: tokens published by the previous
    owner are kept (recompute from prompt + those), so the stream continues at the next
    index with no gap, no duplicate and no divergence. None if already answered."""
    tokens: dict[int, list[int]] = {}
    first_ms = 0.0
    for eid, fields in r.xrange(keys.out(h.request.id)):
        kind = fields.get(b"type")
        if kind in (b"done", b"error"):
            return None
        if kind == b"token":
            index = int(fields[b"index"])
            tokens[index] = json.loads(fields[b"token_ids"])
            if index == 0:   # an entry id is the ms it was added at
                first_ms = float(entry_id_ms(eid))
    output: list[int] = []
    while len(output) in tokens:
        output += tokens[len(output)]
    if len(output) <= len(h.output_ids):
        return h
    log.info("resuming %s after %d published tokens", h.request.id, len(output))
    if h.prompt_only:
        # A prompt placed on the previous owner, which prefilled it there: its token 0 came
        # out when it was published (else the completion's TTFT and prefill_ms are garbage).
        h = replace(h, prefill_end_ms=first_ms, first_token_ms=first_ms)
    return replace(h, output_ids=output, ticket=None)   # the exported KV covers fewer tokens: recompute
