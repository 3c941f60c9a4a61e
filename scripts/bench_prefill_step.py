"""Prefill throughput and time to first token against a step's token budget, in one run.

A prefill-only engine (as a prefill worker runs it) gets the same 48 prompts queued at once,
the first of `bench serve`'s seeded request list (for SmolLM2 25 % documents of 256-512 tokens,
75 % chats of 16-64: ``serve_load.plan_requests``), once per
``--max-batched-tokens`` value, alternating, ``--rounds`` times; each run prints tokens/s and
the mean time from the start to a prompt's first token. On a CPU the first is flat from 128
to 2048 tokens a step and the second grows with the step (docs/performance-history.md, "the
issue's grid again, after the float32 cell was fixed"), which is why ``EngineConfig.max_num_batched_tokens`` is 512.

    python scripts/bench_prefill_step.py [--weights fp32|q4_1] [--budgets 128,256,512,1024,2048] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdqueue.bench.serve_load import Settings, plan_requests
from pdqueue.engine.config import EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.models.loader import load_model


def prompts(model: str, n: int = 48) -> list[list[int]]:
    """The first ``n`` prompts of `bench serve`'s seeded request list for ``model``."""
    return [list(p.prompt_ids) for p in plan_requests(Settings.for_model(model), rate=1.0, count=n)]


def run(loaded, weights: str, budget: int, queued: list[list[int]]) -> tuple[float, float]:
    """(prompt tokens/s, mean seconds to a first token) with steps of at most ``budget`` tokens."""
    engine = LLMEngine(loaded, EngineConfig(max_num_batched_tokens=budget, prefix_caching=False, weights=weights),
                       prefill_only=True)
    params = SamplingParams(max_tokens=1, temperature=0)
    for i, ids in enumerate(queued):
        engine.add_request(str(i), ids, params)
    started, firsts = time.perf_counter(), []
    while engine.has_unfinished:
        for out in engine.step():
            firsts.append(time.perf_counter() - started)
            if out.detached_blocks:
                engine.free_blocks(out.detached_blocks)
    elapsed = time.perf_counter() - started
    return sum(map(len, queued)) / elapsed, statistics.mean(firsts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="fp32")
    parser.add_argument("--budgets", default="128,256,512,1024,2048")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, weights=args.weights)
    queued = prompts(args.model)
    for rnd in range(args.rounds):
        for budget in map(int, args.budgets.split(",")):
            tok_s, first_s = run(loaded, args.weights, budget, queued)
            print(f"{args.weights} round {rnd} budget {budget:5d}: {tok_s:6.0f} tok/s, "
                  f"mean first token {first_s:5.2f} s", flush=True)


if __name__ == "__main__":
    main()
