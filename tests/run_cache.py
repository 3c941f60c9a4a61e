"""What a test run makes once and its xdist workers share: files and directories that are
costly to make and that no test changes (a family's tiny checkpoint built by transformers,
the GGUF file llama.cpp's converter made of it, transformers' greedy answers).

Several test modules ask for the same things (tests/test_families.py,
test_families_pipeline.py and test_gguf_families.py each built every family's checkpoint in a
module fixture), and each xdist worker that ran one test of such a module built all of them
again: the same minute of CPU three to six times a run. Here each thing is made once per run,
when first asked for, by whichever process asks first, while the others wait for it (a lock
file per name); a test that changes one copies it first (as the family tests do).

``ROOT`` is set for the session by tests/conftest.py (``_run_cache``): a folder of the run's
basetemp, shared by its xdist workers and removed with it; never kept across runs, so a change
to a builder is always seen by the next run.
"""

from __future__ import annotations

import fcntl
import json
import re
import shutil
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

ROOT: Path | None = None


def _root() -> Path:
    if ROOT is None:
        raise RuntimeError("tests.run_cache.ROOT is not set (tests/conftest.py sets it for a pytest session)")
    ROOT.mkdir(parents=True, exist_ok=True)
    return ROOT


def _name(key: str) -> str:
    """``key`` as a file name (kept readable: it names what a failed test's folder holds)."""
    return re.sub(r"[^\w.+-]", "_", key)


def path(key: str, make: Callable[[Path], object]) -> Path:
    """The file or directory ``key`` of this run: ``make(target)`` writes it at ``target`` (a
    temporary path, renamed into place once ``make`` returned) the first time any process of
    the run asks; later calls, from any process, return it at once."""
    root = _root()
    final = root / _name(key)
    with open(root / f"{_name(key)}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists():
            return final
        part = root / f"{_name(key)}.part"
        if part.is_dir():
            shutil.rmtree(part)
        else:
            part.unlink(missing_ok=True)
        make(part)
        part.rename(final)
        return final


def value(key: str, compute: Callable[[], T]) -> T:
    """``compute()``'s value (JSON: lists come back as lists), computed once per run."""
    def make(target: Path) -> None:
        target.write_text(json.dumps(compute()))

    return json.loads(path(f"{key}.json", make).read_text())


class Lazy(dict):
    """A dict whose value for a missing key is ``make(key)``, made when first read: a module
    fixture that names what its tests may use without making what this process never asks for."""

    def __init__(self, make: Callable[[str], object]):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        made = self[key] = self._make(key)
        return made
