"""A sequence whose KV comes from elsewhere: the decode role's way into the engine
(``LLMEngine.kv_import``).

A decode worker runs a handed-over request without computing its prompt: ``can_reserve``
(a batch slot, one of the background slots for a class that yields, and the blocks; or
``make_room``, which preempts background sequences for foreground work), then ``reserve``
allocates blocks for all the sequence's tokens, taking those this engine's prefix cache holds
under the sender's names; the caller copies the KV of the others in (from
``first_needed_block`` on for a model whose every layer slides, ``leave_unfilled`` before it)
and ``add_prefilled`` makes the sequence a running one, or ``unreserve`` gives its blocks back.

Its own object because it is its own job: the engine's step never calls it, and it reaches
into the engine's parts (block manager, scheduler, pool) only as a step does between two
steps. The way out (``detach_running``, ``free_blocks``, a prefill's detached blocks) stays
on ``LLMEngine``.

Imports config, block_manager, scheduler, sequence, sampling.
"""

from __future__ import annotations

from typing import Callable

import torch

from pdqueue.engine.block_manager import BlockManager
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.sampling import SamplingParams
from pdqueue.engine.scheduler import Scheduler
from pdqueue.engine.sequence import Sequence


class KVImport:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, block_manager: BlockManager,
                 kv_cache: torch.Tensor, model_config, track: Callable[[Sequence, list[int]], None]):
        """The engine's parts; ``model_config``: its model's (``ModelConfig``: the sliding
        window); ``track``: the engine's, so an admitted sequence's outputs are followed like
        any other's."""
        self.config = config
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.kv_cache = kv_cache
        self.model_config = model_config
        self._track = track

    def can_reserve(self, num_tokens: int, rank: int = 0) -> bool:
        """Whether ``reserve`` has a slot and the blocks for a sequence of class ``rank`` (one
        whose class yields, one of the background slots: policies.ClassShare)."""
        return (len(self.scheduler.running) < self.config.max_num_seqs
                and (rank not in self.scheduler.share.yielding or self.scheduler.can_run_background())
                and self.block_manager.blocks_for(num_tokens) <= self.block_manager.num_free_blocks)

    def make_room(self, num_tokens: int) -> bool:
        """Foreground work of ``num_tokens`` to ``reserve``: preempt running background
        sequences, newest first (they recompute later), until it fits; whether it does.
        Batch gives its room back when online work needs it (policies.ClassShare)."""
        while not self.can_reserve(num_tokens):
            if not self.scheduler.preempt_background():
                return False
        return True

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                output_ids: list[int], block_hashes=(), hash_root: bytes = b"", rank: int = 0) -> Sequence:
        """Allocate blocks for a sequence whose KV (all tokens but the last) will be copied
        in by the caller; then ``add_prefilled`` (or ``unreserve``). With the sender's
        prefix-cache names of its full blocks (``block_hashes``, chained from ``hash_root``),
        blocks this engine holds under those names are taken from its cache and
        ``seq.num_cached_tokens`` says how many leading tokens' KV is in place already: the
        caller copies KV into the blocks after those only (fresh ones; a cached block is
        never rewritten). ``rank``: its service class's, as for ``LLMEngine.add_request``
        (whether it yields; where it waits again if it is preempted)."""
        seq = Sequence(request_id, prompt_ids, params, output_ids, rank=rank)
        if not self.can_reserve(seq.num_tokens, rank):
            raise RuntimeError("reserve without can_reserve")
        hits = self.block_manager.allocate_known(seq, list(block_hashes),
                                                 same_root=bool(hash_root) and hash_root == self.block_manager.root)
        seq.num_cached_tokens = hits * self.config.block_size
        return seq

    def first_needed_block(self, num_context: int) -> int:
        """The first block a sequence of ``num_context`` computed tokens still reads: 0, or
        for a model whose every layer slides (Mistral, Phi-3), the block of the oldest position
        its window still covers. A decode worker copies no KV before it."""
        window = self.model_config.max_window
        return 0 if window is None else max(0, (num_context - window) // self.config.block_size)

    def leave_unfilled(self, seq: Sequence, first_block: int, end_block: int) -> None:
        """``seq``'s blocks ``first_block .. end_block - 1`` get no KV (older than every
        layer's window): zeroed, never named in the prefix cache (another request could read
        them), and not counted as reused."""
        for block in seq.block_table[first_block:end_block]:
            self.kv_cache[:, :, block].zero_()
        seq.max_hashed_blocks = min(first_block, seq.max_hashed_blocks if seq.max_hashed_blocks is not None
                                    else first_block)

    def unreserve(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """The KV of all ``seq``'s tokens but the last is in its blocks: it runs from the next step."""
        seq.num_cached_tokens = seq.num_tokens - 1
        self.block_manager.cache_computed(seq)   # the copied full blocks join the prefix cache
        self._track(seq, seq.output_ids)
        self.scheduler.add_running(seq)
