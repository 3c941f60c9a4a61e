"""GGUF files of the families GGUF defines, as llama.cpp writes and reads them: its own
converter (tests/gguf_convert.py) turns each tiny checkpoint into a GGUF file, which must give
the safetensors' logits and tokens, in process and through real workers; llama.cpp's
vocabulary tests (models/ggml-vocab-*.gguf with their expected ids) must tokenize as llama.cpp
does. Skipped without the llama.cpp source (bash scripts/llama-cpp-source; CI runs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdqueue.client import Client
from pdqueue.models.loader import load_model
from pdqueue.models.source import ModelSourceError, resolve_model_path
from tests import gguf_convert, hf_models, run_cache
from tests.helpers import FAST, wait_pools_free

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(gguf_convert.available() is not None, reason=str(gguf_convert.available()))

GGUF_CASES = ("llama", "llama3", "qwen2", "qwen3", "qwen3_moe-sparse")
PROMPT = "The quick brown fox jumps over the lazy dog, then runs away into the forest."


def _converted(case: str) -> tuple[Path, Path]:
    directory = hf_models.checkpoint(case)
    return directory, run_cache.path(f"gguf-{case}.gguf", lambda target: gguf_convert.convert(directory, target))


@pytest.fixture(scope="module")
def converted():
    """case -> (its safetensors directory, the GGUF file llama.cpp's converter made of it).
    Each converted when first asked for, once per test run (tests/run_cache.py): a conversion
    runs llama.cpp's converter in a process of its own (seconds of imports), and every xdist
    worker that ran one of this module's tests converted all five cases again."""
    return run_cache.Lazy(_converted)


@pytest.mark.parametrize("vocab", ["qwen2", "llama-bpe", "gpt-2"])
def test_gguf_vocabularies_tokenize_as_llama_cpp(vocab):
    import gguf

    from pdqueue.models import gguf_file

    base = Path(gguf_convert.ROOT) / "models" / f"ggml-vocab-{vocab}.gguf"
    tokenizer = gguf_file.read_tokenizer(gguf.GGUFReader(str(base)), None, ())
    texts = Path(f"{base}.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = [[int(t) for t in line.split()] for line in Path(f"{base}.out").read_text().split("\n")]
    got = [tokenizer.backend.encode(text, add_special_tokens=False).ids for text in texts]
    assert len(texts) > 40 and got == expected[:len(texts)]


@pytest.mark.parametrize("case", GGUF_CASES)
def test_a_gguf_made_by_llama_cpp_gives_the_safetensors_logits(converted, cache_dir, case):
    directory, gguf_path = converted[case]
    ours = load_model(gguf_path)   # through the cache: converted once to a Hugging Face directory
    reference = load_model(directory)
    assert ours.config.family == reference.config.family
    ids = reference.tokenizer.encode(PROMPT)
    assert ours.tokenizer.encode(PROMPT) == ids
    with torch.no_grad():
        got, want = ours.model.dense_logits(torch.tensor(ids)), reference.model.dense_logits(torch.tensor(ids))
    # (llama3: llama.cpp stores its rope scaling as per-frequency divisors, a few ulps off)
    assert (got - want).abs().max().item() < 1e-4


def test_a_gguf_of_a_family_gguf_does_not_define_here_is_refused_by_name(tmp_path):
    path = gguf_convert.convert(hf_models.checkpoint("gemma3"), tmp_path / "gemma3.gguf")
    with pytest.raises(ModelSourceError, match="GGUF architecture 'gemma3' is not supported"):
        resolve_model_path(path)


@pytest.mark.processes
def test_prefill_and_decode_workers_serve_a_qwen3_gguf_as_transformers(cluster, converted):
    directory, gguf_path = converted["qwen3"]
    tok = hf_models.smollm2_tokenizer()
    expected = hf_models.hf_greedy(directory, tok.encode(PROMPT), 24)
    cluster.model = str(gguf_path)
    cluster.start_together(("prefill", *FAST, {"worker_id": "p0"}), ("decode", *FAST, {"worker_id": "d0"}))
    result = Client(cluster.redis_url, cluster.cluster).submit(PROMPT, max_tokens=24, temperature=0.0,
                                                               ignore_eos=True).result(60)
    assert list(result.token_ids) == expected
    wait_pools_free(cluster)
