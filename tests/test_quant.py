"""Quantized weights (pdqueue/models/quant.py, `--weights`): the layers' arithmetic, the
model and engine with them, and the pipeline with the same or different weights per role.

Across precisions tokens differ (the tiny model's greedy outputs differ for every prompt
between fp32 and int8), so only same-weights runs are compared token for token; the
mixed pipeline (fp32 prefill, int8 decode) is compared with the same mix run in this
process (fp32 prefill engine, its KV copied into an int8 decode engine).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdqueue.client import Client
from pdqueue.engine.config import WEIGHT_FORMATS, EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.models import quant
from pdqueue.models.loader import load_model
from tests.cluster import Cluster
from tests.helpers import mixed_prompts, oracle, wait_pools_free
from tests.oracle import assert_same_tokens

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_int8():
    return load_model("tiny", weights="int8")


@pytest.fixture(scope="module")
def tiny_int4():
    return load_model("tiny", weights="int4")


@pytest.fixture(scope="module")
def tiny_q4_1():
    return load_model("tiny", weights="q4_1")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


def outlier_rows(n: int = 9, k: int = 576, seed: int = 0) -> torch.Tensor:
    """Activations like SmolLM2's: a few channels 50x the rest, rows of different scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen)
    x[:, [5, 77, 300]] *= 50
    x[3] *= 1000
    x[4] *= 1e-3
    return x


def test_weight_formats_agree():
    assert WEIGHT_FORMATS == quant.WEIGHT_FORMATS == ("fp32", "int8", "int4", "q4_1")


@pytest.mark.parametrize("make", [quant.Int8Linear, quant.Int4Linear])
def test_quantized_rows_do_not_depend_on_the_batch(make):
    """Each row's result is bit-identical alone and inside any batch (so a prompt's KV and
    a sequence's logits do not depend on what else is in the step)."""
    w = torch.randn(304, 576, generator=torch.Generator().manual_seed(1)) * 0.05
    layer, x = make(w), outlier_rows()
    with torch.inference_mode():
        full = layer(x)
        assert all(torch.equal(full[i], layer(x[i:i + 1])[0]) for i in range(len(x)))
        assert torch.equal(full[2:6], layer(x[2:6]))


def test_int8_activations_keep_about_16_bits():
    """Weights already on an int8 per-row grid: the only error left is the activations'.
    Plain 8-bit activations (fbgemm's per-matrix range) are ~1e-2 off on these rows; the
    grid + remainder split must be far closer."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (304, 576), generator=gen).float() * (torch.rand(304, 1, generator=gen) * 0.01)
    w[:, 0] = 127 * (w.abs().amax(1) / 127).clamp(min=1e-6)   # every row reaches its scale exactly
    layer, x = quant.Int8Linear(w), outlier_rows()
    with torch.inference_mode():
        y, ref = layer(x), x @ w.T
        assert rel_err(y, ref) < 1e-3, rel_err(y, ref)
        for i in range(len(x)):   # per row too: the tiny row is not swamped by the huge one
            assert rel_err(y[i], ref[i]) < 1e-3, (i, rel_err(y[i], ref[i]))
        plain = torch.ops.quantized.linear_dynamic(x, layer._packed, False)
        assert rel_err(plain, ref) > 10 * rel_err(y, ref)


def test_int4_recovers_q4_1_blocks():
    """Weights that are GGUF Q4_1 blocks (d * q + m, q in 0..15, 32 per block, d and m
    exact in bf16) come out of the 4-bit layer as they went in: the only error left is
    bf16 activations. Off-grid weights are ~7% off, so this fails if scale, zero or the
    packing were wrong."""
    gen = torch.Generator().manual_seed(3)
    n, k = 304, 576
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15   # each block spans its whole range, as llama.cpp's quantizer makes it
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 0.001).bfloat16().float()
    m = (-8 * d + (torch.rand(n, k // 32, 1, generator=gen) - 0.5) * 0.01).bfloat16().float()
    w = (d * q + m).reshape(n, k)
    layer, x = quant.Int4Linear(w), outlier_rows()
    with torch.inference_mode():
        ref = x.bfloat16().float() @ w.T
        assert rel_err(layer(x), ref) < 1e-2, rel_err(layer(x), ref)
        off_grid = quant.Int4Linear(w + torch.randn(n, k, generator=gen) * 0.003)
        assert rel_err(off_grid(x), ref) > 3 * rel_err(layer(x), ref)


def test_int4_shape_errors_say_why():
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.Int4Linear(torch.randn(300, 64))
    with pytest.raises(ValueError, match="group size 32"):
        quant.Int4Linear(torch.randn(304, 48))


@pytest.mark.parametrize("weights", ["int8", "int4", "q4_1"])
def test_quantized_tiny_model_is_close_and_smaller(tiny, weights):
    loaded = load_model("tiny", weights=weights)
    assert loaded.weights == weights == loaded.model.weights_format
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears, "every linear layer is quantized"
    assert isinstance(loaded.model.logits_head, quant.Q80Linear if weights == "q4_1" else quant.Int8Linear)
    ids = torch.tensor(loaded.tokenizer.encode("the quick brown fox jumps over a lazy dog"))
    with torch.inference_mode():
        ref, got = tiny.model.dense_logits(ids), loaded.model.dense_logits(ids)
    # The tiny model is chaotic (sharp random attention): int8 is 0.10 off, int4 and q4_1 0.66
    # (weights far from any 4-bit grid); unrelated logits would be ~1.4 off. SmolLM2: the slow
    # test below.
    assert rel_err(got, ref) < (0.2 if weights == "int8" else 0.9), rel_err(got, ref)
    ratio = quant.step_weight_bytes(loaded.model) / quant.step_weight_bytes(tiny.model)
    assert ratio < (0.3 if weights == "int8" else 0.2), ratio


@pytest.mark.parametrize("weights", ["int8", "int4", "q4_1"])
def test_paged_engine_matches_dense_reference_with_quantized_weights(weights):
    """The engine (paged KV, batched steps) against the same model's cache-free dense
    forward, greedy: the quantized layers behave the same inside a batch as alone."""
    loaded = load_model("tiny", weights=weights)
    engine = LLMEngine(loaded, EngineConfig(model="tiny", kv_cache_mb=16, weights=weights))
    prompts = [loaded.tokenizer.encode(p) for p in mixed_prompts(6)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ctx = list(prompt)
        expected = []
        with torch.inference_mode():
            for _ in range(8):
                expected.append(int(loaded.model.dense_logits(torch.tensor(ctx))[-1].argmax()))
                ctx.append(expected[-1])
        assert_same_tokens(loaded, prompt, expected, out)


@pytest.mark.slow
def test_smollm2_quantized_stays_close(smollm2):
    """SmolLM2 on a short text: the per-token KL from float32 stays small (measured: int8
    0.006, int4 0.001; plain 8-bit activations gave 0.096, a 4-bit LM head 0.05)."""
    ids = torch.tensor(smollm2.tokenizer.encode(
        "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
        "it was the season of Darkness, it was the spring of hope, it was the winter of despair."))
    with torch.inference_mode():
        ref = F.log_softmax(smollm2.model.dense_logits(ids), -1)
        for weights, bound in (("int8", 0.02), ("int4", 0.01), ("q4_1", 0.02)):
            got = F.log_softmax(load_model("smollm2", weights=weights).model.dense_logits(ids), -1)
            kl = float((ref.exp() * (ref - got)).sum(-1).mean())
            assert 0 < kl < bound, (weights, kl)


def test_prefix_cache_root_includes_the_weights(tiny, tiny_int8, tiny_int4, tiny_q4_1):
    roots = {w: LLMEngine(m, EngineConfig(model="tiny", kv_cache_mb=4)).block_manager.root
             for w, m in (("fp32", tiny), ("int8", tiny_int8), ("int4", tiny_int4), ("q4_1", tiny_q4_1))}
    assert len(set(roots.values())) == 4, roots


def test_engine_config_checks_the_weights():
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int9")
    with pytest.raises(ValueError, match="float32 only"):
        EngineConfig(weights="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="int4"):
        load_model("tiny", weights="int4", device="meta")


# ---- the pipeline ------------------------------------------------------------------------

def greedy(n: int) -> list[dict]:
    return [{"max_tokens": MAX_TOKENS, "temperature": 0.0, "seed": 0, "ignore_eos": True}] * n


def submit_all(cluster: Cluster, prompts: list[str], params: list[dict]):
    client = Client(cluster.redis_url, cluster.cluster)
    handles = client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])
    return [h.result(timeout=120) for h in handles]


@pytest.mark.parametrize("weights", ["int8", "int4", "q4_1"])
def test_pipeline_with_quantized_weights_matches_colocated(cluster, weights, request):
    """Both roles quantized alike: the disaggregated pipeline returns the colocated engine's
    tokens (same weights) token for token, and the heartbeats show the weights."""
    loaded = request.getfixturevalue(f"tiny_{weights}")
    cluster.start_together(("prefill", "--weights", weights, {"worker_id": "prefill0"}),
                           ("decode", "--weights", weights, {"worker_id": "decode0"}))
    assert {w["weights"] for w in cluster.workers().values()} == {weights}
    prompts = mixed_prompts(8)
    params = greedy(8)
    prompt_ids, expected, sampling = oracle(loaded, prompts, params)
    results = submit_all(cluster, prompts, params)
    for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
        assert res.transfer_path == "shm"
        assert_same_tokens(loaded, pid, exp, list(res.token_ids), sp)
    wait_pools_free(cluster)


def mixed_oracle(prefill_loaded, decode_loaded, prompt_ids: list[list[int]], params: SamplingParams):
    """fp32 prefill, int8 decode, in this process as the workers do it: the prefill engine
    computes the prompt's KV and first token; the blocks are copied into the decode engine's
    pool (reserve, copy, add_prefilled) and it generates the rest."""
    config = EngineConfig(model="tiny", kv_cache_mb=16)
    prefill = LLMEngine(prefill_loaded, config, prefill_only=True)
    decode = LLMEngine(decode_loaded, config.with_(weights=decode_loaded.weights))
    outputs = {}
    for i, ids in enumerate(prompt_ids):
        rid = f"m{i}"
        prefill.add_request(rid, ids, params)
        (first,) = [o for o in prefill.step() if o.request_id == rid]
        seq = decode.kv_import.reserve(rid, ids, params, [first.token_id])
        src, dst = first.detached_blocks, seq.block_table[:len(first.detached_blocks)]
        decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]
        prefill.free_blocks(src)
        decode.kv_import.add_prefilled(seq)
        outputs[rid] = [first.token_id]
    while decode.has_unfinished:
        for out in decode.step():
            outputs[out.request_id].append(out.token_id)
    return [outputs[f"m{i}"] for i in range(len(prompt_ids))]


def status_text(cluster: Cluster) -> str:
    """What `pdqueue status` draws for the cluster."""
    from rich.console import Console

    from workers.cli import status_view

    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    console.print(status_view.render(status_view.collect(cluster.r, cluster.keys)))
    console.file.close()
    return console.export_text()


def test_fp32_prefill_int8_decode_end_to_end(cluster, tiny, tiny_int8):
    """A float32 prefill worker hands its KV to an int8 decode worker: every request
    finishes, the first token is float32's and the rest is what int8 decodes from that
    KV (the same mix run in this process); the outputs are not all-float32's, so the
    decode worker really used its own weights."""
    cluster.start_together(("prefill", {"worker_id": "prefill0"}),
                           ("decode", "--weights", "int8", {"worker_id": "decode0"}))
    assert {n: w["weights"] for n, w in cluster.workers().items()} == {"prefill0": "fp32", "decode0": "int8"}
    assert "int8" in status_text(cluster) and "fp32" in status_text(cluster)
    prompts = mixed_prompts(8)
    params = greedy(8)
    prompt_ids, all_fp32, sampling = oracle(tiny, prompts, params)
    expected = mixed_oracle(tiny, tiny_int8, prompt_ids, sampling[0])
    assert expected != all_fp32, "the mix must differ from all-fp32 for this test to tell them apart"
    results = submit_all(cluster, prompts, params)
    for pid, exp, fp, res in zip(prompt_ids, expected, all_fp32, results):
        got = list(res.token_ids)
        assert len(got) == MAX_TOKENS and res.transfer_path == "shm"
        assert_same_tokens(tiny, pid, fp[:1], got[:1])              # the prefill worker's token
        assert_same_tokens(tiny_int8, pid, exp, got)
    wait_pools_free(cluster)


# ---- the commands --------------------------------------------------------------------------

def pdq(*args: str, timeout: float = 120):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_") or k == "PDQ_CACHE_DIR"}
    return subprocess.run([sys.executable, "-m", "workers", *args], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parent.parent, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.processes
def test_bench_engine_reports_quantized_beside_fp32():
    import json

    result = pdq("bench", "engine", "--model", "tiny", "--threads", "1", "--kv-cache-mb", "16", "--weights", "int8",
                 "--prompt-lens", "32", "--batch-sizes", "1,2", "--rounds", "1", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["weights"] == ["fp32", "int8"] and out["baseline"] == "fp32"
    fp32, int8 = out["results"]["fp32"], out["results"]["int8"]
    assert (fp32["weights"], int8["weights"]) == ("fp32", "int8")
    assert int8["weight_bytes"] < fp32["weight_bytes"] / 3
    assert set(int8["decode_ms"]) == {"1", "2"} and set(int8["prefill_tok_s"]) == {"32"}
    assert out["decode_b1_vs_fp32"] == pytest.approx(int8["decode_ms"]["1"] / fp32["decode_ms"]["1"])
    assert {"decode_b2_vs_b1", "prefill_32_vs_fp32"} <= set(int8["ratios"])


@pytest.mark.processes
def test_bench_engine_compares_any_formats_and_reports_the_q4_1_kernel():
    import json

    result = pdq("bench", "engine", "--model", "tiny", "--threads", "1", "--kv-cache-mb", "16", "--formats",
                 "int4,q4_1", "--prompt-lens", "32", "--batch-sizes", "1,2", "--rounds", "1", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["weights"] == ["int4", "q4_1"] and out["baseline"] == "int4"
    assert {"decode_b1_vs_int4", "prefill_32_vs_int4"} <= set(out["results"]["q4_1"]["ratios"])
    assert all(out["results"][n]["load_s"] > 0 for n in ("int4", "q4_1"))
    assert all(out["results"][n]["first_step_ms"][k] > 0 for n in ("int4", "q4_1") for k in ("prefill", "decode"))
    assert out["q4_1_kernel"]["isa"] in ("avx2", "avx512-vnni") or out["q4_1_kernel"]["isa"].startswith("reference")


@pytest.mark.parametrize("args,needle", [
    (["bench", "engine", "--model", "tiny", "--formats", "fp32"], "--formats"),
    (["bench", "engine", "--model", "tiny", "--formats", "fp32,int9"], "--formats"),
    (["generate", "hi", "--model", "tiny", "--weights", "int8", "--dtype", "bfloat16"], "float32 only"),
    (["worker", "decode", "--model", "tiny", "--weights", "int5"], "--weights"),
    (["bench", "quality", "--model", "tiny", "--formats", "fp32,int3"], "--formats"),
])
@pytest.mark.processes
def test_weights_option_errors_are_one_line(args, needle):
    result = pdq(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


def test_greedy_agreement_counts():
    from pdqueue.bench.quality import agreement

    got = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 0, 4], [5, 6, 7, 8]])
    assert got == {"greedy_token_agreement": 7 / 8, "greedy_prefix_match": (2 / 4 + 1) / 2,
                   "greedy_identical": 0.5}
