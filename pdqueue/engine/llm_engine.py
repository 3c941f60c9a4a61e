"""The engine: one model, one KV pool, continuous batching.

Run in one process it is the **colocated** server and the correctness oracle. The
disaggregated workers use the same engine in two roles:

- prefill (``prefill_only=True``): a sequence whose step produces its first token leaves the
  engine at once; its blocks are *detached* (not freed) and handed to the caller, who
  exports them under a lease and returns them with ``free_blocks`` when the lease ends;
  one marked ``decode_here`` (``keep_decoding``: no decode worker has room) stays and
  decodes like a colocated engine's.
- decode: ``kv_import`` (kv_import.py's ``KVImport``) reserves blocks for a sequence whose
  prompt KV the caller copies in, then admits it as running; from then on it decodes like
  any other.

Lifecycle of a sequence: ``add_request`` -> waiting -> running (prefill, then decode;
preempted back to waiting by recompute if blocks run out) -> finished (blocks freed).

Prefix caching (``EngineConfig.prefix_caching``, every role; see block_manager.py): a
sequence admitted with a cached prefix computes only the rest; each step names the blocks it
filled. Blocks a finished sequence or an ended lease gives back stay cached until evicted.
``StepOutput.cached_tokens`` is what a request saved; ``prefix_cache_queries`` and
``prefix_cache_hits`` count tokens looked up and found, over the engine's life. The hash
chain starts from the model's identity, config and weights' fingerprint (a GGUF file's
SHA-256), its weights' dtype and format (``fp32``, ``int8``, ``int4``: models/quant.py), the
KV dtype and the block size, so blocks are never shared across anything that changes the KV.
In the decode role ``kv_import.reserve`` takes the blocks a ticket names that this engine
caches (the sender's chain), so only the others are copied in.

Imports torch, models, the engine modules and pdqueue.protocol (``FinishReason``); never redis or zmq.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from pdqueue.engine.block_manager import BlockManager, prefix_root
from pdqueue.engine.config import EngineConfig, PrefillPolicy
from pdqueue.engine.cuda_graphs import GraphedDecode
from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.engine.kv_import import KVImport
from pdqueue.engine.model_runner import ModelRunner
from pdqueue.engine.output import OutputText
from pdqueue.engine.sampling import SamplingParams, sample
from pdqueue.engine.scheduler import Scheduler
from pdqueue.engine.sequence import Sequence, SequenceStatus
from pdqueue.protocol import FinishReason


@dataclass(slots=True)
class StepOutput:
    """One new token of one request."""
    request_id: str
    index: int            # position among the request's output tokens (0 = first)
    token_id: int
    text: str             # text that can be shown now (may be empty, held back)
    finish_reason: str | None = None
    seq: Sequence | None = None
    detached_blocks: list[int] | None = None  # prefill role: blocks now owned by the caller
    full_text: str | None = None  # on the last output: the whole completion's text
    cached_tokens: int = 0   # prompt tokens served from the prefix cache (not computed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class StepStats:
    num_seqs: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    history: list[tuple[int, int, float]] = field(default_factory=list)  # (seqs, tokens, s)


def kv_layout_for(model_config, config: EngineConfig) -> KVCacheLayout:
    num_blocks = config.pool_blocks(model_config)  # ValueError when not even one block fits
    return KVCacheLayout(model_config.num_layers, num_blocks, config.block_size,
                         model_config.num_kv_heads, model_config.head_dim, config.dtype)


def kv_identity(loaded, layout: KVCacheLayout) -> str:
    """What two engines must share for one to continue from the other's KV: the model (its
    family config and the weights' fingerprint) and the KV layout (layers, KV heads, head_dim,
    dtype, block size). Not the weights' format: an int8 prefill worker's KV is the same layout
    and model as an fp32 decode worker's. A short hex digest."""
    parts = (asdict(loaded.config) | {"name": ""}, getattr(loaded, "fingerprint", ""), layout.num_layers,
             layout.block_size, layout.num_kv_heads, layout.head_dim, layout.dtype)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def engine_prefix_root(loaded, config: EngineConfig, layout: KVCacheLayout) -> bytes:
    """What besides the tokens decides a block's KV (the prefix cache's chain start)."""
    weights = next(iter(loaded.model.parameters()), None)
    parts = ("pdqueue-kv-1", config.model, asdict(loaded.config),
             str(weights.dtype) if weights is not None else "", layout.dtype, config.block_size)
    fmt = getattr(loaded, "weights", "fp32")   # quantized weights compute other KV (models/quant.py)
    if fmt != "fp32":
        parts += (f"weights={fmt}",)
    fingerprint = getattr(loaded, "fingerprint", "")   # the weights' content (models/loader.py)
    return prefix_root(*parts, f"fingerprint={fingerprint}") if fingerprint else prefix_root(*parts)


class LLMEngine:
    def __init__(self, loaded, config: EngineConfig, kv_cache: torch.Tensor | None = None,
                 prefill_only: bool = False, on_rewrite: Callable[[list[int]], None] | None = None):
        """``loaded``: a models.loader.LoadedModel. ``kv_cache``: a pool tensor to use (for
        example one inside shared memory); by default one is allocated. ``on_rewrite``:
        called with blocks about to get new content, before the step that writes them (the
        prefill role bumps their epochs in the shared segment)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.layout = kv_layout_for(loaded.config, config)
        self.kv_identity = kv_identity(loaded, self.layout)   # handoffs carry it (workers/decode.py)
        if kv_cache is None:
            kv_cache = self.layout.allocate(device=config.device)
        else:
            self.layout.check_pool(kv_cache)
        self.kv_cache = kv_cache
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.block_manager = BlockManager(self.layout.num_blocks, config.block_size,
                                          enable_caching=config.prefix_caching,
                                          root=engine_prefix_root(loaded, config, self.layout), on_rewrite=on_rewrite)
        self.scheduler = Scheduler(config, self.block_manager)
        # The decode role's way in: a sequence whose KV is copied into blocks it reserves.
        self.kv_import = KVImport(config, self.scheduler, self.block_manager, kv_cache, loaded.config, self._track)
        graphs = None
        if config.cuda_graphs and GraphedDecode.usable(self.model, kv_cache.device):
            graphs = GraphedDecode(self.model, kv_cache, config.block_size, config.max_num_seqs, self.max_model_len)
        self.runner = ModelRunner(self.model, kv_cache, config.block_size, config.device, graphs=graphs)
        self.prefill_only = prefill_only
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids)
        self.stats = StepStats()
        self._seqs: dict[str, Sequence] = {}
        self._texts: dict[str, OutputText] = {}

    @property
    def prefix_caching(self) -> bool:
        return self.block_manager.enable_caching

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache (every admission, preemptions included)."""
        return self.block_manager.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of ``prefix_cache_queries``, tokens found cached (not computed)."""
        return self.block_manager.hits

    # ---- admission -------------------------------------------------------------------
    def check_prompt(self, num_prompt_tokens: int, max_tokens: int = 1) -> str | None:
        """Why a prompt can never run here (a reason for the user), or None."""
        if num_prompt_tokens < 1:
            return "the prompt is empty"
        if num_prompt_tokens >= self.max_model_len:
            return (f"the prompt has {num_prompt_tokens} tokens; the model's context is "
                    f"{self.max_model_len} tokens")
        pool_tokens = self.layout.num_blocks * self.config.block_size
        if num_prompt_tokens + 1 > pool_tokens:
            return (f"the prompt has {num_prompt_tokens} tokens; the whole KV pool holds "
                    f"{pool_tokens} tokens")
        return None

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    output_ids: list[int] | None = None, rank: int = 0,
                    deadline_ms: float | None = None, enqueued_ms: float | None = None) -> Sequence:
        """Queue a request. ``output_ids``: tokens already generated elsewhere (recompute);
        ``rank``: its service class's (``pdqueue.protocol.ServiceClass.rank``, 0 first), where
        it waits among the others and whether it yields to them (policies.ClassShare);
        ``deadline_ms`` (epoch ms, None: none): its place within its class; ``enqueued_ms``
        (epoch ms): when its request was sent, from which a TTFT target (``ttft_slo_ms``) counts."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already in the engine")
        reason = self.check_prompt(len(prompt_ids) + len(output_ids or ()))
        if reason:
            raise ValueError(reason)
        seq = Sequence(request_id, prompt_ids, params, output_ids, rank=rank, deadline_ms=deadline_ms)
        if self.config.ttft_slo_ms is not None and enqueued_ms is not None and not output_ids:
            seq.ttft_due_ms = enqueued_ms + self.config.ttft_slo_ms
        self._track(seq, output_ids or [])
        self.scheduler.add(seq)
        return seq

    def keep_decoding(self, keep: bool) -> None:
        """Prefill role: whether the online sequences still prefilling decode here after their
        first token (True) or leave with it (False), as decided before each step."""
        for seq in self._seqs.values():
            if seq.num_output_tokens == 0 and not self.scheduler.share.yields(seq):
                seq.decode_here = keep

    @property
    def prefix_root(self) -> bytes:
        """The prefix cache's chain start (what besides the tokens decides the KV)."""
        return self.block_manager.root

    def detach_running(self, request_id: str) -> tuple[Sequence, list[int]] | None:
        """Take a decoding sequence out of the engine with its KV, to resume it elsewhere
        (workers/migration.py): returns it and the blocks that hold the KV of all its tokens
        but the last (the caller's references now; back with ``free_blocks``). None when it
        is not here or not between two decode steps (still prefilling)."""
        seq = self._seqs.get(request_id)
        if (seq is None or seq not in self.scheduler.running or seq.num_output_tokens == 0
                or seq.num_cached_tokens != seq.num_tokens - 1):
            return None
        block_ids = self.block_manager.detach(seq)
        keep = self.block_manager.blocks_for(seq.num_cached_tokens)
        if len(block_ids) > keep:   # a block reserved for the next token, not written yet
            self.block_manager.free_blocks(block_ids[keep:])
            block_ids = block_ids[:keep]
        self.scheduler.remove(seq)
        self._forget(seq)
        return seq, block_ids

    def _track(self, seq: Sequence, prior_ids: list[int]) -> None:
        self._seqs[seq.request_id] = seq
        self._texts[seq.request_id] = OutputText(self.tokenizer, seq.params.stop, prior_ids)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Prefill role: blocks detached in a StepOutput come back here when their lease ends
        (full ones stay cached, with their KV and epochs, until evicted)."""
        self.block_manager.free_blocks(block_ids)

    def set_tbt_target(self, tbt_slo_ms: float | None) -> None:
        """The chunked policy's TBT target from now on (None: chunks fill the token budget;
        policies.TbtBudget); ValueError on another policy or a target <= 0."""
        if self.config.policy != PrefillPolicy.CHUNKED:
            raise ValueError("the TBT budget needs the chunked policy (--policy chunked)")
        self.scheduler.tbt.set(tbt_slo_ms)

    # ---- stepping --------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule(time.time() * 1000)
        if not batch:
            return []
        started = time.perf_counter()
        logits, sample_seqs = self.runner.run(batch, self.scheduler.paused(batch))
        for seq, num_new in batch:
            seq.num_cached_tokens += num_new
            self.block_manager.cache_computed(seq)
        outputs: list[StepOutput] = []
        if sample_seqs:
            indices = [seq.num_output_tokens for seq in sample_seqs]
            token_ids = sample(logits, [seq.params for seq in sample_seqs], indices)
            for seq, index, token_id in zip(sample_seqs, indices, token_ids):
                outputs.append(self._append(seq, index, token_id))
        ended = time.perf_counter()
        elapsed = ended - started
        self.scheduler.observe_step(batch, elapsed, ended)
        for seq in sample_seqs:
            seq.last_token_s = ended
        num_tokens = sum(n for _, n in batch)
        self.stats.num_seqs += len(batch)
        self.stats.num_tokens += num_tokens
        self.stats.seconds += elapsed
        return outputs

    def _append(self, seq: Sequence, index: int, token_id: int) -> StepOutput:
        seq.append_token(token_id)
        text = self._texts[seq.request_id]
        delta = text.push(token_id)
        reason = None
        if token_id in self.eos_token_ids and not seq.params.ignore_eos:
            reason = FinishReason.STOP
        elif text.stopped:
            reason = FinishReason.STOP
        elif (seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
              or seq.num_tokens > self.layout.num_blocks * self.config.block_size):
            # The last check: computing the next token needs KV slots for all current ones;
            # past the whole pool the sequence could never run again (it would wait forever).
            reason = FinishReason.LENGTH
        out = StepOutput(seq.request_id, index, token_id, delta, reason, seq, cached_tokens=seq.cached_tokens)
        if reason is not None:
            out.text += text.flush()
            out.full_text = text.text
            self._finish(seq, reason)
        elif self.prefill_only and not seq.decode_here:
            # The first token is out: hand the sequence and its KV to the caller.
            out.detached_blocks = self.block_manager.detach(seq)
            self.scheduler.remove(seq)
            self._forget(seq)
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.block_manager.free(seq)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self._texts.pop(seq.request_id, None)
        if self.runner.decode_kv is not None:
            self.runner.decode_kv.release(seq)

    def abort(self, request_id: str, reason: str = FinishReason.CANCELLED) -> Sequence | None:
        """Stop a request now and free its blocks; None if it is not here."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self._finish(seq, reason)
        return seq

    def request_ids(self) -> list[str]:
        return list(self._seqs)

    # ---- convenience -----------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_output=None) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [f"gen-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        while self.has_unfinished:
            for out in self.step():
                results[out.request_id].append(out.token_id)
                if on_output:
                    on_output(out)
        return [results[rid] for rid in ids]
