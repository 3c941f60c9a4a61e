"""A request inside the engine: its tokens, its KV blocks, its progress.

``num_cached_tokens`` counts the leading tokens whose KV is in the pool; a step computes
tokens ``[num_cached_tokens, num_cached_tokens + n)`` and samples only when it reaches the
last token. Prefill, chunked prefill, decode and recompute are all this one rule. A prefix
cache hit (block_manager.py) only starts ``num_cached_tokens`` above zero.

Imports nothing but sampling.
"""

from __future__ import annotations

from enum import Enum

from pdqueue.engine.sampling import SamplingParams


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 output_ids: list[int] | None = None, rank: int = 0, deadline_ms: float | None = None):
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_ids) + list(output_ids or ())
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # Prefix caching (see block_manager.py): the chained hash of each full block of
        # ``token_ids`` computed so far (tokens only grow, so they stay valid), and how many
        # leading blocks of ``block_table`` are already in the cache's index (hits, or
        # registered once computed).
        self.block_hashes: list[bytes] = []
        self.num_hashed_blocks = 0
        self.max_hashed_blocks: int | None = None   # cap on blocks named (KV from an engine with another chain root)
        self.cached_tokens = 0   # prompt tokens served from the prefix cache at admission
        self.slow_gaps = 0       # decode steps it took part in that ran past the TBT budget (policies.py)
        self.last_token_s: float | None = None   # perf_counter() when this engine sampled its last token
        self.decode_here = False       # prefill engine: keep decoding it after its first token
        # Its service class's rank (pdqueue.protocol.ServiceClass, 0 first; 0 without a class):
        # where it waits (policies.waiting_key) and whether it yields to the others
        # (policies.ClassShare, by the ranks that yield). Then the deadline (epoch ms; None:
        # after those with one), then arrival.
        self.rank = rank
        self.deadline_ms = deadline_ms
        # With a TTFT target (EngineConfig.ttft_slo_ms): when its first token is due (epoch ms),
        # and whether it can no longer make that (then it waits behind those that still can).
        self.ttft_due_ms: float | None = None
        self.late = False
        self.arrival = 0   # set by the scheduler when it queues the sequence

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={len(self.block_table)}, {self.status.value})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
