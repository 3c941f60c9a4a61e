"""What running the suite does to the machine and says about itself: the model cache is the
run's own (never the user's ~/.cache/pdqueue: converted models, quantized weights, the q4_1
kernel), and every process a test starts uses it; `scripts/test`'s short summary names the
failed tests, not only the skipped ones; the tree passes the linter (`ruff check`, configured in
pyproject.toml), so `scripts/test --fast` catches what CI's lint step would."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_tests_use_a_model_cache_of_their_own_and_their_processes_too(env, tmp_path_factory):
    root = Path(os.environ["PDQ_CACHE_DIR"])
    assert not root.resolve().is_relative_to((Path.home() / ".cache" / "pdqueue").resolve()), root
    if not os.environ.get("PDQ_TEST_CACHE_DIR"):
        base = tmp_path_factory.getbasetemp()
        run = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base   # shared by the xdist workers
        assert root == run / "pdq-cache", root
    assert env["PDQ_CACHE_DIR"] == str(root)   # what the CLI tests' processes get
    for environment in (env, None):   # a `pdqueue ...` subprocess, and one that inherits this process's
        code = "from pdqueue.models.cache import cache_root; print(cache_root())"
        seen = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                              cwd=ROOT, check=True).stdout.strip()
        assert seen == str(root), (environment is None, seen)


def test_scripts_test_lists_failures_and_errors_in_its_short_summary():
    command = (ROOT / "scripts" / "test").read_text().strip().splitlines()[-1]
    assert re.search(r"pytest .*-rfEs\b", command), command


def _ruff() -> str | None:
    """The ruff of this venv (pyproject's test extras install it), else one on PATH."""
    here = Path(sys.executable).parent / "ruff"
    return str(here) if here.exists() else shutil.which("ruff")


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed (pip install -e '.[test]' installs it)")
def test_the_tree_passes_the_linter():
    result = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
