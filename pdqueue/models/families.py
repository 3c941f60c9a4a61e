"""The model registry: which families pdqueue serves and how each one's ``config.json`` becomes
a ``ModelConfig``.

Owns: ``FAMILIES`` (name, the ``architectures``/``model_type`` and GGUF names it answers to,
what it adds to Llama), ``family_for(raw)`` and ``config_from_hf(raw, name)``. Every field of a
config is either read by the family's parser, known to change nothing at inference
(``INERT``), or refused with an error that names it: a field pdqueue does not implement
(an unknown rope type, a pre-quantized checkpoint, attention biases where the family has
none) must never be ignored, since the model would load and answer wrong.

Standard library only: ``models.source`` checks a directory's config with it before a
worker (or ``pdqueue up``) starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pdqueue.models.config import FULL, SLIDING, ModelConfig, MoeSpec, RopeSpec

# Fields that do not change what a checkpoint computes at inference: metadata, training
# settings (dropout, init, auxiliary losses) and generation defaults.
INERT = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "initializer_range", "use_cache", "pad_token_id", "attention_dropout", "output_attentions",
    "output_hidden_states", "return_dict", "pretraining_tp", "router_aux_loss_coef", "output_router_logits",
    "router_jitter_noise", "embd_pdrop", "resid_pdrop", "cache_implementation", "auto_map",
    "_attn_implementation_autoset", "tokenizer_class", "id2label", "label2id", "chunk_size_feed_forward",
    "is_decoder", "add_cross_attention", "tie_encoder_decoder", "problem_type", "bad_words_ids",
    "_sliding_window_pattern", "max_length", "unsloth_fixed", "unsloth_version",
})
ROPE_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "attention_factor", "truncate", "short_factor", "long_factor", "partial_rotary_factor",
})
ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class ConfigError(ValueError):
    """A config.json pdqueue cannot serve faithfully; the message names the field."""


class _Fields:
    """A config dict whose reads are remembered, so that what nobody read can be refused."""

    def __init__(self, raw: dict, family: str):
        self.raw, self.family, self.read = raw, family, set()

    def get(self, key: str, default=None):
        self.read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def need(self, key: str):
        self.read.add(key)
        if self.raw.get(key) is None:
            raise ConfigError(f"config.json has no {key!r} (a {self.family} config needs it)")
        return self.raw[key]

    def only(self, key: str, allowed: tuple, default=None):
        """The field's value, which must be one of ``allowed`` (else the field is refused)."""
        value = self.get(key, default)
        if value not in allowed:
            raise ConfigError(f"config.json {key}={value!r} is not supported for {self.family} "
                              f"(supported: {', '.join(map(repr, allowed))})")
        return value

    def leftover(self) -> list[str]:
        """Fields nobody read; a null one is the feature switched off (``sliding_window: null``)."""
        return sorted(k for k, v in self.raw.items() if k not in self.read and k not in INERT and v is not None)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]      # config.json "architectures"
    model_types: tuple[str, ...]        # config.json "model_type"
    gguf: tuple[str, ...]               # GGUF general.architecture values it reads (models.gguf_file)
    adds: str                           # what it adds to Llama, for `pdqueue models`
    parse: Callable[[_Fields], dict]    # the family's ModelConfig fields beyond the shape
    moe: bool = False


def _rope(fields: _Fields, params: dict | None, default_theta: float, where: str) -> RopeSpec:
    """A RopeSpec from a v4 ``rope_scaling`` dict (with the top-level ``rope_theta``) or a v5
    ``rope_parameters`` dict."""
    params = dict(params or {})
    unknown = sorted(set(params) - ROPE_KEYS)
    if unknown:
        raise ConfigError(f"config.json {where}.{unknown[0]} is not supported (pdqueue implements rope "
                          f"types {', '.join(ROPE_KINDS)})")
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ROPE_KINDS:
        raise ConfigError(f"config.json {where}.rope_type={kind!r} is not supported "
                          f"(supported: {', '.join(ROPE_KINDS)})")
    # (every top-level field read, so that a v5 config that repeats one is not refused)
    top_theta, top_partial = fields.get("rope_theta", default_theta), fields.get("partial_rotary_factor", 1.0)
    top_original = fields.get("original_max_position_embeddings")
    theta = float(params.get("rope_theta") or top_theta)
    partial = float(params.get("partial_rotary_factor") or top_partial)
    original = params.get("original_max_position_embeddings") or top_original
    if kind in ("llama3", "yarn", "longrope") and not original:
        raise ConfigError(f"config.json {where}: rope_type {kind!r} needs original_max_position_embeddings")
    if kind in ("linear", "dynamic", "llama3") and not params.get("factor"):
        raise ConfigError(f"config.json {where}: rope_type {kind!r} needs a factor")
    if kind == "longrope" and not (params.get("short_factor") and params.get("long_factor")):
        raise ConfigError(f"config.json {where}: rope_type 'longrope' needs short_factor and long_factor")
    spec = dict(theta=theta, kind=kind, partial_rotary_factor=partial,
                original_max_position_embeddings=int(original or 0))
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim", "attention_factor"):
        if params.get(key) is not None:
            spec[key] = float(params[key])
    if "truncate" in params:
        spec["truncate"] = bool(params["truncate"])
    for key in ("short_factor", "long_factor"):
        if params.get(key):
            spec[key] = tuple(float(x) for x in params[key])
    return RopeSpec(**spec)


def _ropes(fields: _Fields, default_theta: float = 10000.0) -> dict[str, RopeSpec]:
    """Per layer type: {FULL: spec, SLIDING: spec} (the same spec twice unless they differ)."""
    if fields.has("rope_parameters"):
        params = fields.get("rope_parameters")
        if isinstance(params, dict) and set(params) <= {FULL, SLIDING} and params:
            specs = {t: _rope(fields, p, default_theta, f"rope_parameters.{t}") for t, p in params.items()}
            return {FULL: specs.get(FULL) or specs[SLIDING], SLIDING: specs.get(SLIDING) or specs[FULL]}
        spec = _rope(fields, params, default_theta, "rope_parameters")
        if fields.has("rope_scaling") and _rope(fields, fields.get("rope_scaling"), default_theta,
                                                "rope_scaling") != spec:
            raise ConfigError("config.json has both rope_parameters and rope_scaling, and they disagree")
    else:
        spec = _rope(fields, fields.get("rope_scaling"), default_theta, "rope_scaling")
    return {FULL: spec, SLIDING: spec}


def _layer_types(fields: _Fields, num_layers: int, default: Callable[[int], str]) -> tuple[str, ...]:
    types = fields.get("layer_types")
    if types is None:
        return tuple(default(i) for i in range(num_layers))
    bad = [t for t in types if t not in (FULL, SLIDING)]
    if bad or len(types) != num_layers:
        raise ConfigError(f"config.json layer_types {types!r}: expected {num_layers} of {FULL!r} or {SLIDING!r}")
    return tuple(types)


def _max_positions(fields: _Fields, rope: RopeSpec) -> int:
    limit = int(fields.get("max_position_embeddings", 2048))
    if rope.kind == "longrope":   # the short factors' range (models.rope)
        limit = min(limit, rope.original_max_position_embeddings)
    return limit


# --- the families -----------------------------------------------------------------------

def _silu(fields: _Fields) -> None:
    fields.only("hidden_act", ("silu",), "silu")
    fields.only("mlp_bias", (False,), False)


def _llama(fields: _Fields) -> dict:
    _silu(fields)
    fields.only("attention_bias", (False,), False)
    return {}


def _mistral(fields: _Fields) -> dict:
    """Mistral, Mixtral and Phi-3: every layer slides when ``sliding_window`` is set."""
    _silu(fields)
    window = fields.get("sliding_window")
    return {"sliding_window": int(window), "layer_types": (SLIDING,) * fields.need("num_hidden_layers")} \
        if window else {}


def _qwen_windows(fields: _Fields) -> dict:
    layers = fields.need("num_hidden_layers")
    configured = fields.get("sliding_window")   # (Qwen2.5 ships one, off: use_sliding_window false)
    window = configured if fields.get("use_sliding_window", False) else None
    first = fields.get("max_window_layers", layers)
    types = _layer_types(fields, layers, lambda i: SLIDING if window and i >= first else FULL)
    if SLIDING in types and not window:
        if not configured:
            raise ConfigError("config.json layer_types has sliding layers but no sliding_window")
        window = configured
    return {"sliding_window": int(window) if window and SLIDING in types else None, "layer_types": types}


def _qwen2(fields: _Fields) -> dict:
    _silu(fields)
    fields.get("attention_bias")   # Qwen2 has q/k/v biases whatever it says
    return {"qkv_bias": True, **_qwen_windows(fields)}


def _qwen3(fields: _Fields) -> dict:
    _silu(fields)
    fields.only("attention_bias", (False,), False)
    return {"qk_norm": True, **_qwen_windows(fields)}


def _moe_layers(fields: _Fields, num_layers: int) -> tuple[bool, ...]:
    step = int(fields.get("decoder_sparse_step", 1))
    dense = set(fields.get("mlp_only_layers", []))
    return tuple(i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers))


def _qwen3_moe(fields: _Fields) -> dict:
    parts = _qwen3(fields)
    experts = fields.get("num_experts") or fields.need("num_local_experts")
    fields.get("num_local_experts")
    moe = MoeSpec(num_experts=int(experts), top_k=int(fields.need("num_experts_per_tok")),
                  intermediate_size=int(fields.need("moe_intermediate_size")),
                  norm_topk_prob=bool(fields.get("norm_topk_prob", False)),
                  layers=_moe_layers(fields, fields.need("num_hidden_layers")))
    return {**parts, "moe": moe}


def _mixtral(fields: _Fields) -> dict:
    parts = _mistral(fields)
    layers = fields.need("num_hidden_layers")
    moe = MoeSpec(num_experts=int(fields.need("num_local_experts")), top_k=int(fields.need("num_experts_per_tok")),
                  intermediate_size=int(fields.need("intermediate_size")), norm_topk_prob=True,
                  layers=(True,) * layers)
    return {**parts, "moe": moe}


def _gemma_common(fields: _Fields) -> dict:
    act = fields.get("hidden_activation") or fields.get("hidden_act", "gelu_pytorch_tanh")
    fields.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"config.json hidden_activation={act!r} is not supported for gemma "
                          "(supported: 'gelu_pytorch_tanh')")
    fields.only("attention_bias", (False,), False)
    fields.only("use_bidirectional_attention", (False,), False)
    hidden = int(fields.need("hidden_size"))
    return {"sandwich_norms": True, "norm_plus_one": True, "activation": "gelu_tanh",
            "embed_scale": hidden ** 0.5, "attn_scale": float(fields.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attn_softcap": fields.get("attn_logit_softcapping"),
            "final_softcap": fields.get("final_logit_softcapping")}


def _gemma2(fields: _Fields) -> dict:
    layers = fields.need("num_hidden_layers")
    types = _layer_types(fields, layers, lambda i: SLIDING if (i + 1) % 2 else FULL)
    return {**_gemma_common(fields), "sliding_window": int(fields.get("sliding_window", 4096)),
            "layer_types": types}


def _gemma3(fields: _Fields) -> dict:
    layers = fields.need("num_hidden_layers")
    pattern = int(fields.get("sliding_window_pattern", 6))
    types = _layer_types(fields, layers, lambda i: SLIDING if (i + 1) % pattern else FULL)
    parts = {**_gemma_common(fields), "qk_norm": True, "sliding_window": int(fields.get("sliding_window", 4096)),
             "layer_types": types}
    if not fields.has("rope_parameters"):   # v4: the local layers' base is a field of its own
        parts["local_rope"] = RopeSpec(theta=float(fields.get("rope_local_base_freq", 10000.0)))
    return parts


def _phi3(fields: _Fields) -> dict:
    fields.only("attention_bias", (False,), False)
    return _mistral(fields)


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), ("llama",), ("llama",),
           "the base: RMSNorm, SwiGLU, GQA, rope (default, linear, dynamic, llama3, yarn scaling)", _llama),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), (),
           "sliding-window attention in every layer", _mistral),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",), "q/k/v biases", _qwen2),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",), "per-head q/k RMSNorm", _qwen3),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), (),
           "sandwich norms, (1 + w) norms, scaled embeddings, GELU-tanh, attention and logit soft-capping, "
           "alternating sliding/global layers", _gemma2),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), (),
           "Gemma 2's parts with q/k norms, 5 local : 1 global layers with their own rope base", _gemma3),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), (),
           "fused qkv and gate_up weights, partial rotary, longrope (short factors)", _phi3),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",),
           "Qwen3 with a top-k mixture of SwiGLU experts", _qwen3_moe, moe=True),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), (),
           "Mistral with a top-2 mixture of SwiGLU experts", _mixtral, moe=True),
)
# What every family is served through (the KV layout is the pool's: workers/, transfer/), and
# which --weights formats apply (models.quant; the q4_1 kernel's fused layer ops only for
# Llama-shaped layers, torch's ops otherwise).
PATHS = ("prefill/decode over shm", "TCP data wire", "ZeroMQ", "NIXL", "colocated", "prompt placement",
         "migration", "prefix cache")


def weight_formats(family: Family) -> tuple[str, ...]:
    return ("fp32",) if family.moe else ("fp32", "int8", "int4", "q4_1")


_BY_ARCH = {a: f for f in FAMILIES for a in f.architectures}
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family_for(raw: dict) -> Family:
    """The family of a config.json; ConfigError naming what it declares when none serves it."""
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    model_type = raw.get("model_type")
    if not archs and model_type in _BY_TYPE:
        return _BY_TYPE[model_type]
    declared = f"architectures {archs}" if archs else f"model_type {model_type!r}"
    raise ConfigError(f"config.json declares {declared}, which pdqueue does not serve (families: "
                      f"{', '.join(f.name for f in FAMILIES)}; `pdqueue models` lists them)")


def config_from_hf(raw: dict, name: str) -> ModelConfig:
    """A ``ModelConfig`` from a config.json dict; ConfigError for anything not implemented."""
    if raw.get("quantization_config"):
        method = (raw["quantization_config"] or {}).get("quant_method", "?")
        raise ConfigError(f"config.json quantization_config ({method}): pre-quantized checkpoints are not "
                          "supported; serve the float checkpoint, with --weights int8/int4/q4_1 to quantize it")
    if raw.get("text_config") is not None:
        raise ConfigError("config.json has a text_config: a multimodal checkpoint; serve its text-only "
                          "model (e.g. Gemma3ForCausalLM)")
    family = family_for(raw)
    fields = _Fields(raw, family.name)
    parts = family.parse(fields)
    ropes = _ropes(fields, 1000000.0 if family.name in ("gemma3", "mixtral") else 10000.0)
    if "local_rope" not in parts and ropes[SLIDING] != ropes[FULL]:
        parts["local_rope"] = ropes[SLIDING]
    num_heads = int(fields.need("num_attention_heads"))
    hidden = int(fields.need("hidden_size"))
    eos = fields.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    config = ModelConfig(
        name=name, vocab_size=int(fields.need("vocab_size")), hidden_size=hidden,
        intermediate_size=int(fields.need("intermediate_size")), num_layers=int(fields.need("num_hidden_layers")),
        num_heads=num_heads, num_kv_heads=int(fields.get("num_key_value_heads", num_heads)),
        head_dim=int(fields.get("head_dim", hidden // num_heads)), rope_theta=ropes[FULL].theta,
        rms_norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_max_positions(fields, ropes[FULL]),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", family.name.startswith("gemma"))),
        bos_token_id=fields.get("bos_token_id"), eos_token_ids=eos_ids,
        family=family.name, rope=ropes[FULL], **parts)
    left = fields.leftover()
    if left:
        raise ConfigError(f"config.json field {left[0]!r} (= {raw[left[0]]!r}) is not understood by pdqueue's "
                          f"{family.name} family; refusing to load a model that could answer wrong")
    return config
