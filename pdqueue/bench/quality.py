"""`pdqueue bench quality`: what quantized weights cost in quality, against float32.

For each weights format (``pdqueue.models.quant``): the perplexity of a fixed public-domain
text (``quality_text.TEXT``, ~2,900 SmolLM2 tokens) in disjoint windows, the share of its
positions whose top-1 next token equals float32's (teacher-forced), and over a fixed set of
prompts (``quality_text.PROMPTS``) the greedy agreement with float32: positions equal, the
mean share of tokens before the first difference, and prompts whose whole output is equal.

Imports torch, the engine and the models.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from pdqueue.bench.quality_text import PROMPTS, TEXT
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.models.loader import load_model


@torch.inference_mode()
def score_text(model, ids: list[int], window: int) -> tuple[float, torch.Tensor]:
    """(mean negative log-likelihood per predicted token, the top-1 prediction per
    position) over disjoint windows of ``window`` tokens; each window's first token is
    context only."""
    nll, count, top1 = 0.0, 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start:start + window], dtype=torch.long)
        if len(chunk) < 2:
            break
        logp = F.log_softmax(model.dense_logits(chunk)[:-1].float(), dim=-1)
        nll -= float(logp.gather(1, chunk[1:, None]).sum())
        count += len(chunk) - 1
        top1.append(logp.argmax(dim=-1))
    return nll / count, torch.cat(top1)


def greedy(loaded, prompts, max_tokens: int) -> list[list[int]]:
    engine = LLMEngine(loaded, EngineConfig(model=loaded.config.name, kv_cache_mb=64,
                                            weights=getattr(loaded, "weights", "fp32")))
    ids = [loaded.tokenizer.encode(p) for p in prompts]
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    same_positions = total = 0
    prefix = []
    for out, ref in zip(outputs, reference):
        same_positions += sum(a == b for a, b in zip(out, ref))
        total += len(ref)
        first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref))
        prefix.append(first / len(ref))
    return {"greedy_token_agreement": same_positions / total,
            "greedy_prefix_match": sum(prefix) / len(prefix),
            "greedy_identical": sum(p == 1.0 for p in prefix) / len(prefix)}


def run(model: str = "smollm2", formats=("fp32", "int8", "int4", "q4_1"), window: int = 512, max_tokens: int = 32,
        progress=print) -> dict:
    """Float32 first (the reference), then each other format; one model in memory at a time."""
    formats = ["fp32", *[f for f in formats if f != "fp32"]]
    results: dict[str, dict] = {}
    ref_top1 = ref_greedy = None
    num_tokens = 0
    for fmt in formats:
        progress(f"weights {fmt}: loading ...")
        loaded = load_model(model, weights=fmt)
        ids = loaded.tokenizer.encode(TEXT)
        num_tokens = len(ids)
        started = time.perf_counter()
        progress(f"weights {fmt}: perplexity over {len(ids)} tokens ...")
        nll, top1 = score_text(loaded.model, ids, window)
        progress(f"weights {fmt}: greedy, {len(PROMPTS)} prompts x {max_tokens} tokens ...")
        outs = greedy(loaded, PROMPTS, max_tokens)
        if ref_top1 is None:
            ref_top1, ref_greedy = top1, outs
        r = {"perplexity": math.exp(nll), "nll": nll,
             "top1_agreement": float((top1 == ref_top1).float().mean()), **agreement(outs, ref_greedy),
             "seconds": time.perf_counter() - started}
        r["ppl_vs_fp32"] = r["perplexity"] / results["fp32"]["perplexity"] if results else 1.0
        results[fmt] = r
        del loaded
    return {"model": model, "text_tokens": num_tokens, "window": window, "prompts": len(PROMPTS),
            "max_tokens": max_tokens, "threads": torch.get_num_threads(), "results": results}


def format_table(result: dict) -> str:
    lines = [f"model {result['model']}: perplexity over {result['text_tokens']} tokens (windows of "
             f"{result['window']}); greedy over {result['prompts']} prompts x {result['max_tokens']} tokens",
             f"{'weights':<8}{'ppl':>9}{'vs fp32':>9}{'top-1 =':>9}{'greedy =':>10}{'prefix =':>10}{'identical':>11}"]
    for fmt, r in result["results"].items():
        lines.append(f"{fmt:<8}{r['perplexity']:>9.3f}{r['ppl_vs_fp32']:>9.3f}{r['top1_agreement']:>9.3f}"
                     f"{r['greedy_token_agreement']:>10.3f}{r['greedy_prefix_match']:>10.3f}"
                     f"{r['greedy_identical']:>11.3f}")
    return "\n".join(lines)
