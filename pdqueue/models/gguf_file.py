"""GGUF files of the families GGUF defines the same way llama.cpp's converter writes them:
the config (as a ``config.json`` dict, which ``models.families`` then reads like any other),
the weights dequantized to float32 in Hugging Face names and layout, and the tokenizer.

Owns: ``GGUF_ARCHITECTURES``, ``hf_config``, ``read_weights``, ``read_tokenizer``. What
llama.cpp changed on the way in is undone: the Q/K row permutation of ``llama`` files, the
experts stacked into one tensor per projection, Llama 3's rope scaling written as a
``rope_freqs`` tensor of per-frequency divisors (read back as rope factors: the same
frequencies). Metadata under the architecture's prefix that this module does not know is
refused by name, as ``models.families`` refuses unknown config.json fields.

Imports numpy, torch, gguf and ``models.tokenizer`` only.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from pdqueue.models.tokenizer import Tokenizer, hf_tokenizer_from_gguf_vocab

# general.architecture -> (config.json architectures, model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# Metadata keys (after "<arch>.") read here, or known to change nothing here.
_KNOWN = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow", "vocab_size", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "pooling_type",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def field(reader, key: str, default=None):
    value = reader.fields.get(key)
    return default if value is None else value.contents()


def architecture(reader) -> str:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (supported: "
                                  f"{', '.join(GGUF_ARCHITECTURES)}; other families: their Hugging Face directory)")
    return arch


def hf_config(reader) -> dict:
    """The file's config as a config.json dict of its family."""
    arch = architecture(reader)
    prefix = arch + "."
    unknown = sorted(k.removeprefix(prefix) for k in reader.fields
                     if k.startswith(prefix) and k.removeprefix(prefix) not in _KNOWN)
    if unknown:
        raise NotImplementedError(f"GGUF metadata {prefix}{unknown[0]} is not supported: refusing to load a model "
                                  "that could answer wrong")

    def get(key, default=None):
        return field(reader, prefix + key, default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    tensors = {t.name for t in reader.tensors}
    eos, bos = field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.bos_token_id")
    architectures, model_type = GGUF_ARCHITECTURES[arch]
    config = {
        "architectures": [architectures], "model_type": model_type, "hidden_act": "silu",
        "vocab_size": int(get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)),
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)), "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": None if bos is None else int(bos), "eos_token_id": None if eos is None else int(eos),
    }
    rotary = get("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        config["partial_rotary_factor"] = int(rotary) / head_dim
    scaling = _rope_scaling(reader, get, config["max_position_embeddings"])
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "qwen3moe":
        config.update(num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                      moe_intermediate_size=int(get("expert_feed_forward_length")),
                      norm_topk_prob=True)   # llama.cpp's qwen3moe always renormalises (no metadata for it)
    elif get("expert_count"):
        raise NotImplementedError(f"GGUF {arch} with experts is not supported")
    return config


def _rope_scaling(reader, get, context: int) -> dict | None:
    kind = get("rope.scaling.type")
    factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if factors is not None:
        # Llama 3's scaling as llama.cpp writes it: each frequency divided by its factor, which is
        # what longrope's factors do (its attention factor fixed at 1; the context not capped).
        divisors = [float(x) for x in np.asarray(factors.data, dtype=np.float32).reshape(-1)]
        return {"rope_type": "longrope", "short_factor": divisors, "long_factor": divisors,
                "original_max_position_embeddings": context, "attention_factor": 1.0}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                   "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if get(key) is not None:
                scaling[name] = float(get(key))
        return scaling
    raise NotImplementedError(f"GGUF rope scaling {kind!r} is not supported")


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved rope -> HF half-split rope)."""
    # llama.cpp: w.reshape(heads, 2, half, in).swapaxes(1, 2); this is its inverse.
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader, config: dict):
    """(Hugging Face name, float32 tensor) for every weight of the file."""
    from gguf.quants import dequantize

    arch = architecture(reader)
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue   # in the config (_rope_scaling)
        # dequantize returns numpy's row-major shape (GGUF lists dims innermost first),
        # i.e. [out_features, in_features] as Hugging Face stores them.
        array = dequantize(tensor.data, tensor.tensor_type)
        if array.dtype != np.float32 or not array.flags.writeable:  # F32 tensors are read-only mmap views
            array = np.array(array, dtype=np.float32)
        if arch == "llama" and tensor.name.endswith("attn_q.weight"):
            array = _unpermute_rows(array, config["num_attention_heads"])
        elif arch == "llama" and tensor.name.endswith("attn_k.weight"):
            array = _unpermute_rows(array, config["num_key_value_heads"])
        if tensor.name in _GLOBAL:
            yield _GLOBAL[tensor.name], torch.from_numpy(np.ascontiguousarray(array))
            continue
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", tensor.name)
        if match is None or (match.group(2) not in _LAYER and match.group(2) not in _EXPERTS):
            raise NotImplementedError(f"GGUF tensor {tensor.name!r} is not supported")
        layer, piece, kind = match.groups()
        if piece in _EXPERTS:   # [experts, out, in]: one tensor per expert, as Hugging Face stores them
            for expert, rows in enumerate(array):
                yield (f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERTS[piece]}.{kind}",
                       torch.from_numpy(np.ascontiguousarray(rows)))
            continue
        yield f"model.layers.{layer}.{_LAYER[piece]}.{kind}", torch.from_numpy(np.ascontiguousarray(array))


def read_tokenizer(reader, bos_token_id, eos_token_ids) -> Tokenizer:
    model_kind = field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise NotImplementedError(f"GGUF tokenizer model {model_kind!r} is not supported (pdqueue reads byte-level "
                                  "BPE vocabularies, 'gpt2'; for a SentencePiece one use the Hugging Face directory)")
    backend = hf_tokenizer_from_gguf_vocab(
        field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.merges"),
        field(reader, "tokenizer.ggml.token_type"), field(reader, "tokenizer.ggml.pre", "gpt2"))
    return Tokenizer(backend, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
                     chat_template=field(reader, "tokenizer.chat_template"),
                     add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", False)))
