"""The cache of quantized weights (pdqueue/models/quant_cache.py, entries kept by
pdqueue/models/cache.py): real files, real model loads (a small GGUF written by
tests/gguf_files.py, SmolLM2 for the slow test), each test with its own cache directory
except the SmolLM2 one (which uses the developer's, as the other SmolLM2 tests do).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from pdqueue.models import cache, quant, quant_cache
from pdqueue.models.loader import ensure_gguf_cache, load_model, resolve_model_path
from tests.gguf_files import write_tiny_gguf
from tests.helpers import run_together

IDS = torch.arange(1, 48)


def quant_entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "models").glob("quant-*") if p.is_dir())


def logits(loaded) -> torch.Tensor:
    return loaded.model.dense_logits(IDS)


def file_id(entry: Path) -> tuple[int, int]:
    st = (entry / cache.QUANT_FILE).stat()
    return st.st_ino, st.st_mtime_ns


@pytest.mark.parametrize("weights", ["int8", "int4", "q4_1"])
def test_cached_layers_equal_freshly_quantized_ones(tmp_path, cache_dir, weights):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    fresh = load_model(path, weights=weights, use_cache=False)     # bypasses both caches
    assert fresh.model.quant_cache == "off" and quant_entries(cache_dir) == []
    first = load_model(path, weights=weights)
    assert first.model.quant_cache == "written"
    [entry] = quant_entries(cache_dir)
    written = file_id(entry)
    second = load_model(path, weights=weights)
    assert second.model.quant_cache == "hit"
    assert quant_entries(cache_dir) == [entry] and file_id(entry) == written, "quantized and written again"
    for loaded in (first, second):
        assert torch.equal(logits(loaded), logits(fresh))
    assert {type(m).__name__ for m in second.model.modules()} >= {
        "int8": {"Int8Linear"}, "int4": {"Int4Linear", "Int8Linear"}, "q4_1": {"Q41Linear", "Q80Linear"}}[weights]
    made_from = json.loads((entry / "entry.json").read_text())
    assert (made_from["weights"], made_from["recipe"], made_from["torch"]) == (weights, quant.RECIPE_VERSION,
                                                                                torch.__version__)


def test_tiny_is_not_cached(cache_dir):
    assert load_model("tiny", weights="int8").model.quant_cache == "off"
    assert not (cache_dir / "models").exists() or quant_entries(cache_dir) == []


@pytest.mark.parametrize("damage", ["cut_short", "not_safetensors", "no_manifest"])
def test_a_damaged_entry_is_ignored_and_rewritten(tmp_path, cache_dir, damage):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    expected = logits(load_model(path, weights="int8"))
    [entry] = quant_entries(cache_dir)
    weights_file = entry / cache.QUANT_FILE
    if damage == "cut_short":
        weights_file.write_bytes(weights_file.read_bytes()[:-100])
    elif damage == "not_safetensors":   # same size, so the manifest's sizes still match
        weights_file.write_bytes(b"\xff" * weights_file.stat().st_size)
    else:
        (entry / "entry.json").unlink()
    damaged = load_model(path, weights="int8")
    assert damaged.model.quant_cache == "written"
    assert torch.equal(logits(damaged), expected)
    assert quant_entries(cache_dir) == [entry]
    again = load_model(path, weights="int8")
    assert again.model.quant_cache == "hit" and torch.equal(logits(again), expected)
    assert [p.name for p in entry.parent.iterdir() if p.name.startswith(".quant-")] == []


@pytest.mark.processes
def test_loaders_starting_together_share_one_entry(tmp_path, cache_dir):
    """Two workers of one `up` start together: both quantize, both succeed, one entry is kept
    and no temporary directory is left."""
    path = write_tiny_gguf(tmp_path / "m.gguf")
    code = ("import sys, torch; from pdqueue.models.loader import load_model\n"
            "m = load_model(sys.argv[1], weights='int4')\n"
            "print(m.model.quant_cache, m.model.dense_logits(torch.arange(1, 48)).double().sum().item())")
    outs = run_together(code, [str(path)], 2, cache_dir)
    assert len({out.split()[1] for out in outs}) == 1
    [entry] = quant_entries(cache_dir)
    assert [p.name for p in entry.parent.iterdir() if p.name.startswith(".quant-")] == []
    cached = load_model(path, weights="int4")
    assert cached.model.quant_cache == "hit"
    assert torch.equal(logits(cached), logits(load_model(path, weights="int4", use_cache=False)))


def test_a_recipe_version_bump_misses(tmp_path, cache_dir, monkeypatch):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    assert load_model(path, weights="int8").model.quant_cache == "written"
    [old] = quant_entries(cache_dir)
    monkeypatch.setattr(quant, "RECIPE_VERSION", quant.RECIPE_VERSION + 1)
    assert load_model(path, weights="int8").model.quant_cache == "written"
    assert len(quant_entries(cache_dir)) == 2 and old in quant_entries(cache_dir)
    assert load_model(path, weights="int8").model.quant_cache == "hit"
    key = cache.quant_key("f", "int8", 1, "2.13.0")
    assert len({key, cache.quant_key("g", "int8", 1, "2.13.0"), cache.quant_key("f", "int4", 1, "2.13.0"),
                cache.quant_key("f", "int8", 2, "2.13.0"), cache.quant_key("f", "int8", 1, "2.14.0")}) == 5


def age(path: Path, days: float) -> None:
    then = time.time() - days * 86400
    os.utime(path, (then, then))


def test_a_quantized_entry_goes_with_its_float_weights(tmp_path, cache_dir):
    kept, gone = write_tiny_gguf(tmp_path / "kept.gguf", seed=1), write_tiny_gguf(tmp_path / "gone.gguf", seed=2)
    hf = tmp_path / "hf"   # a Hugging Face directory: the converted files of a third GGUF
    shutil.copytree(ensure_gguf_cache(write_tiny_gguf(tmp_path / "third.gguf", seed=3)), hf,
                    ignore=shutil.ignore_patterns("entry.json"))
    entry_of = {}
    for source in (kept, gone, hf):
        assert load_model(source, weights="int4").model.quant_cache == "written"
        [entry_of[source]] = [e for e in quant_entries(cache_dir) if e not in entry_of.values()]
    gone.unlink()                                   # its install was removed
    for entry in [*entry_of.values(), *cache_dir.glob("models/gguf-*")]:
        age(entry, 2)
    stale_tmp = cache.new_quant_tmp("0" * 64)       # left by a killed loader
    age(stale_tmp, 1)
    ensure_gguf_cache(kept)                         # each load prunes
    assert quant_entries(cache_dir) == sorted([entry_of[kept], entry_of[hf]])
    assert not stale_tmp.exists()
    os.utime(hf / "model.safetensors")              # the directory's weights changed
    ensure_gguf_cache(kept)
    assert quant_entries(cache_dir) == [entry_of[kept]]
    age(entry_of[kept], 31)                         # its file is there, but unused for a month
    ensure_gguf_cache(write_tiny_gguf(tmp_path / "other.gguf", seed=4))
    assert quant_entries(cache_dir) == []
    assert load_model(kept, weights="int4").model.quant_cache == "written"   # a pruned entry is rebuilt on use


@pytest.mark.slow
@pytest.mark.xdist_group("test_quant_cache_smollm2")   # one SmolLM2 load (module fixture) for both
@pytest.mark.parametrize("weights", ["int8", "int4", "q4_1"])
def test_smollm2_cached_layers_equal_freshly_quantized_ones(smollm2, weights):
    """On SmolLM2, in the developer's cache (as the other SmolLM2 tests): fresh quantization
    of the float model, then the cached path, which hits (a second time if it wrote)."""
    import copy

    ids = torch.tensor(smollm2.tokenizer.encode("The capital of France is Paris. The capital of Japan is"))
    path = resolve_model_path("smollm2")
    fresh = quant.quantize_model(copy.deepcopy(smollm2.model), weights)
    states = []
    for _ in range(2):
        model = copy.deepcopy(smollm2.model)
        states.append(quant_cache.quantize(model, weights, smollm2.fingerprint, path))
        if states[-1] == "hit":
            break
    assert states[-1] == "hit", states
    assert torch.equal(model.dense_logits(ids), fresh.dense_logits(ids))
