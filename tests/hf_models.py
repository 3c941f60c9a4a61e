"""Tiny random checkpoints of every supported family, built by transformers from its config
class and saved as a Hugging Face directory with SmolLM2's real tokenizer (read from the
bundled GGUF file's vocabulary); and transformers' own logits and greedy continuations of
them, the oracle the family tests compare with. Nothing is downloaded.

The weights are drawn larger than transformers' init (std 0.02 gives near-uniform logits, so
greedy decoding would be decided by rounding noise): each matrix ~N(0, (2/sqrt(fan_in))^2), the
norms around 1, so the top two logits along a continuation stay well apart.

``checkpoint`` and ``greedy`` are ``build`` and ``hf_greedy`` made once per test run and
shared by its xdist workers and test modules (tests/run_cache.py): the family tests of three
modules ask for the same checkpoints and the same answers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from pathlib import Path

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 64, 4, 2, 16, 128, 4
WINDOW = 8   # sliding layers see 8 positions: the tests' prompts are longer


def _shape(**extra) -> dict:
    return dict(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=512, **extra)


def _configs() -> dict[str, tuple[str, dict]]:
    """family case -> (transformers config class name, its arguments)."""
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return {
        "llama": ("LlamaConfig", _shape(tie_word_embeddings=True)),
        "llama3": ("LlamaConfig", _shape(rope_parameters=llama3)),
        "llama-linear": ("LlamaConfig", _shape(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                "factor": 4.0})),
        "mistral": ("MistralConfig", _shape(sliding_window=WINDOW)),
        "qwen2": ("Qwen2Config", _shape(tie_word_embeddings=True)),
        "qwen2-yarn": ("Qwen2Config", _shape(rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 128})),
        "qwen3": ("Qwen3Config", _shape()),
        "gemma2": ("Gemma2Config", _shape(sliding_window=WINDOW, query_pre_attn_scalar=16,
                                          attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
        "gemma3": ("Gemma3TextConfig", _shape(sliding_window=WINDOW, query_pre_attn_scalar=16,
                                              layer_types=["sliding_attention", "sliding_attention",
                                                           "full_attention", "sliding_attention"])),
        "phi3": ("Phi3Config", _shape(sliding_window=WINDOW, pad_token_id=0, partial_rotary_factor=0.5)),
        "qwen3_moe": ("Qwen3MoeConfig", _shape(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                               norm_topk_prob=True, mlp_only_layers=[1])),
        "qwen3_moe-sparse": ("Qwen3MoeConfig", _shape(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                      norm_topk_prob=True)),   # every layer sparse (as llama.cpp's)
        "mixtral": ("MixtralConfig", _shape(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    }


CASES = tuple(_configs())


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """SmolLM2's tokenizer (a ``pdqueue.models.tokenizer.Tokenizer``), from the GGUF file's
    vocabulary alone (no weights are read)."""
    import gguf

    from pdqueue.models.gguf_file import field as _field
    from pdqueue.models.source import resolve_model_path
    from pdqueue.models.tokenizer import Tokenizer, hf_tokenizer_from_gguf_vocab

    reader = gguf.GGUFReader(str(resolve_model_path("smollm2")))
    backend = hf_tokenizer_from_gguf_vocab(
        _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.merges"),
        _field(reader, "tokenizer.ggml.token_type"), _field(reader, "tokenizer.ggml.pre", "gpt2"))
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=(2,),
                     chat_template=_field(reader, "tokenizer.chat_template"))


def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (0.0 if gemma else 1.0))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / p.shape[-1] ** 0.5)


def build(case: str, directory: Path, seed: int = 0) -> Path:
    """A random checkpoint of ``case`` (a key of ``CASES``) saved in ``directory``."""
    import transformers

    cls_name, kwargs = _configs()[case]
    tokenizer = smollm2_tokenizer()
    config = getattr(transformers, cls_name)(vocab_size=tokenizer.vocab_size, bos_token_id=1, eos_token_id=2,
                                             **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(directory)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tokenizer.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))   # tokenizer.json as it is (not a family class's own)
    return directory


def checkpoint(case: str, seed: int = 0) -> Path:
    """``build(case, seed=seed)``'s directory, built once per test run (tests/run_cache.py).
    Shared: a test that changes a checkpoint copies it first."""
    from tests import run_cache

    def make(target: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build(case, target, seed)

    return run_cache.path(f"hf-{case}-seed{seed}", make)


def greedy(case: str, ids: list[int], n: int, seed: int = 0) -> list[int]:
    """``hf_greedy`` of ``checkpoint(case, seed)``, computed once per test run."""
    from tests import run_cache

    digest = hashlib.sha256(json.dumps([case, seed, ids, n]).encode()).hexdigest()[:16]
    return run_cache.value(f"greedy-{case}-{digest}", lambda: hf_greedy(checkpoint(case, seed), ids, n))


@functools.lru_cache(maxsize=None)
def hf_model(directory: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(str(directory))(torch.tensor([ids])).logits[0].float()


def hf_greedy(directory: Path, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids``: ``n`` tokens, EOS ignored."""
    model = hf_model(str(directory))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()
