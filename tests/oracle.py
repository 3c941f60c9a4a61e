"""The "equal, or a near-tie flip" rule for comparing generated token lists.

Two runs of the same requests (alone vs batched, prefill_first vs chunked, colocated vs
disaggregated, with or without recompute) must produce the same tokens. They compute the
same math, but not always bit for bit: BLAS (MKL) sums a matmul differently for different
row counts, so logits can differ in the last few ulps. Where two candidate tokens are
almost tied, that noise can flip the choice, and from then on the two outputs differ.

``assert_same_tokens`` accepts a mismatch only when it is such a flip: at the first
position where the lists differ it recomputes the logits of the common prefix with the
cache-free reference (``model.dense_logits``) and requires both tokens' *decision scores*
to lie within ``tol * scale`` of the best one, where

- greedy: the score is the logit, ``scale = max(1, max |logit|)``;
- sampled: the score is ``log p_i - log E_i`` (the engine's exponential race, with the same
  per-(seed, index) noise), ``scale = max(1, max |logit| / temperature)``.

``TOL = 1e-3`` (relative). MKL noise in SmolLM2's logits is ~1e-5 relative; any paging,
position, sampling-index or scheduling bug moves scores by orders of magnitude more.
Tokens after the first divergence cannot be compared (the contexts differ), so a flip
ends the comparison. Every accepted flip is recorded in ``FLIPS`` and reported as a
warning, so it is never silent.

Imports torch and the engine's sampling module.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from pdqueue.engine.sampling import SamplingParams, candidate_scores

TOL = 1e-3
GREEDY = SamplingParams(temperature=0)


@dataclass(frozen=True)
class Flip:
    label: str
    position: int      # index among output tokens of the first divergence
    expected: int
    got: int
    gap: float         # |score(expected) - score(got)|, absolute
    allowed: float     # tol * scale


FLIPS: list[Flip] = []


class NearTieFlip(UserWarning):
    pass


def decision_scores(logits: torch.Tensor, params: SamplingParams, index: int) -> tuple[torch.Tensor, float]:
    """Per-token scores whose argmax is the engine's choice for output ``index``, and their scale.

    Uses the sampler's own ``candidate_scores`` (non-candidates score -inf).
    """
    logits = logits.float().cpu()
    logit_scale = max(1.0, float(logits.abs().max()))
    if params.greedy:
        return logits.double(), logit_scale
    ids, candidate = candidate_scores(logits, params, index)
    scores = torch.full((logits.numel(),), float("-inf"), dtype=torch.float64)
    if ids is None:
        scores = candidate.double()
    else:
        scores[ids] = candidate.double()
    return scores, max(1.0, logit_scale / params.temperature)


def first_divergence(expected: list[int], got: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def assert_same_tokens(loaded, prompt_ids: list[int], expected_ids: list[int], got_ids: list[int],
                       params: SamplingParams = GREEDY, tol: float = TOL, label: str = "") -> int:
    """``got_ids == expected_ids``, or they differ first by a near-tie flip; returns 1 for a
    flip (also recorded in ``FLIPS`` and warned), 0 when equal. Raises AssertionError otherwise."""
    expected_ids, got_ids = list(expected_ids), list(got_ids)
    j = first_divergence(expected_ids, got_ids)
    if j is None:
        return 0
    where = f"{label}: " if label else ""
    if j == min(len(expected_ids), len(got_ids)):
        raise AssertionError(f"{where}one output is a strict prefix of the other "
                             f"({len(expected_ids)} vs {len(got_ids)} tokens): a finish bug, not a flip\n"
                             f"expected {expected_ids}\ngot      {got_ids}")
    context = list(prompt_ids) + expected_ids[:j]
    with torch.inference_mode():
        logits = loaded.model.dense_logits(torch.tensor(context, dtype=torch.long))[-1]
    scores, scale = decision_scores(logits, params, j)
    a, b = expected_ids[j], got_ids[j]
    best = float(scores.max())
    worst_of_pair = min(float(scores[a]), float(scores[b]))
    allowed = tol * scale
    gap = abs(float(scores[a]) - float(scores[b]))
    if not (math.isfinite(worst_of_pair) and best - worst_of_pair <= allowed):
        raise AssertionError(
            f"{where}outputs differ at output token {j} ({a} expected, {b} got) and it is not a near-tie: "
            f"reference scores {float(scores[a]):.6g} vs {float(scores[b]):.6g} (best {best:.6g}), "
            f"allowed spread {allowed:.3g} (tol {tol} x scale {scale:.3g})\n"
            f"expected {expected_ids}\ngot      {got_ids}")
    flip = Flip(label, j, a, b, gap, allowed)
    FLIPS.append(flip)
    warnings.warn(NearTieFlip(f"near-tie flip accepted: {flip}"), stacklevel=2)
    return 1


def assert_all_same(loaded, prompts: list[list[int]], expected: list[list[int]], got: list[list[int]],
                    params: SamplingParams | list[SamplingParams] = GREEDY, tol: float = TOL,
                    label: str = "") -> int:
    """``assert_same_tokens`` over many requests; returns the number of flips."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    assert len(expected) == len(got) == len(prompts), (len(prompts), len(expected), len(got))
    return sum(assert_same_tokens(loaded, p, e, g, q, tol, f"{label}[{i}]")
               for i, (p, e, g, q) in enumerate(zip(prompts, expected, got, params)))
