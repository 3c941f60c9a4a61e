"""llama.cpp's own converter (``convert_hf_to_gguf.py``, from the llama.cpp source that
``scripts/llama-cpp-source`` unpacks into .llama.cpp/) turned on a tiny checkpoint: the GGUF
file a user would make of it. Run as a script in a process of its own (it imports its bundled
gguf-py, not the installed gguf):

    python tests/gguf_convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf

The test checkpoints carry SmolLM2's tokenizer rebuilt from its GGUF vocabulary, whose
tokenizer.json the converter's table of known pre-tokenizers (keyed by a hash of a sample's
tokens) does not list; it is told it is "smollm", which it is. Everything else is the
converter's own doing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = os.environ.get("PDQ_LLAMA_CPP_SRC") or str(Path(__file__).resolve().parent.parent / ".llama.cpp")


def available() -> str | None:
    """Why the converter cannot run here, or None."""
    if not (Path(ROOT) / "convert_hf_to_gguf.py").exists():
        return f"llama.cpp's converter is not in {ROOT} (bash scripts/llama-cpp-source)"
    try:
        import sentencepiece  # noqa: F401  (the converter imports it before it looks for a model file)
    except ImportError:
        return "sentencepiece is not installed (pip install -e '.[test]')"
    return None


def convert(model_dir: Path, out: Path) -> Path:
    import subprocess

    done = subprocess.run([sys.executable, __file__, ROOT, str(model_dir), str(out)], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return out


if __name__ == "__main__":
    root, model, out = sys.argv[1:4]
    sys.path.insert(0, root)
    sys.path.insert(1, str(Path(root) / "gguf-py"))
    import convert_hf_to_gguf
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
    sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", out]
    convert_hf_to_gguf.main()
