"""Rotary position embeddings: the inverse frequencies of every scaling a supported family
uses, as transformers' ``modeling_rope_utils`` computes them, and the cos/sin tables.

Owns: ``inverse_frequencies(spec, head_dim, max_positions)`` and ``rope_table``. ``dynamic``
NTK scaling only changes the frequencies past ``max_position_embeddings``, where no engine
runs (a request's context is capped there), so within the context it is the default rope;
``longrope`` uses its short factors, the ones transformers uses while a sequence is no longer
than ``original_max_position_embeddings`` (``models.families`` caps such a model's context there).

Imports torch only.
"""

from __future__ import annotations

import math

import torch

from pdqueue.models.config import RopeSpec

KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rotary_dim(spec: RopeSpec, head_dim: int) -> int:
    return int(head_dim * spec.partial_rotary_factor)


def inverse_frequencies(spec: RopeSpec, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32, the factor cos and sin are scaled by)."""
    dim = rotary_dim(spec, head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (spec.theta ** exponents)
    if spec.kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if spec.kind == "linear":
        return inv_freq / spec.factor, 1.0
    if spec.kind == "llama3":
        return _llama3(inv_freq, spec), 1.0
    if spec.kind == "yarn":
        return _yarn(spec, dim, max_positions)
    if spec.kind == "longrope":
        factor = spec.factor if spec.factor != 1.0 else max_positions / spec.original_max_position_embeddings
        attention = spec.attention_factor
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(
                1 + math.log(factor) / math.log(spec.original_max_position_embeddings))
        ext = torch.tensor(spec.short_factor, dtype=torch.float32)
        return 1.0 / (ext * spec.theta ** exponents), attention
    raise ValueError(f"rope type {spec.kind!r} is not supported (supported: {', '.join(KINDS)})")


def _llama3(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    factor, low, high = spec.factor, spec.low_freq_factor, spec.high_freq_factor
    old_context = spec.original_max_position_embeddings
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    base, original = spec.theta, spec.original_max_position_embeddings
    factor = spec.factor if spec.factor != 1.0 else max_positions / original
    attention = spec.attention_factor
    if attention is None:
        if spec.mscale and spec.mscale_all_dim:
            attention = _yarn_mscale(factor, spec.mscale) / _yarn_mscale(factor, spec.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_table(spec: RopeSpec, head_dim: int, max_positions: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed_sin) [max_positions, rotary_dim]: ``signed_sin`` has its first half negated,
    so that rotating is a swap of the halves and one multiply-add (``models.layers.apply_rope``)."""
    inv_freq, attention = inverse_frequencies(spec, head_dim, max_positions)
    dim = inv_freq.shape[0] * 2
    pos = torch.arange(max_positions, device=device).float()
    freqs = torch.outer(pos, inv_freq.to(device))
    angles = torch.cat((freqs, freqs), dim=-1)
    sign = torch.ones(dim, device=device)
    sign[:dim // 2] = -1   # rotate_half negates the second half moved first
    cos, sin = angles.cos(), angles.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos, sin * sign
