"""The cache of quantized weights: ``--weights int8|int4`` layers made once per model, then
read back at each load instead of quantized again.

Owns: ``quantize`` (``quant.quantize_model`` with its tensors taken from, or written to, the
cache), ``CACHE_STATES``. Where entries live, their manifest, the swap into place and
pruning are ``pdqueue.models.cache``'s (see its docstring: ``models/quant-<key>/``).

The key is the float weights' identity (``LoadedModel.fingerprint``: a GGUF file's SHA-256,
a Hugging Face directory's safetensors names/sizes/mtimes), the format, the recipe
(``quant.RECIPE_VERSION``) and torch's version (int4 is stored in torch's internal packed
layout, and the quantizing ops are torch's). The built-in ``tiny`` model is not cached (it
quantizes in milliseconds; its fingerprint names no file). An entry is one safetensors file
of plain tensors, read without unpickling anything:

- int8: each layer's int8 weights and float32 per-row scales; fbgemm's ``linear_prepack``
  runs at load (its packed object is no tensor), on the same quantized tensor, so the layer
  is bit-identical to one quantized from float32;
- int4: torch's packed tinygemm layout as ``_convert_weight_to_int4pack_for_cpu`` returned
  it, and the bf16 scales/zeros: loading is a read (storing the 4-bit values instead would
  pack them again at every load, far slower than reading the packed ones).

The quantized layers are found by the float parameter each was made from (its name in the
model), through ``quant.tensor_store``: ``quantize_model`` stays the one place that decides
what is quantized. A layer the entry lacks is quantized, and the entry is then written again
whole. An entry that cannot be read (cut short, not safetensors) is quantized afresh and
replaced.

Imports torch, safetensors and ``pdqueue.models`` modules only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pdqueue.models import cache, quant

# What ``quantize`` did: read the entry; made the layers and wrote the entry; made the layers
# without the cache (``use_cache=False``, ``tiny``, or the cache could not be written).
CACHE_STATES = ("hit", "written", "off")


class _Store:
    """The tensors of one entry, by "<kind>/<parameter name>/<tensor>"; for ``quant.tensor_store``."""

    def __init__(self, model, tensors: dict[str, torch.Tensor]):
        self.names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        self.layers: dict[str, dict[str, torch.Tensor]] = {}   # "<kind>/<parameter name>" -> its tensors
        for key, tensor in tensors.items():
            layer, _, field = key.rpartition("/")
            self.layers.setdefault(layer, {})[field] = tensor
        self.missed = 0

    def _layer(self, kind: str, weight) -> str | None:
        name = self.names.get(id(weight))
        return None if name is None else f"{kind}/{name}"

    def get(self, kind: str, weight) -> dict[str, torch.Tensor] | None:
        found = self.layers.get(self._layer(kind, weight))
        if not found:
            self.missed += 1
        return found or None

    def put(self, kind: str, weight, tensors: dict[str, torch.Tensor]) -> None:
        layer = self._layer(kind, weight)
        if layer is not None:
            self.layers[layer] = {field: t.contiguous() for field, t in tensors.items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{layer}/{field}": t for layer, fields in self.layers.items() for field, t in fields.items()}


def _source_of(fingerprint: str, source: Path | None) -> dict | None:
    """What the entry records it was made from (for pruning), or None: not cached."""
    if source is None or not fingerprint or fingerprint == "tiny":
        return None
    if Path(source).is_dir():
        return {"fingerprint": fingerprint, "directory": str(Path(source).resolve())}
    return {"fingerprint": fingerprint, "gguf_sha256": fingerprint, "source": str(source)}


def quantize(model, weights: str, fingerprint: str, source: Path | None, use_cache: bool = True) -> str:
    """``quant.quantize_model(model, weights)``, its quantized tensors read from the cache
    entry of (``fingerprint``, ``weights``, recipe, torch) when there is a whole one, else
    computed and written there. ``source``: the GGUF file or directory the float weights
    came from (None: ``tiny``). Returns one of ``CACHE_STATES``; also set as
    ``model.quant_cache``."""
    made_from = _source_of(fingerprint, source) if use_cache else None
    if weights == "fp32" or made_from is None:
        quant.quantize_model(model, weights)
        model.quant_cache = "off"
        return "off"
    key = cache.quant_key(fingerprint, weights, quant.RECIPE_VERSION, torch.__version__)
    entry = cache.quant_entry_dir(key)
    stored, unreadable = None, False
    if cache.quant_entry_ok(entry, key):
        from safetensors.torch import load_file

        try:
            stored = load_file(str(entry / cache.QUANT_FILE))
        except Exception:   # safetensors' own error type for a damaged header or short data
            unreadable = True
    store = _Store(model, stored or {})
    with quant.tensor_store(store):
        quant.quantize_model(model, weights)
    if stored is not None and not store.missed:
        cache.mark_used(entry)
        state = "hit"
    else:
        state = "written" if _write(store.tensors(), key, {**made_from, "weights": weights,
                                                         "recipe": quant.RECIPE_VERSION,
                                                         "torch": torch.__version__},
                                    replace=unreadable or stored is not None) else "off"
    try:
        cache.prune()
    except OSError:
        pass  # a read-only or vanished cache directory: nothing to prune
    model.quant_cache = state
    return state


def _write(tensors: dict[str, torch.Tensor], key: str, made_from: dict, replace: bool) -> bool:
    from safetensors.torch import save_file

    try:
        tmp = cache.new_quant_tmp(key)
    except OSError:
        return False   # a read-only cache: quantized again next time
    try:
        save_file(tensors, str(tmp / cache.QUANT_FILE))
        cache.install_quant(tmp, key, made_from, replace=replace)
        return True
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # left only when writing failed
