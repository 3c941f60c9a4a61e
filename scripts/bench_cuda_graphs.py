"""Decode on a CUDA device: ms per step from CUDA graph replays against eager steps, in one run.

The model has SmolLM2-135M's shape with random weights (its GGUF file may not be where the
GPU is). For each dtype and batch size: B requests of 256-token prompts prefilled, then
``--steps`` decode steps timed, graphs and eager alternating, ``--rounds`` times; prints the
median ms/step of each, the spread (min-max) and the ratio, and prefill tokens/s.

    python scripts/bench_cuda_graphs.py [--batch-sizes 1,8,32] [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pdqueue.engine.config import EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.models.config import ModelConfig
from pdqueue.models.loader import random_model

SMOLLM2_SHAPE = ModelConfig(
    name="smollm2-shape", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
    tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
PROMPT_TOKENS = 256


def decode_ms(loaded, dtype: str, batch: int, steps: int, graphs: bool) -> tuple[float, float]:
    """(ms per decode step at ``batch``, prefill tokens/s) on a fresh engine."""
    engine = LLMEngine(loaded, EngineConfig(model="bench", device="cuda", dtype=dtype, kv_cache_mb=2048,
                                            max_num_seqs=max(batch, 1), cuda_graphs=graphs))
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(3, 49000) for _ in range(PROMPT_TOKENS)], params)
    torch.cuda.synchronize()
    started = time.perf_counter()
    while engine.num_waiting or any(seq.num_output_tokens == 0 for seq in engine.scheduler.running):
        engine.step()
    prefill_tps = batch * PROMPT_TOKENS / (time.perf_counter() - started)
    for _ in range(3):   # warm: the graphs of this batch and context are captured here
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()   # each step copies its logits to the host: the time includes the sync
    return (time.perf_counter() - started) * 1000 / steps, prefill_tps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    for dtype in args.dtypes.split(","):
        loaded = random_model(SMOLLM2_SHAPE, "cuda", getattr(torch, dtype))
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            runs = {True: [], False: []}
            prefill = []
            for _ in range(args.rounds):
                for graphs in (False, True):
                    ms, tps = decode_ms(loaded, dtype, batch, args.steps, graphs)
                    runs[graphs].append(ms)
                    prefill.append(tps)
            eager, graphed = statistics.median(runs[False]), statistics.median(runs[True])
            print(f"{dtype:9} B={batch:3}  eager {eager:7.2f} ms/step ({min(runs[False]):.2f}-{max(runs[False]):.2f})"
                  f"  graphs {graphed:7.2f} ({min(runs[True]):.2f}-{max(runs[True]):.2f})  "
                  f"eager/graphs {eager / graphed:5.2f}x  prefill {statistics.median(prefill):9.0f} tok/s", flush=True)
        del loaded
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
