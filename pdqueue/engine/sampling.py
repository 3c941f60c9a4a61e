"""Sampling parameters and the sampler.

The random draw for output token ``index`` of a request comes from a generator seeded by
``(seed, index)`` alone, so the prefill worker (token 0), a decode worker (tokens 1..n), a
worker resuming after recompute and the colocated engine all draw the same token whatever
else shares the batch.

Imports torch, and pdqueue.protocol for the request defaults and their checks
(``sampling_error``, the one check of each field).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdqueue.protocol import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, sampling_error

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K  # 0 = no top-k cut
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens is None:   # (up to the context: Limits.fit_to_context gives it a number first)
            raise ValueError("max_tokens must be a number of tokens here, got None")
        for name in ("max_tokens", "temperature", "top_p", "top_k"):
            reason = sampling_error(name, getattr(self, name))
            if reason:
                raise ValueError(reason)

    @classmethod
    def for_request(cls, req, seed: int) -> "SamplingParams":
        """A ``pdqueue.protocol.Request``'s sampling, with the effective ``seed``."""
        return cls(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                   top_k=req.top_k, seed=seed, stop=tuple(req.stop), ignore_eos=req.ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def draw_seed(seed: int, index: int) -> int:
    """A 63-bit seed for draw ``index`` of a request seeded with ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


_NUCLEUS_CANDIDATES = (64, 1024)  # top-p looks at this many best tokens first (then sorts all)


def sample_one(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """Pick the token for output position ``index`` from one row of float32 logits."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    ids, scores = candidate_scores(logits, params, index)
    choice = int(torch.argmax(scores).item())
    return choice if ids is None else int(ids[choice])


def candidate_scores(logits: torch.Tensor, params: SamplingParams,
                     index: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(candidate token ids, or None for the whole vocabulary; their scores): the sampled
    token is the candidate with the highest score.

    Top-k keeps the k best tokens; top-p then keeps the smallest prefix of them (by
    probability, renormalised after top-k) whose mass reaches p; the draw is an exponential
    race over the survivors with noise from the (seed, index) generator. Only candidates
    are sorted and noised, so a sampled row costs well under a sort of the vocabulary.
    """
    logits = logits.float().cpu() / params.temperature
    vocab = logits.numel()
    if params.top_k and params.top_k < vocab:
        values, ids = torch.topk(logits, params.top_k)          # sorted, best first
        log_probs = values - torch.logsumexp(values, dim=-1)
    elif params.top_p < 1.0:
        log_norm = torch.logsumexp(logits, dim=-1)
        for num in (*_NUCLEUS_CANDIDATES, vocab):
            if num >= vocab:
                values, ids = torch.sort(logits, descending=True, stable=True)
            else:
                values, ids = torch.topk(logits, num)
            log_probs = values - log_norm
            if num >= vocab or float(torch.exp(log_probs).sum()) >= params.top_p:
                break  # the nucleus lies within these candidates
    else:
        ids = None
        log_probs = torch.log_softmax(logits, dim=-1)
    if params.top_p < 1.0 and ids is not None:
        probs = torch.exp(log_probs)
        before = torch.cumsum(probs, dim=-1) - probs
        keep = int((before < params.top_p).sum())                 # at least the best token
        log_probs, ids = log_probs[:keep], ids[:keep]
    # Exponential race (Gumbel-max): argmax p_i / E_i, E_i ~ Exp(1), samples from p; in logs.
    # E = -log(1 - U) from uniforms (5x cheaper than exponential_ here).
    gen = torch.Generator(device="cpu").manual_seed(draw_seed(params.seed, index))
    noise = -torch.log1p(-torch.rand(log_probs.shape, generator=gen))
    return ids, log_probs - torch.log(noise)


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """One token per row; greedy rows are decided in one batched argmax (``max(dim).indices``:
    the same first maximal index as ``argmax``, whose CPU kernel is ~1.6x slower: 0.70 against
    0.44 ms for [8, 49152] on one thread)."""
    greedy_ids = logits.max(dim=-1).indices.tolist() if any(p.greedy for p in params) else []
    return [greedy_ids[row] if p.greedy else sample_one(logits[row], p, index)
            for row, (p, index) in enumerate(zip(params, indices))]
