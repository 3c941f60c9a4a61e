"""What a decoder is, as data: ``ModelConfig`` with its rotary (``RopeSpec``) and
mixture-of-experts (``MoeSpec``) parts.

One decoder (``models.decoder``) serves every family in ``models.families``; a family is a
choice of these fields (QKV bias, q/k norms, sandwich norms, soft-capping, sliding-window
layers, experts ...), read from a checkpoint's ``config.json`` or GGUF metadata by
``models.families``. The defaults are Llama's, so a Llama config names only its shape.

Standard library only (``pdqueue up`` and ``models.source`` read configs without torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FULL, SLIDING = "full_attention", "sliding_attention"   # layer types, as transformers names them


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding of a layer type: the base, the scaling (``kind``: default,
    linear, dynamic, llama3, yarn, longrope) and its parameters, as transformers'
    ``modeling_rope_utils`` reads them."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = 1.0           # the rotated share of each head (Phi-4-mini: 0.75)
    original_max_position_embeddings: int = 0    # llama3, yarn, longrope
    low_freq_factor: float = 1.0                 # llama3
    high_freq_factor: float = 4.0                # llama3
    beta_fast: float = 32.0                      # yarn
    beta_slow: float = 1.0                       # yarn
    mscale: float = 0.0                          # yarn
    mscale_all_dim: float = 0.0                  # yarn
    truncate: bool = True                        # yarn
    attention_factor: float | None = None        # yarn, longrope: cos/sin scale (None: derived)
    short_factor: tuple[float, ...] = ()         # longrope
    long_factor: tuple[float, ...] = ()          # longrope


@dataclass(frozen=True)
class MoeSpec:
    """A sparse mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` SwiGLU
    experts per token; ``layers`` says which layers have it (the others a dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool            # renormalise the top-k probabilities to sum to 1
    layers: tuple[bool, ...]        # per layer: sparse (True) or dense


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # --- the family's parts (defaults: Llama) ---
    family: str = "llama"
    rope: RopeSpec | None = None         # None: default rope at rope_theta
    local_rope: RopeSpec | None = None   # sliding layers' rope where it differs (Gemma 3)
    layer_types: tuple[str, ...] = ()    # per layer FULL or SLIDING; () = all FULL
    sliding_window: int | None = None    # tokens a sliding layer sees, itself included
    qkv_bias: bool = False               # Qwen2
    qk_norm: bool = False                # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    sandwich_norms: bool = False         # Gemma 2/3: norms after attention and the MLP too
    norm_plus_one: bool = False          # Gemma: checkpoints store RMSNorm weights as w - 1
    embed_scale: float = 1.0             # Gemma: embeddings times sqrt(hidden)
    activation: str = "silu"             # or "gelu_tanh" (Gemma)
    attn_scale: float | None = None      # None: head_dim ** -0.5
    attn_softcap: float | None = None    # Gemma 2: cap * tanh(scores / cap)
    final_softcap: float | None = None   # Gemma 2: the logits' cap
    moe: MoeSpec | None = None
    extras: tuple[str, ...] = field(default=(), compare=False)   # notes for `pdqueue models`

    def __post_init__(self):
        if self.rope is None:
            object.__setattr__(self, "rope", RopeSpec(theta=self.rope_theta))
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to the whole context)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_of(self, layer: int) -> RopeSpec:
        if self.local_rope is not None and self.layer_types[layer] == SLIDING:
            return self.local_rope
        return self.rope

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def plain_attention(self) -> bool:
        """Softmax attention over the whole context in every layer, with full rotary: what the
        fused C kernels and CUDA graphs implement."""
        return (self.attn_softcap is None and all(t == FULL for t in self.layer_types)
                and self.rope.partial_rotary_factor == 1.0 and not self.qk_norm)

    @property
    def max_window(self) -> int | None:
        """The largest context any layer attends to (None: some layer sees it all)."""
        if self.sliding_window is None or any(t == FULL for t in self.layer_types):
            return None
        return self.sliding_window
