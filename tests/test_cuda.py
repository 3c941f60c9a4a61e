"""The accelerator paths: the padded decode step that CUDA graphs replay (checked on CPU too,
against the paged step), graph replays against eager steps, and real workers with a CUDA
pool: GPU prefill -> CPU decode over the default path and over NIXL (device memory), CPU
prefill -> GPU decode.

The CUDA tests skip where torch sees no CUDA device (CI has none); scripts/device-check runs
them on a machine with one.
"""

from __future__ import annotations

import pytest
import torch

from pdqueue.engine.config import EngineConfig
from pdqueue.engine.cuda_graphs import GraphedDecode, padded_decode, padded_inputs
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.models.loader import load_model
from tests.helpers import mixed_prompts
from tests.oracle import assert_same_tokens

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device here (scripts/device-check runs these on one)")
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts(tiny, n: int, seed: int = 3) -> list[list[int]]:
    return [tiny.tokenizer.encode(p) for p in mixed_prompts(n, seed)]


def _prefilled(tiny, device: str, prompts: list[list[int]], **config) -> LLMEngine:
    """An engine holding ``prompts`` prefilled (one token each), so the next step is a decode step."""
    engine = LLMEngine(tiny, EngineConfig(model="tiny", device=device, kv_cache_mb=16, **config))
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY)
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.running) or engine.num_waiting:
        engine.step()
    return engine


def test_the_padded_decode_step_computes_the_paged_steps_logits_and_kv(tiny):
    """What a graph replays (``padded_decode_logits`` over ``padded_inputs``: a batch of 5
    padded to 8 rows, tables padded to 32 blocks) against the paged decode step on copies of
    the same pool: the same logits, the same K/V written, and the padded rows write nothing
    of their own."""
    prompts = _prompts(tiny, 5)
    engine = _prefilled(tiny, "cpu", prompts)
    batch = engine.scheduler.schedule()   # the decode step, its new slots allocated
    assert len(batch) == 5 and all(n == 1 for _, n in batch)
    before = engine.kv_cache.clone()
    paged_logits, _ = engine.runner.run(batch)
    paged_pool = engine.kv_cache.clone()
    engine.kv_cache.copy_(before)
    static = torch.tensor(padded_inputs(batch, 8, 32, engine.config.block_size))
    ids, positions, padded = padded_decode(static, 32)
    with torch.inference_mode():
        logits = tiny.model.padded_decode_logits(ids, positions, padded, engine.kv_cache)
    torch.testing.assert_close(logits[:5], paged_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[5:], logits[:1].expand(3, -1))   # padded rows repeat row 0
    torch.testing.assert_close(engine.kv_cache, paged_pool, rtol=1e-5, atol=1e-5)
    assert not torch.equal(paged_pool, before)   # the step did write K/V


def test_graphed_decode_is_off_where_it_cannot_run(tiny):
    engine = LLMEngine(tiny, EngineConfig(model="tiny", kv_cache_mb=16))
    assert engine.runner.graphs is None   # CPU
    assert not GraphedDecode.usable(tiny.model, torch.device("cpu"))


@needs_cuda
def test_cuda_graph_decode_replays_give_the_eager_steps_tokens(tiny):
    """12 greedy requests decoded 40 tokens on the GPU, from graph replays and eagerly: the
    same tokens; several graphs (the batch shrinks as requests finish, contexts grow across
    block buckets); each answer the CPU engine's up to near-tie flips."""
    prompts = _prompts(tiny, 12)
    max_tokens = [8 + 3 * i for i in range(12)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    on_gpu = load_model("tiny", device="cuda")
    graphed = LLMEngine(on_gpu, EngineConfig(model="tiny", device="cuda", kv_cache_mb=16))
    eager = LLMEngine(on_gpu, EngineConfig(model="tiny", device="cuda", kv_cache_mb=16, cuda_graphs=False))
    cpu = LLMEngine(tiny, EngineConfig(model="tiny", kv_cache_mb=16))
    got = graphed.generate(prompts, params)
    want = eager.generate(prompts, params)
    reference = cpu.generate(prompts, params)
    assert graphed.runner.graphs.replays > 20 and len(graphed.runner.graphs.graphs) >= 3
    assert eager.runner.graphs is None
    assert got == want
    for ids, ref, tokens in zip(prompts, reference, got):
        assert_same_tokens(tiny, ids, ref, tokens)


# -- real workers with a CUDA pool -------------------------------------------------------------

@pytest.fixture
def workers(redis_url, tmp_path):
    from tests.cluster import Cluster

    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_and_check()


def _start(workers, role: str, *args: str, name: str) -> None:
    # A process of its own (not forked from the test's forkserver): CUDA does not survive a fork.
    workers.start(role, *args, worker_id=name, fork=False)


@needs_cuda
@pytest.mark.parametrize("prefill_args,decode_args,path", [
    (("--device", "cuda"), (), None),                                               # GPU prefill -> CPU decode
    (("--device", "cuda", "--transfer", "nixl"), ("--transfer", "nixl"), "nixl"),    # NIXL reads device memory
    ((), ("--device", "cuda"), None),                                               # CPU prefill -> GPU decode
], ids=["gpu-prefill-cpu-decode", "gpu-prefill-nixl-vram", "cpu-prefill-gpu-decode"])
def test_workers_with_a_cuda_pool_answer_as_the_colocated_engine(workers, tiny, prefill_args, decode_args, path):
    from tests.test_pipeline import run_and_compare

    if path == "nixl":
        from pdqueue.transfer.nixl import nixl_missing

        if nixl_missing():
            pytest.skip(nixl_missing())
    _start(workers, "prefill", *prefill_args, name="p0")
    _start(workers, "decode", *decode_args, name="d0")
    results = run_and_compare(workers, tiny, n=8, expect_path=path)
    paths = {r.transfer_path for r in results} - {"cache"}
    print(f"transfer paths: {sorted(paths)}")
    assert "recompute" not in paths, paths
