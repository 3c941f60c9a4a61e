"""Every family through real worker processes and a real Redis: a prefill worker and a decode
worker (over shared memory, the TCP data wire and ZeroMQ), a colocated worker, prompts placed
on a decode worker, and the prefix cache must each give transformers' greedy tokens
(tests/hf_models.py), token for token: PD == colocated == transformers.
"""

from __future__ import annotations

import pytest

from pdqueue.client import Client
from pdqueue.protocol.compat import compat_of
from tests import hf_models, run_cache
from tests.helpers import FAST, wait_for, wait_pools_free, wait_takes_prompts

pytest.importorskip("transformers")

# One case per family (the rope variants are covered in-process by tests/test_families.py).
FAMILY_CASES = ("llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral")
PROMPTS = ["The quick brown fox jumps over the lazy dog, then runs away into the forest.",
           "Hello", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def checkpoints():
    """case -> its directory, built when first asked for, once per test run (shared by the
    run's xdist workers and the other family modules: tests/run_cache.py)."""
    return run_cache.Lazy(hf_models.checkpoint)


@pytest.fixture(scope="module")
def expected():
    """case -> transformers' greedy continuation of each prompt (computed once per run)."""
    tok = hf_models.smollm2_tokenizer()
    return run_cache.Lazy(lambda case: [hf_models.greedy(case, tok.encode(p), MAX_TOKENS) for p in PROMPTS])


def answers(cluster, prompts=PROMPTS) -> list:
    client = Client(cluster.redis_url, cluster.cluster)
    handles = client.submit_many([dict(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                                  for p in prompts])
    return [h.result(timeout=120) for h in handles]


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_prefill_and_decode_workers_answer_as_transformers(cluster, checkpoints, expected, case):
    """Over shared memory; a prompt sent again finds its blocks in the prefix cache and still
    answers the same."""
    cluster.model = str(checkpoints[case])
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
    results = answers(cluster)
    assert [list(r.token_ids) for r in results] == expected[case]
    assert {r.transfer_path for r in results} == {"shm"}
    again = answers(cluster, PROMPTS[:1])[0]
    assert list(again.token_ids) == expected[case][0]
    assert again.cached_tokens > 0   # the prompt's full blocks came from the prefix cache
    wait_pools_free(cluster)


@pytest.mark.parametrize("case", ["gemma2", "phi3", "qwen3_moe"])
@pytest.mark.parametrize("transfer", ["tcp", "zmq"])
def test_the_network_kv_paths_answer_as_transformers(cluster, checkpoints, expected, case, transfer):
    cluster.model = str(checkpoints[case])
    cluster.start_together(("prefill", *FAST, "--transfer", transfer, {"worker_id": "p0"}),
                           ("decode", *FAST, "--transfer", transfer, {"worker_id": "d0"}))
    results = answers(cluster)
    assert [list(r.token_ids) for r in results] == expected[case]
    assert {r.transfer_path for r in results} == {transfer}
    wait_pools_free(cluster)


@pytest.mark.parametrize("case", ["gemma3", "mixtral", "qwen2"])
def test_a_colocated_worker_and_placed_prompts_answer_as_transformers(cluster, checkpoints, expected, case):
    cluster.model = str(checkpoints[case])
    cluster.start("colocated", *FAST, worker_id="c0")
    assert [list(r.token_ids) for r in answers(cluster)] == expected[case]
    cluster.stop("c0")
    # A prefill worker that places every prompt on a decode worker, which prefills it itself.
    cluster.start_together(("prefill", *FAST, "--placement", "always", {"worker_id": "p0"}),
                           ("decode", *FAST, "--take-prompts", "--policy", "chunked", "--tbt-slo-ms", "200",
                            {"worker_id": "d0"}))
    wait_takes_prompts(cluster)
    results = answers(cluster)
    assert [list(r.token_ids) for r in results] == expected[case]
    assert any(r.prefill_worker == cluster.id("d0") for r in results)   # placed, and prefilled there
    wait_pools_free(cluster)


def test_a_decode_worker_of_other_weights_gets_no_handoff_and_the_requests_wait_for_their_own(
        cluster, checkpoints, expected, tmp_path):
    """Prefill and decode workers that load different weights of the same shape (a cluster
    half-way through a model change): none is decoded from KV its weights did not compute and
    none fails. They wait (the prefill worker says so once, in its log and its heartbeat) in
    the stream of its kind, and a decode worker of its weights answers them as transformers."""
    other = hf_models.build("qwen3", tmp_path / "qwen3-other", seed=1)
    cluster.model = str(other)
    cluster.start("decode", *FAST, worker_id="d1")
    cluster.model = str(checkpoints["qwen3"])
    cluster.start("prefill", *FAST, worker_id="p0")
    wait_for(lambda: cluster.workers()["p0"]["load"].get("no_compatible_decode") == 1, what="p0: nobody serves it")
    kind = compat_of(cluster.workers()["p0"])
    client = Client(cluster.redis_url, cluster.cluster)
    handles = client.submit_many([dict(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                                  for p in PROMPTS])
    wait_for(lambda: cluster.r.xlen(cluster.keys.handoff_compat(kind.key)) == len(PROMPTS), what="the handoffs waiting")
    assert cluster.r.xlen(cluster.keys.done) == cluster.r.xlen(cluster.keys.dead) == 0   # none answered, none failed
    cluster.start("decode", *FAST, worker_id="d0")
    results = [h.result(timeout=120) for h in handles]
    assert [list(r.token_ids) for r in results] == expected["qwen3"]
    assert {r.decode_worker for r in results} == {cluster.id("d0")}
    log = (cluster.log_dir / "p0.log").read_text(errors="replace")
    assert log.count(f"decode worker {cluster.id('d1')} is not compatible") == 1
    assert log.count("no live decode worker is compatible") == 1
    wait_pools_free(cluster)


def test_a_chat_runs_through_the_familys_template(cluster, checkpoints, tmp_path):
    """Messages sent to Gemma-3 prefill and decode workers are rendered with the checkpoint's
    template (Gemma's: the system prompt folded into the first user turn) and answered as
    transformers answers its own apply_chat_template's ids."""
    import json
    import shutil

    import transformers

    from tests.chat_templates import GEMMA

    model = tmp_path / "gemma3-chat"
    shutil.copytree(checkpoints["gemma3"], model)
    (model / "chat_template.jinja").write_text(GEMMA)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected = hf_models.hf_greedy(model, ids, MAX_TOKENS)
    assert json.loads((model / "config.json").read_text())["model_type"] == "gemma3_text"
    cluster.model = str(model)
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
    client = Client(cluster.redis_url, cluster.cluster)
    result = client.submit(messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).result(60)
    assert result.num_prompt_tokens == len(ids)
    assert list(result.token_ids) == expected
    wait_pools_free(cluster)


@pytest.mark.parametrize("case", ["gemma2", "qwen3_moe"])
def test_running_decodes_migrate_with_their_kv_and_answer_as_transformers(cluster, checkpoints, case):
    """A decode worker warm-stopped mid-answer moves its running requests, KV included, to the
    other decode worker; the answers are still transformers' tokens."""
    import signal

    from tests.test_migration import moved_by, out_of

    long = 400
    tok = hf_models.smollm2_tokenizer()
    want = [hf_models.greedy(case, tok.encode(p), long) for p in PROMPTS]
    cluster.model = str(checkpoints[case])
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}),
                           ("decode", *FAST, {"worker_id": "d1"}))
    client = Client(cluster.redis_url, cluster.cluster)
    handles = client.submit_many([dict(prompt=p, max_tokens=long, temperature=0.0, ignore_eos=True)
                                  for p in PROMPTS])

    def holder():
        if not all(len(out_of(cluster, h.request_id)) > 3 for h in handles):
            return None
        workers = cluster.workers()
        return next((d for d in ("d0", "d1") if workers[d]["load"].get("running", 0) > 0), None)

    stopping = wait_for(holder, what="tokens flowing, some on a decode worker")
    cluster.signal(stopping, signal.SIGTERM)
    assert cluster.procs[stopping].wait(timeout=30) == 0
    results = [h.result(timeout=120) for h in handles]
    assert [list(r.token_ids) for r in results] == want
    assert moved_by(cluster, stopping) > 0, cluster.log(stopping)
    wait_pools_free(cluster)


@pytest.mark.parametrize("case", ["qwen2", "gemma3"])
@pytest.mark.parametrize("weights", ["int8", "q4_1"])
def test_quantized_workers_answer_as_the_quantized_engine(cluster, checkpoints, case, weights):
    """Prefill and decode workers with quantized weights (Qwen2's biases kept in float; Gemma's
    layer on torch's ops under q4_1) answer as pdqueue's own engine on the same weights."""
    from pdqueue.engine.config import EngineConfig
    from pdqueue.engine.llm_engine import LLMEngine
    from pdqueue.engine.sampling import SamplingParams
    from pdqueue.models.loader import load_model
    from tests.oracle import assert_same_tokens

    loaded = load_model(checkpoints[case], weights=weights, use_cache=False)
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = LLMEngine(loaded, EngineConfig(model=str(checkpoints[case]), kv_cache_mb=16)).generate(ids, greedy)
    cluster.model = str(checkpoints[case])
    cluster.start_together(("prefill", *FAST, "--weights", weights, {"worker_id": "p0"}),
                           ("decode", *FAST, "--weights", weights, {"worker_id": "d0"}))
    for pid, exp, res in zip(ids, want, answers(cluster)):
        assert_same_tokens(loaded, pid, exp, list(res.token_ids), greedy)
    wait_pools_free(cluster)


def test_a_sliding_window_model_moves_only_the_blocks_its_window_reads(cluster, checkpoints):
    """Mistral with an 8-token window in every layer: a 70-token prompt's handoff copies the
    last blocks only, not all five, and still answers as transformers; a second prompt that
    shares its first 36 tokens (on the same decode worker, its window reaching back into the
    second block) is not served the blocks left unfilled there (they are never named in its
    prefix cache)."""
    tok = hf_models.smollm2_tokenizer()
    directory = checkpoints["mistral"]
    ids = tok.encode(" ".join(f"word{i}" for i in range(40)))[:70]
    shorter = ids[:36]
    assert len(ids) == 70
    want = [hf_models.hf_greedy(directory, p, MAX_TOKENS) for p in (ids, shorter)]
    cluster.model = str(directory)
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
    client = Client(cluster.redis_url, cluster.cluster)
    results = []
    for prompt_ids in (ids, shorter):
        results.append(client.submit(prompt_ids=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0,
                                     ignore_eos=True).result(60))
    assert [list(r.token_ids) for r in results] == want
    token_bytes = 4 * 2 * 2 * 16 * 4   # layers x (K, V) x KV heads x head_dim x float32
    full = -(-70 // 16) * 16 * token_bytes
    # (70 - 8) // 16 = 3: blocks 3 and 4 (positions 48-79) of the five travel
    assert results[0].transfer_bytes == 2 * 16 * token_bytes < full
    assert results[1].kv_reused_tokens == 0 and results[1].transfer_bytes > 0
    print(f"a 70-token prompt's handoff: {results[0].transfer_bytes} bytes moved, {full} with every block")
    wait_pools_free(cluster)
