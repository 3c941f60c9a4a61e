"""The on-disk cache of GGUF files converted to Hugging Face directories, and of quantized
weights (``--weights int8|int4``).

Owns: where an entry lives (keyed by the GGUF file's content; a quantized entry by the float
weights' identity, the format, the quantization recipe and torch's version), whether an
entry is whole, putting a new entry in place, and pruning. Standard library only (the
quantized tensors are read and written by ``pdqueue.models.quant_cache``).

Layout under ``cache_root()`` (``$PDQ_CACHE_DIR``, else ``~/.cache/pdqueue``)::

    models/gguf-<sha256[:32]>/  one converted GGUF: config.json, model.safetensors,
                                tokenizer.json, tokenizer_config.json, and entry.json,
                                written last: the full digest and every file's size.
                                Its mtime is the time it was last used.
    models/sources.json         source index: real path -> size, mtime_ns, inode, device,
                                sha256, last seen. A file whose stat is unchanged is not
                                hashed again (a full SHA-256 of SmolLM2's 98 MB GGUF takes
                                ~0.13 s with SHA-NI, more without; a lookup ~1 ms).
    models/quant-<key[:32]>/    one model's quantized layers in one format (int8 or int4):
                                weights.safetensors (plain tensors: int8 weights and scales,
                                or torch's packed int4 layout and its bf16 scales/zeros),
                                then entry.json: the full key, what it was made from
                                (fingerprint, format, recipe, torch, the source path) and
                                the file's size. Its mtime is the time it was last used.
    models/.lock                flock: index updates, entry swaps and pruning.

The key is the content, so every install of the same file (each fresh virtualenv has its
own copy, with its own mtime) shares one entry. Entries are written to a temporary
directory and renamed into place, so concurrent loaders never see a partial one; an entry
whose files do not match its entry.json is not used, and is replaced.

Pruning (after each load that goes through the cache) removes:

- entries that no indexed source file still maps to (the file is gone or changed) and that
  were not used for ``UNREFERENCED_AFTER_S`` (a day: a loader that is converting right
  now is never raced);
- entries not used for ``UNUSED_AFTER_S`` (30 days), whoever refers to them;
- temporary directories older than ``TEMP_AFTER_S`` (left by a killed conversion);
- entries of the old mtime-keyed layout (``<stem>-<size>-<mtime_ns>`` directly under the
  cache root) older than ``UNREFERENCED_AFTER_S``.

A quantized entry follows its float weights by the same rules: it is referenced while its
GGUF's converted entry is (the same indexed file maps to it), or, made from a Hugging Face
directory, while that directory's fingerprint (its safetensors' names, sizes and mtimes) is
unchanged; unreferenced for a day or unused for 30 days, it goes. An entry of an older
recipe or torch version is never used again and goes after 30 days unused (another install
sharing the cache may still use it). Loading one costs what quantizing costs minus the
math: for int8, fbgemm's ``linear_prepack`` still runs at load (its packed object is not a
plain tensor and has no serialized form but the int8 weights and scales).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

UNREFERENCED_AFTER_S = 24 * 3600
UNUSED_AFTER_S = 30 * 24 * 3600
TEMP_AFTER_S = 3600
SEEN_REFRESH_S = 3600           # how stale a source's "seen" time may get before it is rewritten
MANIFEST = "entry.json"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")
_ENTRY = re.compile(r"gguf-[0-9a-f]{32}")
_TEMP = re.compile(r"\.gguf-[0-9a-f]{32}\..+")
_QUANT_ENTRY = re.compile(r"quant-[0-9a-f]{32}")
_QUANT_TEMP = re.compile(r"\.quant-[0-9a-f]{32}\..+")
QUANT_FILE = "weights.safetensors"
_LEGACY = re.compile(r".+-\d+-\d{18,20}")  # <stem>-<size>-<mtime_ns>
_LEGACY_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
_LEGACY_CONFIG = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                  "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                  "eos_token_id", "hidden_act", "torch_dtype"}


def cache_root() -> Path:
    return Path(os.environ.get("PDQ_CACHE_DIR") or Path.home() / ".cache" / "pdqueue")


def models_dir() -> Path:
    return cache_root() / "models"


@contextlib.contextmanager
def locked():
    """The cache's exclusive lock (across processes)."""
    directory = models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _identity(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "device": st.st_dev}


def _read_index() -> dict:
    try:
        index = json.loads((models_dir() / "sources.json").read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _write_index(index: dict) -> None:
    directory = models_dir()
    fd, tmp = tempfile.mkstemp(prefix=".sources.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes it owner-only
            json.dump(index, f, indent=1, sort_keys=True)
        os.replace(tmp, directory / "sources.json")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def file_sha256(path: Path) -> str:
    digest, buffer = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def source_digest(path: Path) -> str:
    """SHA-256 of the file's content, from the index while its size, mtime, inode and
    device are unchanged; hashed (and indexed) otherwise."""
    real = os.path.realpath(path)
    st = os.stat(real)
    record = _read_index().get(real)
    now = time.time()
    if isinstance(record, dict) and {k: record.get(k) for k in ("size", "mtime_ns", "inode", "device")} \
            == _identity(st) and isinstance(record.get("sha256"), str):
        if now - record.get("seen", 0) < SEEN_REFRESH_S:
            return record["sha256"]
        digest = record["sha256"]
    else:
        digest = file_sha256(Path(real))
    try:
        with locked():
            index = _read_index()
            index[real] = {**_identity(st), "sha256": digest, "seen": now}
            _write_index(index)
    except OSError:
        pass  # a read-only cache still works; the file is hashed again next time
    return digest


def entry_dir(digest: str) -> Path:
    return models_dir() / f"gguf-{digest[:32]}"


def entry_ok(entry: Path, digest: str | None = None) -> bool:
    """True when the entry is whole: its entry.json names the digest and every file it
    lists is there with its recorded size."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
        if digest is not None and manifest["sha256"] != digest:
            return False
        if not all(name in files for name in REQUIRED):
            return False
        return all((entry / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def mark_used(entry: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(entry)


def new_entry_tmp(digest: str) -> Path:
    """A private temporary directory to write an entry into (then ``install`` it)."""
    directory = models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{entry_dir(digest).name}.", dir=directory))


def install(tmp: Path, digest: str, source: Path) -> Path:
    """Seal ``tmp`` (write its entry.json) and rename it into place. When a whole entry is
    already there (another loader won), ``tmp`` is dropped; a broken one is replaced."""
    files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"sha256": digest, "source": str(source), "files": files},
                                           indent=1))
    return _put_in_place(tmp, entry_dir(digest), lambda target: entry_ok(target, digest))


def _put_in_place(tmp: Path, target: Path, whole, replace: bool = False) -> Path:
    """Rename the sealed ``tmp`` to ``target`` unless ``whole(target)`` (another loader won;
    ``replace``: even then, for an entry found unreadable although its sizes are right)."""
    tmp.chmod(0o755)  # mkdtemp makes it owner-only
    try:
        with locked():
            if replace or not whole(target):
                if target.exists():
                    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.broken-", dir=target.parent))
                    os.rename(target, aside / "entry")
                    shutil.rmtree(aside, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mark_used(target)
    return target


# --- quantized weights ----------------------------------------------------------------

def directory_fingerprint(directory: Path) -> str:
    """A Hugging Face directory's weights' identity: its safetensors' names, sizes, mtimes."""
    files = sorted(Path(directory).glob("*.safetensors"))
    return hashlib.sha256(repr([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode()).hexdigest()


def quant_key(fingerprint: str, weights: str, recipe: int, torch_version: str) -> str:
    """The key of quantized weights: what they were made from and how."""
    return hashlib.sha256(json.dumps({"fingerprint": fingerprint, "weights": weights, "recipe": recipe,
                                      "torch": torch_version}, sort_keys=True).encode()).hexdigest()


def quant_entry_dir(key: str) -> Path:
    return models_dir() / f"quant-{key[:32]}"


def quant_entry_ok(entry: Path, key: str) -> bool:
    """True when the quantized entry is whole: its entry.json names the key and its
    weights file is there with its recorded size."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
        if manifest["key"] != key or QUANT_FILE not in files:
            return False
        return all((entry / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def new_quant_tmp(key: str) -> Path:
    """A private temporary directory to write a quantized entry into (then ``install_quant``)."""
    directory = models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{quant_entry_dir(key).name}.", dir=directory))


def install_quant(tmp: Path, key: str, made_from: dict, replace: bool = False) -> Path:
    """Seal ``tmp`` (entry.json: the key, ``made_from``, the files' sizes) and rename it into
    place, as ``install`` does; ``replace``: the entry there was found unreadable."""
    files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({**made_from, "key": key, "files": files}, indent=1))
    return _put_in_place(tmp, quant_entry_dir(key), lambda target: quant_entry_ok(target, key), replace)


def _quant_referenced(entry: Path, live: set) -> bool:
    """Whether the float weights a quantized entry was made from are still in use."""
    try:
        made_from = json.loads((entry / MANIFEST).read_text())
        if made_from.get("gguf_sha256"):
            return entry_dir(made_from["gguf_sha256"]).name in live
        directory = made_from.get("directory")
        return bool(directory) and directory_fingerprint(Path(directory)) == made_from["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def prune(now: float | None = None) -> list[Path]:
    """Remove what no install uses (see the module docstring). Returns what was removed."""
    now = time.time() if now is None else now
    directory = models_dir()
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    with locked():
        index, live = _read_index(), set()
        before = len(index)
        for real, record in list(index.items()):
            try:
                st = os.stat(real)
            except OSError:
                del index[real]  # the source file is gone
                continue
            if isinstance(record, dict) and {k: record.get(k) for k in ("size", "mtime_ns", "inode", "device")} \
                    == _identity(st):
                live.add(entry_dir(str(record.get("sha256"))).name)
            else:
                del index[real]  # changed since it was hashed: hashed again on its next use
        if len(index) != before:
            _write_index(index)
        candidates = [(p, _ENTRY, True) for p in directory.iterdir()]
        candidates += [(p, _LEGACY, False) for p in cache_root().iterdir() if p != directory]
        for path, pattern, ours in candidates:
            try:
                if not path.is_dir() or path.is_symlink():
                    continue
                age = now - path.stat().st_mtime
            except OSError:
                continue
            if ours and (_TEMP.fullmatch(path.name) or _QUANT_TEMP.fullmatch(path.name)):
                stale = age > TEMP_AFTER_S
            elif ours and _QUANT_ENTRY.fullmatch(path.name):
                stale = age > UNUSED_AFTER_S or (age > UNREFERENCED_AFTER_S and not _quant_referenced(path, live))
            elif not pattern.fullmatch(path.name):
                continue
            elif ours:
                stale = age > UNUSED_AFTER_S or (path.name not in live and age > UNREFERENCED_AFTER_S)
            else:
                stale = age > UNREFERENCED_AFTER_S and _old_layout_entry(path)
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _old_layout_entry(path: Path) -> bool:
    """Whether a directory is exactly what the mtime-keyed cache wrote (its four files, the
    config keys it wrote): never another program's directory that happens to live there."""
    try:
        if {p.name for p in path.iterdir()} != _LEGACY_FILES:
            return False
        return set(json.loads((path / "config.json").read_text())) == _LEGACY_CONFIG
    except (OSError, ValueError, TypeError):
        return False
