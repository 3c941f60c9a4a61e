"""A handoff's KV on its way into the decode role's engine: room, reserved blocks, the fetch,
the sequence admitted (``DecodeRole.fetches``).

For a job (a handoff in hand, decode.py's ``Job``) with a ticket:

- ``room``: whether the engine can reserve blocks for the whole sequence and a batch slot
  now (``engine.kv_import``); an online handoff takes the room of running batch sequences
  (``make_room``: they recompute later), a batch one waits for room of its own;
- ``start``: reserve the blocks (``job.seq``) and hand the fetch thread (fetch.py) the copy
  of the KV they lack: blocks this engine's prefix cache already holds under the sender's
  names (an earlier turn, a shared system prompt) stay, and when every layer of the model
  slides only what the window still reads travels (the older blocks are left unfilled);
- ``collect``: the fetches done, each job still wanted with its outcome; the blocks of a
  job dropped meanwhile or of a failed fetch go back (the role recomputes the failed one);
- ``admit``: a fetched job's sequence joins the running batch at this step boundary (the
  prompt's KV is in place; the first decode step computes the first token's).

The receiver (transfer/receiver.py: shm when the ticket's node is ours, else the sender's TCP
data wire, else ZeroMQ) and the fetch thread are this object's; ``release`` gives a ticket's
lease back through the same thread. Its own object because the KV's way in is its own job:
the role's step only asks for room, starts and collects.

Imports transfer (the receiver), workers.fetch, workers.common.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

from pdqueue.transfer.receiver import KVReceiver
from workers.common import kv_auth_for
from workers.fetch import Fetcher, FetchOutcome

if TYPE_CHECKING:
    from pdqueue.engine.llm_engine import LLMEngine
    from pdqueue.protocol import Handoff
    from workers.decode import Job
    from workers.role import RoleHost


class KVFetches:
    def __init__(self, shell: RoleHost, engine: LLMEngine):
        self.engine = engine
        self.receiver = KVReceiver(engine.kv_cache, engine.layout, shell.node, mode=shell.config.transfer,
                                   timeout_s=shell.config.fetch_timeout_s, kv_format=shell.config.kv_wire_format,
                                   auth=kv_auth_for(shell.config, shell.r, shell.keys))
        self.fetcher = Fetcher(self.receiver, metrics=shell.metrics)

    @property
    def in_flight(self) -> int:
        """Fetches started and not collected yet."""
        return self.fetcher.in_flight

    def room(self, h: Handoff) -> bool:
        """Whether ``h``'s whole sequence (prompt, tokens so far, the next) can be reserved
        now; an online one preempts running batch sequences for it when that is what it takes."""
        need = len(h.prompt_ids) + len(h.output_ids) + 1
        kv = self.engine.kv_import
        return kv.can_reserve(need, h.request.rank) or (not h.request.background and kv.make_room(need))

    def start(self, job: Job) -> None:
        """Reserve ``job``'s blocks (``job.seq``) and start the fetch of its ticket's KV into them."""
        h, kv = job.handoff, self.engine.kv_import
        job.seq = kv.reserve(h.request.id, h.prompt_ids, job.params, h.output_ids,
                             block_hashes=h.ticket.get("block_hashes") or (),
                             hash_root=h.ticket.get("hash_root") or b"", rank=h.request.rank)
        # Blocks whose KV this engine already caches (an earlier turn, a shared system
        # prompt) stay; only the rest travel, and of those only what a sliding window
        # still reads when every layer slides (the older ones are left unfilled).
        held = job.seq.num_cached_tokens // self.engine.config.block_size
        first = max(held, kv.first_needed_block(len(h.prompt_ids) + len(h.output_ids) - 1))
        if first > held:
            kv.leave_unfilled(job.seq, held, first)
        self.fetcher.submit(job, h.ticket, job.seq.block_table[first:len(h.ticket["block_ids"])], first,
                            reused_blocks=held)

    def collect(self, wait_s: float, wanted: Callable[[Job], bool]) -> Iterator[tuple[Job, FetchOutcome]]:
        """The fetches done (with ``wait_s``, waiting up to that long for those still
        running): each job still ``wanted`` with its outcome. A failed fetch's blocks are
        given back (``job.seq`` None), and so are those of a job no longer wanted (dropped
        meanwhile: not yielded); a fetched job keeps ``job.seq`` for ``admit``."""
        for job, kv in self.fetcher.collect(wait_s):
            if not wanted(job):
                self.engine.kv_import.unreserve(job.seq)
                continue
            if kv.error:
                seq, job.seq = job.seq, None
                self.engine.kv_import.unreserve(seq)
            yield job, kv

    def admit(self, job: Job) -> None:
        """``job``'s KV is in place: its sequence runs from the next step."""
        seq, job.seq = job.seq, None
        self.engine.kv_import.add_prefilled(seq)

    def release(self, ticket: dict) -> None:
        """Give ``ticket``'s lease back to its sender (a job answered before its fetch)."""
        self.fetcher.release(ticket)

    def close(self) -> None:
        self.fetcher.close()
        self.receiver.close()
