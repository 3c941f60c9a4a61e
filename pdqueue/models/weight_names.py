"""Where each tensor of a family's Hugging Face checkpoint goes in ``models.decoder``.

Owns: ``WeightMap``. The decoder keeps q/k/v as one ``qkv_proj`` and gate/up as one
``gate_up_proj`` (fewer, larger GEMMs), and a mixture's experts as two stacked parameters
(``gate_up`` [E, 2I, H], ``down`` [E, H, I]), so a checkpoint's separate tensors land at row
offsets of those; Phi-3's fused tensors land whole. Gemma stores its RMSNorm weights as
``w - 1``: they are loaded as ``w``.

Standard library only.
"""

from __future__ import annotations

import re

from pdqueue.models.config import ModelConfig

_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PIECES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class WeightMap:
    def __init__(self, config: ModelConfig):
        self.config = config
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        # a checkpoint's piece -> (the fused piece, row offset in it)
        self.packed = {
            "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q_size), "v_proj": ("qkv_proj", q_size + kv_size),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", config.intermediate_size),
        }

    def place(self, hf_name: str, tied: bool) -> tuple[str, int | None, int | None, bool] | None:
        """(parameter name, expert index or None, row offset or None, add one) for a
        checkpoint tensor, or None for one that is not a weight (rope buffers, a tied head)."""
        name = hf_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied):
            return None
        plus_one = self.config.norm_plus_one and name.endswith("norm.weight")
        expert = _EXPERT.match(name)
        if expert and self.config.moe is not None:
            layer, index, piece = expert.group(1), int(expert.group(2)), _EXPERT_PIECES.get(expert.group(3))
            if piece is None:
                return (name, None, None, False)   # unknown: the caller names it
            inter = self.config.moe.intermediate_size
            if piece == "down":
                return (f"{layer}.mlp.down", index, None, False)
            return (f"{layer}.mlp.gate_up", index, 0 if piece == "gate" else inter, False)
        if self.config.moe is not None:
            # the router: Qwen3-MoE's mlp.gate, Mixtral's block_sparse_moe.gate; transformers 5's
            # stacked experts (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj)
            name = re.sub(r"\.(?:mlp|block_sparse_moe)\.gate\.weight$", ".mlp.router.weight", name)
            name = re.sub(r"\.mlp\.experts\.gate_up_proj$", ".mlp.gate_up", name)
            name = re.sub(r"\.mlp\.experts\.down_proj$", ".mlp.down", name)
        for piece, (fused, offset) in self.packed.items():
            if f".{piece}." in name:
                return (name.replace(f".{piece}.", f".{fused}."), None, offset, False)
        return (name, None, None, plus_one)
