"""tests/run_cache.py: what the run makes once is made once, however many ask at the same time,
and a make that failed half way is made again, not served half made."""

from __future__ import annotations

import threading
import time

import pytest

from tests import run_cache


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setattr(run_cache, "ROOT", tmp_path / "run-cache")
    return run_cache.ROOT


def test_a_path_is_made_once_for_callers_asking_together(root):
    made = []

    def make(target):
        made.append(target)
        time.sleep(0.2)   # long enough for the other callers to arrive while it is made
        target.mkdir()
        (target / "weights").write_text("w")

    got = []
    threads = [threading.Thread(target=lambda: got.append(run_cache.path("hf-case", make))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(set(got)) == 1
    assert (got[0] / "weights").read_text() == "w" and got[0] == root / "hf-case"


def test_a_failed_make_leaves_nothing_and_the_next_caller_makes_it(root):
    def broken(target):
        target.write_text("half")
        raise RuntimeError("converter failed")

    with pytest.raises(RuntimeError):
        run_cache.path("x.gguf", broken)
    assert not (root / "x.gguf").exists()
    assert run_cache.path("x.gguf", lambda target: target.write_text("whole")).read_text() == "whole"


def test_values_and_lazy_dicts(root):
    calls = []
    assert run_cache.value("answer", lambda: calls.append(1) or [1, 2]) == [1, 2]
    assert run_cache.value("answer", lambda: calls.append(1) or [3]) == [1, 2] and len(calls) == 1
    lazy = run_cache.Lazy(lambda key: calls.append(key) or key * 2)
    assert lazy["ab"] == "abab" and lazy["ab"] == "abab" and calls == [1, "ab"]


def test_unset_outside_a_session(monkeypatch):
    monkeypatch.setattr(run_cache, "ROOT", None)
    with pytest.raises(RuntimeError, match="conftest"):
        run_cache.path("x", lambda target: None)
