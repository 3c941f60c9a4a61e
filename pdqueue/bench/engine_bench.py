"""`pdqueue bench engine`: the engine's speed on this machine beside its memory-bandwidth bound.

Prefill tokens/s at several prompt lengths, decode ms/step at several batch sizes, and the
bound that batch-1 decode cannot beat: every step reads all weights once, so
``weight bytes / copy bandwidth`` measured in the same run.

Imports torch and the engine.
"""

from __future__ import annotations

import time

import torch

from pdqueue.engine.config import EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a warm torch copy (bytes copied, not bytes moved: read + write)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def read_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    src.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bench_prefill(engine: LLMEngine, num_tokens: int, repeats: int = 2) -> float:
    """Tokens/s of one whole-prompt prefill."""
    vocab = engine.model_config.vocab_size
    best = float("inf")
    for r in range(repeats + 1):
        # A seed per (run, length): prompts sharing a prefix would be served from the prefix cache.
        seed = r * 1_000_003 + num_tokens
        prompt = torch.randint(3, vocab, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
        engine.add_request(f"p{num_tokens}-{r}", prompt, SamplingParams(max_tokens=1, temperature=0))
        t = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        if r:  # the first run warms up
            best = min(best, time.perf_counter() - t)
    return num_tokens / best


def bench_decode(engine: LLMEngine, batch_size: int, context: int = 128, steps: int = 8) -> float:
    """Median seconds of one decode step with ``batch_size`` sequences of ``context`` tokens."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch_size)
    ids = []
    for i in range(batch_size):
        prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        rid = f"d{batch_size}-{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True))
        ids.append(rid)
    while any(s.num_cached_tokens == 0 for s in engine.scheduler.running) or engine.num_waiting:
        engine.step()  # prefill everything
    engine.step()  # first decode step warms up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort(rid)
    times.sort()
    return times[len(times) // 2]


def run(loaded, config: EngineConfig, prompt_lens=(128, 512, 2048), batch_sizes=(1, 8, 32),
        progress=print) -> dict:
    engine = LLMEngine(loaded, config.with_(max_num_batched_tokens=max(prompt_lens),
                                            max_num_seqs=max(max(batch_sizes), config.max_num_seqs)))
    wbytes = weight_bytes(engine.model)
    copy_bw = copy_bandwidth()
    read_bw = read_bandwidth()
    result = {
        "model": loaded.config.name,
        "device": config.device,
        "dtype": config.dtype,
        "threads": torch.get_num_threads(),
        "weight_bytes": wbytes,
        "copy_gb_s": copy_bw / 1e9,
        "read_gb_s": read_bw / 1e9,
        "bound_ms_copy": wbytes / copy_bw * 1e3,
        "bound_ms_read": wbytes / read_bw * 1e3,
        "prefill_tok_s": {},
        "decode_ms": {},
    }
    for n in prompt_lens:
        progress(f"prefill {n} tokens ...")
        result["prefill_tok_s"][n] = bench_prefill(engine, n)
    for b in batch_sizes:
        progress(f"decode batch {b} ...")
        result["decode_ms"][b] = bench_decode(engine, b) * 1e3
    d = result["decode_ms"]
    result["ratios"] = {
        "decode_b1_vs_bound_copy": d[batch_sizes[0]] / result["bound_ms_copy"],
        "decode_b1_vs_bound_read": d[batch_sizes[0]] / result["bound_ms_read"],
        f"decode_b{batch_sizes[-1]}_vs_b{batch_sizes[0]}": d[batch_sizes[-1]] / d[batch_sizes[0]],
    }
    return result
