"""Engine configuration: one frozen dataclass, built at the edge (CLI, worker start) and
passed down. Components copy the scalars they need.

Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

# The KV pool per worker (MiB) of every command (worker, up, generate, bench engine) and of
# compose.yaml. 512 MiB is the smallest power of two that holds one whole-context request
# of the default model: SmolLM2-135M in fp32 takes 45 KiB of KV per token (30 layers x K,V x
# 3 KV heads x 64 x 4 bytes), so its 8192-token context needs 360 MiB (256 MiB held 5825
# tokens). `up` with 2 prefill + 2 decode workers then holds 4 x (512 MiB KV + ~0.55 GB of
# fp32 weights) = ~4.2 GB, plus each process's own; the prefill pools are pre-faulted in
# /dev/shm (compose.yaml's 2 GB /dev/shm holds 3 of them).
DEFAULT_KV_CACHE_MB = 512

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# How the linear layers' weights are held (pdqueue.models.quant, which has the same tuple):
# fp32 unquantized (in ``dtype``), int8 per output channel, int4 in groups of 32 (torch's
# kernel), q4_1 the same blocks times 8-bit activations (pdqueue's kernel, models/q4.py).
WEIGHT_FORMATS = ("fp32", "int8", "int4", "q4_1")


class PrefillPolicy(str, Enum):
    PREFILL_FIRST = "prefill_first"  # whole prompts before any decode step (classic server)
    CHUNKED = "chunked"              # decodes first, prompt chunks fill the token budget


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2"
    device: str = "cpu"
    dtype: str = "float32"  # fp32 matmuls are 5-7x faster than bf16 on these CPUs
    block_size: int = 16
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB  # pool size when num_blocks is not given
    num_blocks: int | None = None
    max_num_seqs: int = 32
    # Prompt tokens of one step. On a CPU, prefill runs at the same tokens/s from 128 to 2048
    # tokens a step (SmolLM2, one thread: fp32 305-355, q4_1 719-830), so a bigger step only
    # makes every prompt in it wait for the last: 48 mixed prompts queued at once got their
    # first token 3.4 s after the start on average at 512 against 4.3-4.7 s at 2048 (q4_1);
    # under load a short prompt arriving behind a 2048-token step waited the whole of it.
    max_num_batched_tokens: int = 512
    policy: PrefillPolicy = PrefillPolicy.PREFILL_FIRST
    max_model_len: int | None = None  # None: the model's context length
    num_threads: int | None = None    # torch intra-op threads; None: torch's default
    prefix_caching: bool = True       # reuse the KV of cached full prompt blocks (block_manager.py)
    weights: str = "fp32"             # WEIGHT_FORMATS; the model is loaded so (models.loader.load_model)
    # The chunked policy's TBT budget (policies.TbtBudget): the inter-token gap each running request
    # should keep at its ``tbt_percentile``-th percentile; None: chunks fill the token budget.
    tbt_slo_ms: float | None = None
    tbt_percentile: int = 90
    # A TTFT target: a waiting prompt whose first token can no longer come within it of its
    # request's enqueue time waits behind those that still can (policies.TtftLateness); None: off.
    ttft_slo_ms: float | None = None
    # Background (batch-class) sequences admitted at once (policies.ClassShare); None: 3/4 of
    # max_num_seqs, so that online requests always find a slot.
    max_background_seqs: int | None = None
    # On a CUDA device, decode steps replay CUDA graphs (engine/cuda_graphs.py); ignored elsewhere.
    cuda_graphs: bool = True

    def __post_init__(self):
        object.__setattr__(self, "policy", PrefillPolicy(self.policy))
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.weights != "fp32" and (self.dtype != "float32" or not self.device.startswith("cpu")):
            raise ValueError(f"weights {self.weights} run on CPU in float32 only (--device cpu --dtype float32)")
        if self.tbt_slo_ms is not None and self.tbt_slo_ms <= 0:
            raise ValueError(f"tbt_slo_ms must be > 0, got {self.tbt_slo_ms}")
        if self.tbt_slo_ms is not None and self.policy != PrefillPolicy.CHUNKED:
            raise ValueError("a TBT target (tbt_slo_ms, --tbt-slo-ms) needs the chunked policy (--policy chunked)")
        if self.ttft_slo_ms is not None and self.ttft_slo_ms <= 0:
            raise ValueError(f"ttft_slo_ms must be > 0, got {self.ttft_slo_ms}")
        if not 0 < self.tbt_percentile <= 100:
            raise ValueError(f"tbt_percentile must be in (0, 100], got {self.tbt_percentile}")
        if self.max_background_seqs is not None and not 0 <= self.max_background_seqs <= self.max_num_seqs:
            raise ValueError(f"max_background_seqs must be in [0, max_num_seqs], got {self.max_background_seqs}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.num_blocks is None and self.kv_cache_mb < 1:
            raise ValueError(f"kv_cache_mb must be >= 1, got {self.kv_cache_mb}")

    def kv_token_bytes(self, model_config) -> int:
        """KV bytes of one token of ``model_config`` (a models.config.ModelConfig): all
        layers, K and V, in this config's dtype."""
        return (model_config.num_layers * 2 * model_config.num_kv_heads * model_config.head_dim
                * DTYPE_BYTES[self.dtype])

    def kv_mb_for(self, model_config, num_tokens: int) -> int:
        """The smallest ``kv_cache_mb`` whose pool holds ``num_tokens`` (in whole blocks)."""
        blocks = -(-num_tokens // self.block_size)
        return -(-blocks * self.block_size * self.kv_token_bytes(model_config) // 2**20)

    def pool_blocks(self, model_config) -> int:
        """Blocks in the KV pool for ``model_config``; ValueError when the pool cannot hold
        even one block (instead of quietly rounding up to one)."""
        if self.num_blocks is not None:
            return self.num_blocks
        blocks = self.kv_cache_mb * 2**20 // (self.block_size * self.kv_token_bytes(model_config))
        if blocks < 1:
            raise ValueError(f"the KV pool ({self.kv_cache_mb} MiB) must be >= {self.kv_mb_for(model_config, 1)} "
                             f"MiB to hold one {self.block_size}-token block of {model_config.name} in {self.dtype}")
        return blocks

    def pool_shortfall(self, model_config, max_model_len: int | None = None) -> str | None:
        """Why the pool cannot hold one sequence of the whole context (longer prompts are
        then refused as too long), or None. ValueError when it holds no block at all."""
        context = min(max_model_len or self.max_model_len or model_config.max_position_embeddings,
                      model_config.max_position_embeddings)
        tokens = self.pool_blocks(model_config) * self.block_size
        if tokens >= context:
            return None
        return (f"the KV pool ({self.kv_cache_mb} MiB) holds {tokens} tokens of {model_config.name} in "
                f"{self.dtype}, less than its {context}-token context: longer requests are refused "
                f"(>= {self.kv_mb_for(model_config, context)} MiB holds one full-length sequence)")

    @property
    def background_seqs(self) -> int:
        """How many background (batch-class) sequences may hold a batch slot at once."""
        if self.max_background_seqs is not None:
            return self.max_background_seqs
        return max(1, self.max_num_seqs * 3 // 4)

    def with_(self, **changes) -> "EngineConfig":
        return replace(self, **changes)
