"""The decoder every supported family runs: Llama's block with the parts a family turns on in
its ``ModelConfig`` (``models.families``): q/k/v biases, q/k norms, sandwich norms, GELU-tanh,
scaled embeddings, soft-capping, sliding-window layers, partial rotary, a mixture of experts.

Owns: ``DecoderModel`` (paged forward, logits, a cache-free dense reference forward) and
``load_weights`` from Hugging Face tensor names (``models.weight_names`` maps each family's
names onto the fused parameters here).

Imports torch and ``models.attention``, ``config``, ``rope``, ``weight_names`` only.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdqueue.models.attention import (
    AttentionBatch,
    AttnSpec,
    PaddedDecode,
    causal_attention,
    padded_decode_attention,
    paged_attention,
)
from pdqueue.models.config import ModelConfig, RopeSpec
from pdqueue.models.rope import rope_table
from pdqueue.models.weight_names import WeightMap

__all__ = ["DecoderModel", "ModelConfig", "apply_rope"]

# The layers call their submodules' ``forward`` directly: ``nn.Module.__call__`` (hooks, which
# this model never uses) costs a few microseconds a call, and a decode step makes ~270 of them.

# attend(layer_index, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """``gemma``: scale in float32 and round after (Gemma's order); Llama rounds the normed
    activations first. The same numbers in float32. (Gemma's ``1 + w`` is folded into the
    weight at load: ``models.weight_names``.)"""

    def __init__(self, hidden_size: int, eps: float, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps, self.gemma = eps, gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel instead of seven ops (the same numbers: checked bit for bit).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x32 * self.weight.float()).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> a new tensor, rotated (Hugging Face half-split convention:
    ``x * cos + rotate_half(x) * sin``, ``rotate_half(x) = cat(-x2, x1)``); ``cos`` and
    ``signed_sin`` [T, 1, R], the latter ``sin`` with its first half negated, so the rotation
    is a swap of the halves and one fused multiply-add (3 ops instead of 8). ``R < D``
    (partial rotary): only the first R dims of each head turn."""
    num_tokens, heads, dim = x.shape
    rot = cos.shape[-1]
    if rot < dim:
        return torch.cat((apply_rope(x[..., :rot].contiguous(), cos, signed_sin), x[..., rot:]), dim=-1)
    swapped = x.reshape(num_tokens, heads, 2, dim // 2).flip(2).view(num_tokens, heads, dim)
    return (x * cos).addcmul_(swapped, signed_sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: fewer, larger GEMMs run faster on CPU.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        gemma = config.norm_plus_one
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, gemma) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, gemma) if config.qk_norm else None

    def forward(self, x, cos, sin, attend: Callable, ops=None) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        if self.q_norm is not None:   # per head, before the rotation (Qwen3, Gemma 3)
            q = self.q_norm.forward(qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm.forward(qkv[:, self.q_size:self.q_size + self.kv_size].view(
                num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif ops is None:
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


def _activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.activation = config.activation
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        if ops is not None:
            return self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(x)))
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(_activate(gate, self.activation).mul_(up))


class SparseMoE(nn.Module):
    """A router's top-k of SwiGLU experts per token (Qwen3-MoE, Mixtral), computed as
    transformers does: softmax in float32, top-k, optionally renormalised, then each expert
    once over the tokens that picked it, summed in expert order. A token's sum never depends
    on what else is in the batch."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.top_k, self.norm_topk_prob, self.activation = moe.top_k, moe.norm_topk_prob, config.activation
        self.router = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, config.hidden_size))
        self.down = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size, moe.intermediate_size))

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        probs = F.softmax(self.router.forward(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == expert)
            gate, up = F.linear(x[rows], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(_activate(gate, self.activation) * up, self.down[expert])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        gemma = config.norm_plus_one
        self.sandwich = config.sandwich_norms
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma)
        self.self_attn = Attention(config)
        # Llama: the norm before the MLP. Gemma: the norm of the attention's output, with a
        # pre- and a post-feedforward norm around the MLP.
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma)
        sparse = config.moe is not None and config.moe.layers[layer]
        self.mlp = SparseMoE(config) if sparse else MLP(config)

    def forward(self, x, cos, sin, attend: Callable, ops=None) -> torch.Tensor:
        if self.sandwich:
            h = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, attend)
            x = x + self.post_attention_layernorm.forward(h)
            h = self.mlp.forward(self.pre_feedforward_layernorm.forward(x))
            return x.add_(self.post_feedforward_layernorm.forward(h))
        if ops is None:
            x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, attend)
            return x.add_(self.mlp.forward(self.post_attention_layernorm.forward(x)))   # x: this layer's own tensor
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        x = x + self.self_attn.forward(ops.rms_norm(x, norm1.weight, norm1.eps), cos, sin, attend, ops)
        return x.add_(self.mlp.forward(ops.rms_norm(x, norm2.weight, norm2.eps), ops))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.scale = config.scale
        # Per layer: the attention's scale, window and soft cap (models.attention.AttnSpec).
        self.attn_specs = [AttnSpec(config.scale, config.window(i), config.attn_softcap)
                           for i in range(config.num_layers)]
        # Given its (uninitialised) weight, the embedding skips its random init: under the
        # loader's meta device that init is most of a process's first load of a small model,
        # and the weights are loaded over it anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_plus_one)
        # Tied models read the embedding matrix directly (no shared Parameter to re-tie
        # after .to() / .to_empty()).
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self._rope_tables: dict[tuple[RopeSpec, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        # Set by models.quant.quantize_model: the weights' format, the quantized LM head, and
        # for q4_1 the layer's small ops in C (models.fused; None: torch ops).
        self.weights_format = "fp32"
        self.logits_head: nn.Module | None = None
        self.fused = None

    # --- forward passes -------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Paged forward: new tokens' K/V go into ``kv_cache``; returns normed hidden [T, H]."""
        specs = self.attn_specs

        def attend(layer_index, q, k, v):
            return paged_attention(q, k, v, kv_cache[layer_index], batch, specs[layer_index], layer_index, self.fused)
        return self._run(input_ids, positions, attend)

    def padded_decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PaddedDecode,
                             kv_cache: torch.Tensor) -> torch.Tensor:
        """A decode step in fixed shapes (``models.attention.PaddedDecode``): new K/V into
        ``kv_cache``, returns the logits of every row [B, vocab]; no host sync, so it can be
        captured in a CUDA graph."""
        def attend(layer_index, q, k, v):
            return padded_decode_attention(q, k, v, kv_cache[layer_index], batch, self.attn_specs[layer_index])
        return self.compute_logits(self._run(input_ids, positions, attend))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None:
            logits = self.logits_head(hidden).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def dense_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal attention over ``input_ids`` as one sequence, no cache (test reference)."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        specs = self.attn_specs
        hidden = self._run(input_ids, positions, lambda i, q, k, v: causal_attention(q, k, v, specs[i]))
        return self.compute_logits(hidden)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:   # Gemma: sqrt(hidden), rounded to the weights' dtype first
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        tables = {}
        ops = self.fused
        for layer_index, layer in enumerate(self.layers):
            spec = self.config.rope_of(layer_index)
            if spec not in tables:
                cos, signed_sin = self._rope(spec, positions)
                tables[spec] = (cos.to(x.dtype)[:, None], signed_sin.to(x.dtype)[:, None])   # [T, 1, R]
            cos, sin = tables[spec]
            x = layer.forward(x, cos, sin, lambda q, k, v, i=layer_index: attend(i, q, k, v), ops)
        return self.norm(x) if ops is None else ops.rms_norm(x, self.norm.weight, self.norm.eps)

    def _rope(self, spec: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (spec, positions.device)
        if key not in self._rope_tables:
            # Built on first use, outside inference mode so that later no_grad or
            # inference_mode callers can both use it.
            with torch.inference_mode(False):
                self._rope_tables[key] = rope_table(spec, self.config.head_dim, self.config.max_position_embeddings,
                                                    positions.device)
        cos, sin = self._rope_tables[key]
        return cos[positions], sin[positions]

    # --- weights --------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors named as in the family's Hugging Face checkpoints into the fused
        params; a tensor no part of this model takes is an error that names it, and so is a
        parameter left (partly) unfilled."""
        mapping = WeightMap(self.config)
        params = dict(self.named_parameters())
        loaded = {name: 0 for name in params}   # elements written
        for hf_name, tensor in weights:
            target = mapping.place(hf_name, self.lm_head is None)
            if target is None:
                continue
            name, index, offset, plus_one = target
            if name not in params:
                raise KeyError(f"unexpected weight {hf_name!r}: no part of this {self.config.family} model takes it")
            data = params[name].data
            if index is not None:
                data = data[index]
            if offset is not None:
                data = data[offset:offset + tensor.shape[0]]
            if data.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(data.shape)}")
            data.copy_(tensor.float() + 1 if plus_one else tensor)
            loaded[name] += tensor.numel()
        missing = [name for name, count in loaded.items() if count < params[name].numel()]
        if missing:
            raise ValueError(f"weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")

