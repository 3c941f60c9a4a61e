"""Small synthetic GGUF files for loader, cache and CLI tests (numpy and gguf, no torch).

``write_tiny_gguf`` writes a whole llama model of ~110 KB: random fp32 weights, a byte-level
BPE vocabulary of 258 tokens (the 256 byte symbols, one merge, ``<|endoftext|>``), the
metadata the loader reads. It loads and generates like SmolLM2's file does.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def write_tiny_gguf(path: Path, seed: int = 0, *, arch: str = "llama", num_layers: int = 2, num_kv_heads: int = 2,
                    head_dim: int = 8, context: int = 256, weights: bool = True) -> Path:
    """A GGUF llama model at ``path``. ``weights=False`` writes one small tensor only: a file
    whose metadata (layers, KV heads, head size) can describe a big model while it stays
    small, for checks that read the config and never the weights."""
    from tokenizers import pre_tokenizers

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hidden, inter, heads = 32, 64, 4
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "<|endoftext|>"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_block_count(num_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])  # the last one is a control token
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)
    if weights:
        tensor("output_norm.weight", hidden)
        for i in range(num_layers):
            tensor(f"blk.{i}.attn_norm.weight", hidden)
            tensor(f"blk.{i}.ffn_norm.weight", hidden)
            tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
            tensor(f"blk.{i}.attn_k.weight", num_kv_heads * head_dim, hidden)
            tensor(f"blk.{i}.attn_v.weight", num_kv_heads * head_dim, hidden)
            tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
            tensor(f"blk.{i}.ffn_gate.weight", inter, hidden)
            tensor(f"blk.{i}.ffn_up.weight", inter, hidden)
            tensor(f"blk.{i}.ffn_down.weight", hidden, inter)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
