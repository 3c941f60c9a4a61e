"""Sampling parameters and the sampler.

The random draw for output token ``index`` of a request comes from a generator seeded by
``(seed, index)`` alone, so the prefill worker (token 0), a decode worker (tokens 1..n), a
worker resuming after recompute and the colocated engine all draw the same token whatever
else shares the batch.

Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def draw_seed(seed: int, index: int) -> int:
    """A 63-bit seed for draw ``index`` of a request seeded with ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def sample_one(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """Pick the token for output position ``index`` from one row of float32 logits."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    logits = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # Exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) samples from p.
    gen = torch.Generator(device="cpu").manual_seed(draw_seed(params.seed, index))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / noise).item())


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """One token per row; greedy rows are decided in one batched argmax."""
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    return [greedy_ids[row] if p.greedy else sample_one(logits[row], p, index)
            for row, (p, index) in enumerate(zip(params, indices))]
