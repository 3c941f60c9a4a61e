"""The engine end to end on real models (``tiny`` and SmolLM2), no mocks.

What must hold:
- batch invariance: a request's tokens do not depend on what shares its batches (greedy and
  seeded sampling);
- policies: ``prefill_first`` and ``chunked`` (prompts split across steps) agree;
- preemption by recompute: a pool too small for everyone still finishes every request with
  the same tokens, and leaks no block;
- text: stop strings end the output and are cut from it, streamed deltas add up to the final
  text and never run past a stop string, finish reasons (EOS -> stop, max_tokens -> length),
  abort frees blocks;
- the prefill-only role plus ``reserve``/``add_prefilled`` on a second engine (the
  disaggregated path without Redis) gives the colocated engine's output.

Token lists are compared with ``tests.oracle.assert_same_tokens``: equal, or differing first
at a near-tie (within 1e-3 of the logit scale) that BLAS noise across batch shapes can flip.
Accepted flips are counted and reported as warnings.

All engines here run with one torch thread (set and restored by a fixture): on a shared
2-core machine two OpenMP threads that wait on each other are 3-5x slower.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdqueue.engine.config import EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.output import OutputText
from pdqueue.engine.sampling import SamplingParams
from pdqueue.models.tokenizer import ByteTokenizer
from pdqueue.protocol import ServiceClass
from tests.oracle import FLIPS, TOL, assert_all_same, assert_same_tokens

BLOCK_SIZE = 16
TINY_LENS = [3, 7, 16, 17, 33, 64, 100, 150]
TINY_MAX_TOKENS = 16
SMOL_MAX_TOKENS = 12
SMOL_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite fruit is the banana because",
    "In 1969, the first humans",
    "A haiku about autumn:",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread."""


def engine(loaded, prefill_only: bool = False, **overrides) -> LLMEngine:
    fields = dict(model=loaded.config.name, block_size=BLOCK_SIZE, num_blocks=128)
    fields.update(overrides)
    return LLMEngine(loaded, EngineConfig(**fields), prefill_only=prefill_only)


def tiny_prompts(lens=TINY_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in lens]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def sampled(max_tokens: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, top_k=50, seed=seed, **kw)


def params_for(kind: str, n: int, max_tokens: int) -> list[SamplingParams]:
    if kind == "greedy":
        return [greedy(max_tokens)] * n
    return [sampled(max_tokens, seed=1000 + 7 * i) for i in range(n)]


def alone(eng: LLMEngine, prompts, params) -> list[list[int]]:
    """Each request run by itself (one engine, one request at a time)."""
    out = [eng.generate([p], [q])[0] for p, q in zip(prompts, params)]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return out


def run_collect(eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Step to completion; returns {request_id: [StepOutput, ...]}."""
    outs = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    while eng.has_unfinished:
        for out in eng.step():
            outs[out.request_id].append(out)
    return outs


def report_flips(label: str, flips: int, total: int) -> None:
    print(f"\n{label}: {flips} near-tie flip(s) in {total} requests (tol {TOL} x logit scale)")


# --- batch invariance ----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_tiny_batch_invariance(tiny, kind):
    prompts = tiny_prompts()
    params = params_for(kind, len(prompts), TINY_MAX_TOKENS)
    together = engine(tiny).generate(prompts, params)
    assert all(len(t) == TINY_MAX_TOKENS or t[-1] in tiny.config.eos_token_ids for t in together)
    assert len({tuple(t) for t in together}) == len(prompts)  # outputs vary: a real check
    flips = assert_all_same(tiny, prompts, alone(engine(tiny), prompts, params), together, params,
                            label=f"tiny {kind} alone vs together")
    report_flips(f"tiny {kind} batch invariance", flips, len(prompts))


@pytest.fixture(scope="module")
def smol_runs(smollm2):
    """SmolLM2's 8 prompts (even ones greedy, odd ones sampled) generated together."""
    prompts = [smollm2.tokenizer.encode(p) for p in SMOL_PROMPTS]
    params = [greedy(SMOL_MAX_TOKENS) if i % 2 == 0 else sampled(SMOL_MAX_TOKENS, seed=1000 + i)
              for i in range(len(prompts))]
    together = engine(smollm2, num_blocks=64).generate(prompts, params)
    return prompts, params, together


@pytest.mark.slow
def test_smollm2_batch_invariance(smollm2, smol_runs):
    prompts, params, together = smol_runs
    greedy_text = smollm2.tokenizer.decode(together[0])
    assert "Paris" in greedy_text, greedy_text
    flips = assert_all_same(smollm2, prompts, alone(engine(smollm2, num_blocks=64), prompts, params), together,
                            params, label="smollm2 alone vs together")
    report_flips("smollm2 batch invariance", flips, len(prompts))


# --- policies ------------------------------------------------------------------------

def generate_chunked(loaded, prompts, params, budget: int = 32, **overrides) -> tuple[list[list[int]], int]:
    """Generate with the chunked policy, checking every step keeps to the token budget and
    that prompts really were split; returns (outputs, number of steps)."""
    eng = engine(loaded, policy="chunked", max_num_batched_tokens=budget, **overrides)
    ids = [f"r{i}" for i in range(len(prompts))]
    results = {rid: [] for rid in ids}
    for rid, p, q in zip(ids, prompts, params):
        eng.add_request(rid, p, q)
    steps, split = 0, False
    while eng.has_unfinished:
        before = eng.stats.num_tokens
        partial = [s for s in eng.scheduler.running if s.num_uncomputed_tokens > 1]
        for out in eng.step():
            results[out.request_id].append(out.token_id)
        steps += 1
        assert eng.stats.num_tokens - before <= budget
        split = split or any(0 < s.num_cached_tokens < s.num_prompt_tokens for s in partial)
    assert split or max(map(len, prompts)) <= budget, "no prompt was prefilled in chunks"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return [results[rid] for rid in ids], steps


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_tiny_policies_agree(tiny, kind):
    prompts = tiny_prompts(seed=1)
    params = params_for(kind, len(prompts), TINY_MAX_TOKENS)
    first = engine(tiny, policy="prefill_first").generate(prompts, params)
    chunked, _ = generate_chunked(tiny, prompts, params, budget=32)
    flips = assert_all_same(tiny, prompts, first, chunked, params, label=f"tiny {kind} prefill_first vs chunked")
    report_flips(f"tiny {kind} policies", flips, len(prompts))


def test_the_engine_sets_its_tbt_target_through_one_setter(tiny):
    """``LLMEngine.set_tbt_target``: the chunked policy's scheduler takes the new target (None:
    none); another policy, or a target <= 0, is refused and leaves it as it was."""
    eng = engine(tiny, policy="chunked", tbt_slo_ms=200.0)
    eng.set_tbt_target(120.0)
    assert (eng.scheduler.tbt.target_ms, eng.scheduler.tbt.target_s) == (120.0, 0.12)
    with pytest.raises(ValueError):
        eng.set_tbt_target(0)
    assert eng.scheduler.tbt.target_ms == 120.0
    eng.set_tbt_target(None)
    assert eng.scheduler.tbt.step_s is None
    with pytest.raises(ValueError, match="chunked policy"):
        engine(tiny, policy="prefill_first").set_tbt_target(100.0)


def test_tiny_tbt_budget_cuts_chunks_and_keeps_the_tokens(tiny):
    """Prompts that arrive while others decode, under a TBT target no step can meet: their
    chunks are cut to the minimum (policies.MIN_CHUNK), and every answer is still the
    prefill_first engine's, token for token."""
    from pdqueue.engine.policies import MIN_CHUNK

    prompts = [tiny_prompts(lens=[8] * 4, seed=3)[i] for i in range(4)] + tiny_prompts(lens=[150, 90, 200], seed=4)
    params = [sampled(24, seed=50 + i, ignore_eos=True) for i in range(len(prompts))]
    first = engine(tiny, policy="prefill_first").generate(prompts, params)
    eng = engine(tiny, policy="chunked", max_num_batched_tokens=256, tbt_slo_ms=0.01, num_blocks=256)
    ids = [f"r{i}" for i in range(len(prompts))]
    results = {rid: [] for rid in ids}
    for rid, p, q in list(zip(ids, prompts, params))[:4]:
        eng.add_request(rid, p, q)
    steps, chunks = 0, []
    while eng.has_unfinished:
        if steps == 8:   # the short ones decode (and the cost model has their steps): the long arrive
            for rid, p, q in list(zip(ids, prompts, params))[4:]:
                eng.add_request(rid, p, q)
        batch_before = eng.stats.num_tokens
        decoding = sum(1 for s in eng.scheduler.running if s.num_uncomputed_tokens == 1)
        for out in eng.step():
            results[out.request_id].append(out.token_id)
        if steps > 8 and decoding:
            chunks.append(eng.stats.num_tokens - batch_before - decoding)
        steps += 1
    assert eng.scheduler.tbt.num_budgeted_steps > 0
    assert chunks and max(chunks) <= MIN_CHUNK, chunks
    flips = assert_all_same(tiny, prompts, first, [results[rid] for rid in ids], params,
                            label="tiny prefill_first vs chunked under a TBT budget")
    report_flips("tiny TBT budget", flips, len(prompts))


def test_tiny_online_work_takes_the_room_of_running_batch_sequences(tiny):
    """make_room (what a decode worker calls before reserving an online handoff): with every
    slot held by batch sequences, it preempts the newest of them, the online reservation
    fits, and the preempted ones still answer as they would have unpreempted."""
    prompts = tiny_prompts(lens=[20, 30, 25], seed=7)
    params = [sampled(16, seed=70 + i, ignore_eos=True) for i in range(3)]
    alone = engine(tiny, max_num_seqs=3).generate(prompts, params)
    eng = engine(tiny, max_num_seqs=3, max_background_seqs=3)
    for i, (p, q) in enumerate(zip(prompts, params)):
        eng.add_request(f"b{i}", p, q, rank=ServiceClass.BATCH.rank)
    results = {f"b{i}": [] for i in range(3)}
    for _ in range(3):
        for out in eng.step():
            results[out.request_id].append(out.token_id)
    assert len(eng.scheduler.running) == 3 and not eng.kv_import.can_reserve(40)
    assert eng.kv_import.make_room(40) and eng.kv_import.can_reserve(40)
    preempted = [s for s in eng.scheduler.waiting if eng.scheduler.share.yields(s)]
    assert [s.request_id for s in preempted] == ["b2"] and preempted[0].num_preemptions == 1
    assert not engine(tiny, max_num_seqs=1).kv_import.make_room(10 ** 6)   # no batch to take from: False
    while eng.has_unfinished:
        for out in eng.step():
            results[out.request_id].append(out.token_id)
    flips = assert_all_same(tiny, prompts, alone, [results[f"b{i}"] for i in range(3)], params,
                            label="tiny batch preempted by make_room vs unpreempted")
    report_flips("tiny make_room", flips, len(prompts))


def test_tiny_deadline_order_changes_which_step_starts_a_prompt_not_its_tokens(tiny):
    """Requests added in the reverse order of their deadlines, under a budget that admits one
    prompt a step: their first tokens come in deadline order, and every answer is the
    colocated engine's (prefill_first, arrival order), token for token."""
    prompts = tiny_prompts(lens=[40, 33, 47, 38, 45], seed=27)
    params = [sampled(12, seed=70 + i, ignore_eos=True) for i in range(len(prompts))]
    first = engine(tiny, policy="prefill_first").generate(prompts, params)
    eng = engine(tiny, policy="prefill_first", max_num_batched_tokens=48, num_blocks=256)
    ids = [f"r{i}" for i in range(len(prompts))]
    deadlines = {rid: 1000.0 * (len(ids) - i) for i, rid in enumerate(ids)}   # the last one comes first
    for rid, p, q in zip(ids, prompts, params):
        eng.add_request(rid, p, q, rank=1, deadline_ms=deadlines[rid])
    results = {rid: [] for rid in ids}
    first_tokens = []
    while eng.has_unfinished:
        for out in eng.step():
            if out.index == 0:
                first_tokens.append(out.request_id)
            results[out.request_id].append(out.token_id)
    assert first_tokens == sorted(ids, key=deadlines.get) == ids[::-1]
    flips = assert_all_same(tiny, prompts, first, [results[rid] for rid in ids], params,
                            label="tiny arrival order vs deadline order")
    report_flips("tiny deadline order", flips, len(prompts))


@pytest.mark.slow
def test_smollm2_policies_agree(smollm2, smol_runs):
    prompts, params, first = smol_runs  # prefill_first
    chunked, _ = generate_chunked(smollm2, prompts, params, budget=32, num_blocks=64)
    flips = assert_all_same(smollm2, prompts, first, chunked, params, label="smollm2 prefill_first vs chunked")
    report_flips("smollm2 policies", flips, len(prompts))


# --- preemption by recompute ---------------------------------------------------------

@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_tiny_preemption_by_recompute(tiny, policy):
    lens = [5, 12, 20, 31, 40, 47, 60, 70]
    prompts = tiny_prompts(lens, seed=2)
    max_tokens = 40
    params = [greedy(max_tokens, ignore_eos=True) if i % 2 else sampled(max_tokens, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    expected = engine(tiny, policy=policy, max_num_batched_tokens=64).generate(prompts, params)
    # Every sequence fits alone (at most 70 + 40 tokens = 7 blocks); all together need ~50.
    num_blocks = 10
    small = engine(tiny, policy=policy, max_num_batched_tokens=64, num_blocks=num_blocks)
    got = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert [len(g) for g in got] == [max_tokens] * len(prompts)
    assert small.block_manager.num_free_blocks == num_blocks  # nothing leaked
    assert small.request_ids() == [] and not small.has_unfinished
    flips = assert_all_same(tiny, prompts, expected, got, params, label=f"tiny {policy} small pool vs big pool")
    report_flips(f"tiny {policy} preemption ({small.scheduler.num_preemptions} preemptions)", flips, len(prompts))


@pytest.mark.timeout(60)
def test_sequence_longer_than_the_pool_finishes_with_length(tiny):
    """A lone sequence that outgrows the whole pool ends with "length" instead of waiting forever."""
    eng = engine(tiny, num_blocks=2)  # 32 token slots
    outs = run_collect(eng, {"a": (list(range(10)), greedy(100, ignore_eos=True))})["a"]
    assert outs[-1].finish_reason == "length"
    assert 10 + len(outs) == 2 * BLOCK_SIZE + 1  # KV for every token but the last
    assert eng.block_manager.num_free_blocks == 2


# --- text, finish reasons, abort -----------------------------------------------------

def check_stream(outs) -> str:
    """Deltas add up to the final text, and each growing prefix is a prefix of it."""
    final = outs[-1].full_text
    assert final is not None and all(o.full_text is None for o in outs[:-1])
    shown = ""
    for o in outs:
        shown += o.text
        assert final.startswith(shown), (shown, final)
    assert shown == final
    return final


def test_output_text_flushes_held_back_bytes():
    tok = ByteTokenizer()
    text = OutputText(tok)
    shown = "".join(text.push(b) for b in "abé".encode()[:3])  # 'é' cut after its first byte
    assert shown == "ab"
    assert text.flush() == "\ufffd"
    assert text.text == "ab\ufffd" == tok.decode("abé".encode()[:3])


def test_output_text_holds_back_possible_stop_start():
    tok = ByteTokenizer()
    text = OutputText(tok, stop=("STOP", "\n\n"))
    deltas = [text.push(b) for b in b"one ST two STO"]
    assert "".join(deltas) == "one ST two "  # "STO" might begin "STOP": held back
    assert not text.stopped
    assert text.push(ord("P")) == "" and text.stopped and text.text == "one ST two "
    assert text.flush() == "" and text.push(ord("x")) == ""


def test_output_text_resumed_shows_what_the_first_worker_held_back():
    tok = ByteTokenizer()
    stop = ("xyz",)
    data = list("hello wor".encode()) + list("é".encode())
    first = OutputText(tok, stop)
    shown = "".join(first.push(t) for t in data[:5])  # "hel" shown, "lo" held back
    second = OutputText(tok, stop, prior_ids=data[:5])
    shown += "".join(second.push(t) for t in data[5:]) + second.flush()
    assert shown == second.text == "hello woré"


def test_tiny_full_text_matches_decode(tiny):
    """Random bytes from the tiny model: the final text is ``decode(output)`` even when it
    ends inside a multi-byte character (the held-back bytes are flushed)."""
    prompts = tiny_prompts([5, 9, 14, 20, 30, 41, 50, 60], seed=3)
    requests = {f"r{i}": (p, sampled(8 + 3 * i, seed=50 + i, ignore_eos=True)) for i, p in enumerate(prompts)}
    outs = run_collect(engine(tiny), requests)
    for rid, seq_outs in outs.items():
        ids = [o.token_id for o in seq_outs]
        assert check_stream(seq_outs) == tiny.tokenizer.decode(ids), rid
        assert seq_outs[-1].finish_reason == "length" and len(ids) == requests[rid][1].max_tokens


def stop_inside(text: str, pieces: list[str]) -> tuple[str, int]:
    """A stop string that begins inside one token's text and ends inside the next one's;
    returns it and the index of the token that completes it."""
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces) + 1)]
    for i in range(1, len(pieces) - 2):
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2:
            stop = text[starts[i] + 1: starts[i + 1] + 2]
            if text.find(stop) == starts[i] + 1:
                return stop, i + 1
    raise AssertionError(f"no usable stop string in {pieces}")


@pytest.mark.slow
def test_smollm2_stop_strings_and_stream(smollm2, smol_runs):
    tok = smollm2.tokenizer
    prompt = smol_runs[0][0]  # "The capital of France is"
    eng = engine(smollm2, num_blocks=64)
    # Both runs below are the same request alone: the same computation, so the same tokens.
    plain = run_collect(eng, {"n": (prompt, greedy(SMOL_MAX_TOKENS))})["n"]
    ids = [o.token_id for o in plain]
    assert plain[-1].finish_reason == "length" and len(ids) == SMOL_MAX_TOKENS
    full = tok.decode(ids)
    assert check_stream(plain) == full
    pieces = [tok.decode(ids[: k + 1])[len(tok.decode(ids[:k])):] for k in range(len(ids))]
    assert "".join(pieces) == full
    stop, last = stop_inside(full, pieces)
    stopped = run_collect(eng, {"s": (prompt, greedy(SMOL_MAX_TOKENS, stop=("never seen", stop)))})["s"]
    assert [o.token_id for o in stopped] == ids[: last + 1]  # ends on the token completing it
    assert stopped[-1].finish_reason == "stop"
    assert check_stream(stopped) == full[: full.find(stop)]
    assert eng.block_manager.num_free_blocks == 64


@pytest.mark.slow
def test_smollm2_eos_and_ignore_eos(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}]))
    eng = engine(smollm2, num_blocks=64)
    outs = run_collect(eng, {"eos": (prompt, greedy(30)), "ign": (prompt, greedy(8, ignore_eos=True))})
    eos = outs["eos"]
    assert eos[-1].finish_reason == "stop" and eos[-1].token_id in tok.eos_token_ids
    assert len(eos) < 30 and all(o.token_id not in tok.eos_token_ids for o in eos[:-1])
    text = check_stream(eos)
    assert text == tok.decode([o.token_id for o in eos]) and text.strip()
    ign = outs["ign"]
    assert len(ign) == 8 and ign[-1].finish_reason == "length"
    # ... runs past the EOS (same batch: equal tokens, or at worst a near-tie flip)
    assert_same_tokens(smollm2, prompt, [o.token_id for o in eos], [o.token_id for o in ign[: len(eos)]])
    assert eng.block_manager.num_free_blocks == 64


def test_tiny_max_tokens_and_abort(tiny):
    eng = engine(tiny, num_blocks=64)
    prompts = tiny_prompts([10, 40, 70], seed=4)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(5 if i == 0 else 200, ignore_eos=True))
    outs: dict[str, list] = {}
    for _ in range(8):
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
    r0 = outs["r0"]
    assert len(r0) == 5 and r0[-1].finish_reason == "length" and r0[-1].index == 4
    assert [o.index for o in r0] == list(range(5))
    assert set(eng.request_ids()) == {"r1", "r2"}
    held = 64 - eng.block_manager.num_free_blocks
    seq1 = eng.abort("r1")
    assert seq1.finish_reason == "cancelled" and seq1.is_finished and seq1.block_table == []
    assert 64 - eng.block_manager.num_free_blocks == held - eng.block_manager.blocks_for(seq1.num_tokens)
    assert eng.abort("r1") is None and eng.abort("nope") is None
    eng.abort("r2", reason="expired")
    assert eng.block_manager.num_free_blocks == 64 and not eng.has_unfinished
    assert eng.step() == []
    # A request aborted while still waiting frees nothing and leaves nothing behind.
    eng.add_request("w", prompts[0], greedy(3))
    assert eng.abort("w").finish_reason == "cancelled" and not eng.has_unfinished
    assert eng.block_manager.num_free_blocks == 64


# --- prefill-only role + KV copy into a decode engine ---------------------------------

def disaggregated(loaded, prompts, params, prefill_blocks: int = 96, decode_blocks: int = 80,
                  prefill_policy: str = "prefill_first"):
    """Prefill engine -> copy the detached blocks' KV -> decode engine. Returns per request
    (tokens, streamed text, final text, finish reason) and checks both pools end all-free."""
    pre_engine = engine(loaded, prefill_only=True, num_blocks=prefill_blocks, policy=prefill_policy,
                        max_num_batched_tokens=64)
    dec = engine(loaded, num_blocks=decode_blocks)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, q in zip(ids, prompts, params):
        pre_engine.add_request(rid, p, q)
    results = {rid: {"tokens": [], "shown": "", "final": None, "reason": None} for rid in ids}
    handoff = []
    while pre_engine.has_unfinished:
        for out in pre_engine.step():
            r = results[out.request_id]
            assert out.index == 0
            r["tokens"].append(out.token_id)
            r["shown"] += out.text
            if out.finished:
                assert out.detached_blocks is None
                r["final"], r["reason"] = out.full_text, out.finish_reason
            else:
                assert out.detached_blocks and out.full_text is None
                assert len(out.detached_blocks) == pre_engine.block_manager.blocks_for(len(out.seq.prompt_ids))
                handoff.append(out)
    assert pre_engine.request_ids() == []
    held = sum(len(out.detached_blocks) for out in handoff)
    assert pre_engine.block_manager.num_free_blocks == prefill_blocks - held  # detached, not freed
    for out in handoff:
        seq = dec.kv_import.reserve(out.request_id, out.seq.prompt_ids, out.seq.params, [out.token_id])
        src = torch.tensor(out.detached_blocks, dtype=torch.long)
        dst = torch.tensor(seq.block_table[: len(src)], dtype=torch.long)
        dec.kv_cache[:, :, dst] = pre_engine.kv_cache[:, :, src]
        dec.kv_import.add_prefilled(seq)
        pre_engine.free_blocks(out.detached_blocks)  # the lease ends once the KV is copied
    assert pre_engine.block_manager.num_free_blocks == prefill_blocks
    while dec.has_unfinished:
        for out in dec.step():
            r = results[out.request_id]
            assert out.index == len(r["tokens"])
            r["tokens"].append(out.token_id)
            r["shown"] += out.text
            if out.finished:
                r["final"], r["reason"] = out.full_text, out.finish_reason
    assert dec.block_manager.num_free_blocks == decode_blocks
    return [results[rid] for rid in ids]


@pytest.mark.parametrize("prefill_policy", ["prefill_first", "chunked"])
def test_tiny_disaggregated_matches_colocated(tiny, prefill_policy):
    prompts = tiny_prompts([3, 15, 16, 17, 40, 64, 90, 150], seed=5)
    params = [greedy(12, stop=("ab", "\x00\x01\x02")) if i % 2 else sampled(12, seed=i, stop=("xyz",))
              for i in range(len(prompts))]
    params[0] = greedy(1)  # finishes in the prefill engine
    colocated = engine(tiny, num_blocks=128)
    expected = run_collect(colocated, {f"r{i}": (p, q) for i, (p, q) in enumerate(zip(prompts, params))})
    got = disaggregated(tiny, prompts, params, prefill_policy=prefill_policy)
    flips = 0
    for i, (p, q, g) in enumerate(zip(prompts, params, got)):
        exp = expected[f"r{i}"]
        flip = assert_same_tokens(tiny, p, [o.token_id for o in exp], g["tokens"], q, label=f"disagg r{i}")
        flips += flip
        if not flip:
            assert g["reason"] == exp[-1].finish_reason
            assert g["final"] == exp[-1].full_text == g["shown"]
    report_flips(f"tiny disaggregated ({prefill_policy} prefill)", flips, len(prompts))


@pytest.mark.slow
def test_smollm2_disaggregated_matches_colocated(smollm2, smol_runs):
    prompts, params, together = smol_runs
    got = disaggregated(smollm2, prompts, params, prefill_blocks=48, decode_blocks=40)
    flips = assert_all_same(smollm2, prompts, together, [g["tokens"] for g in got], params,
                            label="smollm2 colocated vs disaggregated")
    for g in got:
        assert g["final"] == g["shown"] and g["reason"] == "length"
    report_flips("smollm2 disaggregated", flips, len(prompts))


def test_oracle_rejects_a_real_mismatch(tiny):
    """The near-tie rule does not wave through a wrong token."""
    prompt = tiny_prompts([20], seed=6)[0]
    out = engine(tiny).generate([prompt], greedy(6))[0]
    logits = tiny.model.dense_logits(torch.tensor(prompt + out[:3]))[-1]
    wrong = int(torch.argsort(logits, descending=True)[5])  # the 6th best: no near-tie
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_same_tokens(tiny, prompt, out, out[:3] + [wrong] + out[4:])
    with pytest.raises(AssertionError, match="strict prefix"):
        assert_same_tokens(tiny, prompt, out, out[:-1])
    assert assert_same_tokens(tiny, prompt, out, list(out)) == 0
    assert not [f for f in FLIPS if f.label == ""]


# --- contiguous decode K/V copies (engine/decode_kv.py) -----------------------------------

def test_sdpa_reads_the_same_numbers_whatever_the_strides():
    """What the copies rest on: a decode query's SDPA over K/V gathered from blocks
    (strided) and over a contiguous copy with room to grow gives the same bits."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, group, dim, block = 3, 3, 64, 16
    for ctx in (1, 15, 16, 17, 128, 333, 1000, 3000):
        blocks = -(-ctx // block)
        gathered = torch.randn(2, blocks, block, kv_heads, dim, generator=gen)
        planes = gathered.view(2, -1, kv_heads, dim).transpose(1, 2)
        copy = torch.empty(2, kv_heads, ctx + 100, dim)
        copy[:, :, :ctx] = planes[:, :, :ctx]
        q = torch.randn(1, kv_heads, group, dim, generator=gen)
        strided = torch.nn.functional.scaled_dot_product_attention(q, planes[0, None, :, :ctx],
                                                                   planes[1, None, :, :ctx], scale=0.125)
        contiguous = torch.nn.functional.scaled_dot_product_attention(q, copy[0, None, :, :ctx],
                                                                      copy[1, None, :, :ctx], scale=0.125)
        assert torch.equal(strided, contiguous), ctx


def _without_copies(eng: LLMEngine) -> LLMEngine:
    eng.runner.decode_kv = None
    return eng


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_decode_copies_give_the_gathered_tokens(tiny, policy):
    """Decode steps that read per-sequence copies produce exactly the tokens of steps that
    gather from the pool, through mixed steps (chunked), preemption by recompute and
    finished sequences; each copy is built once per stretch of decode steps, not per step."""
    lens = [5, 12, 20, 31, 40, 47, 60, 70]
    prompts = tiny_prompts(lens, seed=3)
    params = [greedy(40, ignore_eos=True) if i % 2 else sampled(40, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    for num_blocks in (128, 10):   # 10: preemptions
        gathered = _without_copies(engine(tiny, policy=policy, max_num_batched_tokens=64, num_blocks=num_blocks))
        copied = engine(tiny, policy=policy, max_num_batched_tokens=64, num_blocks=num_blocks)
        store = copied.runner.decode_kv
        store.budget_bytes = 4096 * store.bytes_per_token   # the small pool's own size would fit one copy
        assert copied.generate(prompts, params) == gathered.generate(prompts, params)
        assert copied.scheduler.num_preemptions == gathered.scheduler.num_preemptions
        assert 0 < store.builds <= len(prompts) * (1 + copied.scheduler.num_preemptions) + 20, store.builds
        assert store.nbytes == 0   # every copy went with its sequence
    assert copied.scheduler.num_preemptions > 0


def test_decode_copies_within_budget_else_gather(tiny):
    """Copies never take more than their budget: a step whose copies would not fit
    gathers instead (and the tokens do not change)."""
    prompts = tiny_prompts([40, 60, 80, 100], seed=4)
    params = [greedy(n, ignore_eos=True) for n in (10, 15, 20, 60)]   # the batch shrinks to one
    expected = _without_copies(engine(tiny)).generate(prompts, params)
    eng = engine(tiny)
    store = eng.runner.decode_kv
    store.budget_bytes = 400 * store.bytes_per_token   # room for one or two sequences, not four
    peak = []
    for i, (p, q) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, q)
    outs = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished:
        for out in eng.step():
            outs[out.request_id].append(out.token_id)
        peak.append(store.nbytes)
    assert [outs[str(i)] for i in range(len(prompts))] == expected
    assert max(peak) <= store.budget_bytes
    assert store.builds > 0   # it did copy once the batch shrank to what fits
