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
    """Bytes of weights one decode step reads (quantized layers at their packed size)."""
    from pdqueue.models.quant import step_weight_bytes

    return step_weight_bytes(model)


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
    ids = _start_decode(engine, batch_size, steps + 3, context, prefix="d")
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
        "weights": getattr(loaded, "weights", "fp32"),
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


def _start_decode(engine: LLMEngine, batch_size: int, max_tokens: int, context: int = 128,
                  prefix: str = "c") -> list[str]:
    """``batch_size`` sequences of ``context`` random tokens (ids ``<prefix><batch>-<i>``),
    prefilled and one (warm-up) decode step in."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch_size)
    ids = []
    for i in range(batch_size):
        prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        rid = f"{prefix}{batch_size}-{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        ids.append(rid)
    while any(s.num_cached_tokens == 0 for s in engine.scheduler.running) or engine.num_waiting:
        engine.step()
    engine.step()  # the first decode step warms up
    return ids


def first_steps(engine: LLMEngine, prompt_len: int = 16) -> dict[str, float]:
    """The latency of a fresh engine's first request: its prompt's step (the first forward
    pass after the load: lazy allocations, first-touch pages) and its first decode step, ms."""
    prompt = torch.randint(3, engine.model_config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(7)).tolist()
    engine.add_request("first", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished:
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    return {"prefill": times[0], "decode": times[1]}


def run_compare(models: dict, config: EngineConfig, prompt_lens=(128, 512, 2048), batch_sizes=(1, 8, 32),
                rounds: int = 2, progress=print) -> dict:
    """Each of ``models`` ({weights format: LoadedModel}, the baseline first) in its own
    engine, measured interleaved: prefill runs alternate between the formats (the best of
    ``rounds`` each), and at each batch size the decode steps alternate one by one
    (8 x ``rounds`` steps each, the median), so a noisy neighbour slows every format alike.
    ``ratios`` of the others hold ``decode_bN_vs_<baseline>`` and ``prefill_N_vs_<baseline>``;
    each result ``decode_bN_vs_b1`` and the bound."""
    names = list(models)
    cfg = config.with_(max_num_batched_tokens=max(prompt_lens), max_num_seqs=max(max(batch_sizes), config.max_num_seqs))
    engines = {n: LLMEngine(models[n], cfg.with_(weights=n)) for n in names}
    first = {n: first_steps(engines[n]) for n in names}   # before anything else warms them
    read_bw = read_bandwidth()
    results = {}
    for n in names:
        wbytes = weight_bytes(engines[n].model)
        results[n] = {"model": models[n].config.name, "weights": n, "weight_bytes": wbytes,
                      "bound_ms_read": wbytes / read_bw * 1e3, "prefill_tok_s": {}, "decode_ms": {},
                      "first_step_ms": first[n]}
    for length in prompt_lens:
        progress(f"prefill {length} tokens, {' / '.join(names)} alternating ...")
        best = {n: float("inf") for n in names}
        for r in range(rounds + 1):
            for n in (names if r % 2 == 0 else names[::-1]):
                seed = r * 1_000_003 + length
                prompt = torch.randint(3, engines[n].model_config.vocab_size, (length,),
                                       generator=torch.Generator().manual_seed(seed)).tolist()
                engines[n].add_request(f"p{length}-{r}", prompt, SamplingParams(max_tokens=1, temperature=0))
                t = time.perf_counter()
                while engines[n].has_unfinished:
                    engines[n].step()
                if r:  # the first run warms up
                    best[n] = min(best[n], time.perf_counter() - t)
        for n in names:
            results[n]["prefill_tok_s"][length] = length / best[n]
    steps = 8 * rounds
    for b in batch_sizes:
        progress(f"decode batch {b}, {' / '.join(names)} step by step ...")
        ids = {n: _start_decode(engines[n], b, steps + 3) for n in names}
        times = {n: [] for n in names}
        for i in range(steps):
            for n in (names if i % 2 == 0 else names[::-1]):
                t = time.perf_counter()
                engines[n].step()
                times[n].append(time.perf_counter() - t)
        for n in names:
            for rid in ids[n]:
                engines[n].abort(rid)
            ts = sorted(times[n])
            results[n]["decode_ms"][b] = ts[len(ts) // 2] * 1e3
    base = names[0]
    b1 = batch_sizes[0]
    for n in names:
        d = results[n]["decode_ms"]
        ratios = {f"decode_b{b1}_vs_bound_read": d[b1] / results[n]["bound_ms_read"]}
        ratios.update({f"decode_b{b}_vs_b{b1}": d[b] / d[b1] for b in batch_sizes[1:]})
        if n != base:
            ratios.update({f"decode_b{b}_vs_{base}": d[b] / results[base]["decode_ms"][b] for b in batch_sizes})
            ratios.update({f"prefill_{length}_vs_{base}": results[n]["prefill_tok_s"][length]
                           / results[base]["prefill_tok_s"][length] for length in prompt_lens})
        results[n]["ratios"] = ratios
    return {"model": results[base]["model"], "threads": torch.get_num_threads(), "rounds": rounds,
            "read_gb_s": read_bw / 1e9, "baseline": base, "weights": names, "results": results}
