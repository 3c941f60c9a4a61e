"""The Llama-family decoder (SmolLM2 and the test-only ``tiny`` model) and its config.

Owns: ``ModelConfig``, ``LlamaModel`` (paged forward, logits, and a cache-free dense
reference forward) and ``load_weights`` from Hugging Face tensor names.

Imports torch and ``models.attention`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdqueue.models.attention import (AttentionBatch, PaddedDecode, causal_attention, padded_decode_attention,
                                      paged_attention)


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


# The layers call their submodules' ``forward`` directly: ``nn.Module.__call__`` (hooks, which
# this model never uses) costs a few microseconds a call, and a decode step makes ~270 of them.

# attend(layer_index, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel instead of seven ops (the same numbers: checked bit for bit).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalize in fp32 as Hugging Face does, so fp16/bf16 runs stay comparable.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> a new tensor, rotated (Hugging Face half-split convention:
    ``x * cos + rotate_half(x) * sin``, ``rotate_half(x) = cat(-x2, x1)``); ``cos`` and
    ``signed_sin`` [T, 1, D], the latter ``sin`` with its first half negated, so the rotation
    is a swap of the halves and one fused multiply-add (3 ops instead of 8)."""
    num_tokens, heads, dim = x.shape
    swapped = x.reshape(num_tokens, heads, 2, dim // 2).flip(2).view(num_tokens, heads, dim)
    return (x * cos).addcmul_(swapped, signed_sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: fewer, larger GEMMs run faster on CPU.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, attend: Callable, ops=None) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        if ops is None:
            # q and k rotated together: they are adjacent in the fused projection's output.
            qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:   # in place, so q, k and v stay one row each (what ops.decode_attention reads)
            ops.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos[:, 0], sin[:, 0])
            q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v)
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        if ops is not None:
            return self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(x)))
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, attend: Callable, ops=None) -> torch.Tensor:
        if ops is None:
            x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, attend)
            return x.add_(self.mlp.forward(self.post_attention_layernorm.forward(x)))   # x: this layer's own tensor
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        x = x + self.self_attn.forward(ops.rms_norm(x, norm1.weight, norm1.eps), cos, sin, attend, ops)
        return x.add_(self.mlp.forward(ops.rms_norm(x, norm2.weight, norm2.eps), ops))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.scale = config.head_dim ** -0.5
        # Given its (uninitialised) weight, the embedding skips its random init: under the
        # loader's meta device that init cost ~1.5 s of a process's first model load
        # (tiny: 2.0 -> 0.5 s, measured); the weights are loaded over it anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models read the embedding matrix directly (no shared Parameter to re-tie
        # after .to() / .to_empty()).
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # Set by models.quant.quantize_model: the weights' format, the quantized LM head, and
        # for q4_1 the layer's small ops in C (models.fused; None: torch ops).
        self.weights_format = "fp32"
        self.logits_head: nn.Module | None = None
        self.fused = None

    # --- forward passes -------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Paged forward: new tokens' K/V go into ``kv_cache``; returns normed hidden [T, H]."""
        def attend(layer_index, q, k, v):
            return paged_attention(q, k, v, kv_cache[layer_index], batch, self.scale, layer_index, self.fused)
        return self._run(input_ids, positions, attend)

    def padded_decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PaddedDecode,
                             kv_cache: torch.Tensor) -> torch.Tensor:
        """A decode step in fixed shapes (``models.attention.PaddedDecode``): new K/V into
        ``kv_cache``, returns the logits of every row [B, vocab]; no host sync, so it can be
        captured in a CUDA graph."""
        def attend(layer_index, q, k, v):
            return padded_decode_attention(q, k, v, kv_cache[layer_index], batch, self.scale)
        return self.compute_logits(self._run(input_ids, positions, attend))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None:
            return self.logits_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def dense_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal attention over ``input_ids`` as one sequence, no cache (test reference)."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        hidden = self._run(input_ids, positions, lambda _, q, k, v: causal_attention(q, k, v, self.scale))
        return self.compute_logits(hidden)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        cos, signed_sin = self._rope(positions)
        x = self.embed_tokens(input_ids)
        cos, sin = cos.to(x.dtype)[:, None], signed_sin.to(x.dtype)[:, None]   # [T, 1, D]: broadcast over heads
        ops = self.fused
        for layer_index, layer in enumerate(self.layers):
            x = layer.forward(x, cos, sin, lambda q, k, v, i=layer_index: attend(i, q, k, v), ops)
        return self.norm(x) if ops is None else ops.rms_norm(x, self.norm.weight, self.norm.eps)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = positions.device
        if device not in self._rope_tables:
            # Built on first use, outside inference mode so that later no_grad or
            # inference_mode callers can both use it.
            with torch.inference_mode(False):
                cfg = self.config
                inv_freq = 1.0 / (cfg.rope_theta ** (
                    torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float() / cfg.head_dim))
                pos = torch.arange(cfg.max_position_embeddings, device=device).float()
                freqs = torch.outer(pos, inv_freq)
                angles = torch.cat((freqs, freqs), dim=-1)
                sign = torch.ones(cfg.head_dim, device=device)
                sign[:cfg.head_dim // 2] = -1   # rotate_half negates the second half moved first
                self._rope_tables[device] = (angles.cos(), angles.sin() * sign)
        cos, sin = self._rope_tables[device]
        return cos[positions], sin[positions]

    # --- weights --------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors named as in a Hugging Face Llama checkpoint into the fused params."""
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # HF name piece -> (our name piece, row offset in the fused matrix)
        packed = {
            "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q_size), "v_proj": ("qkv_proj", q_size + kv_size),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", cfg.intermediate_size),
        }
        params = dict(self.named_parameters())
        rows_loaded = {name: 0 for name in params}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            offset = None
            for piece, (fused_piece, row_offset) in packed.items():
                if f".{piece}." in name:
                    name, offset = name.replace(f".{piece}.", f".{fused_piece}."), row_offset
                    break
            if name not in params:
                raise KeyError(f"unexpected weight {hf_name!r}")
            param = params[name]
            target = param.data if offset is None else param.data[offset:offset + tensor.shape[0]]
            if target.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            target.copy_(tensor)
            rows_loaded[name] += tensor.shape[0] if tensor.dim() else 1
        missing = [name for name, rows in rows_loaded.items() if rows < params[name].shape[0]]
        if missing:
            raise ValueError(f"weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
