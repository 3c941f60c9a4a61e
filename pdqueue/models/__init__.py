"""The model layer: the decoder of every supported family (``families``) with paged attention,
its loaders and tokenizers.

Owns everything under ``pdqueue.models``. Imports torch, numpy, gguf, tokenizers, jinja2 and
safetensors only (never redis, zmq or ``pdqueue.engine``). Submodules are imported lazily so
``import pdqueue.models.tokenizer`` does not pull in the loader.
"""

__all__ = ["AttentionBatch", "DecoderModel", "FAMILIES", "IncrementalDetokenizer", "LoadedModel", "ModelConfig",
           "ModelSourceError", "Tokenizer", "load_model", "model_config_for", "resolve_model_path"]

_WHERE = {
    "AttentionBatch": "attention", "DecoderModel": "decoder", "ModelConfig": "config", "FAMILIES": "families",
    "IncrementalDetokenizer": "tokenizer", "Tokenizer": "tokenizer",
    "LoadedModel": "loader", "load_model": "loader", "model_config_for": "loader",
    "resolve_model_path": "source", "ModelSourceError": "source",  # torch-free
}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"pdqueue.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'pdqueue.models' has no attribute {name!r}")
