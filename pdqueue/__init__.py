"""pdqueue: LLM serving with prefill and decode disaggregated over a message-queue pipeline.

``from pdqueue import Client`` imports neither torch nor the model code: producers only
need redis.
"""

__version__ = "0.1.0"

__all__ = ["Client", "AsyncClient", "__version__"]


def __getattr__(name):
    if name in ("Client", "AsyncClient"):
        from pdqueue import client

        return getattr(client, name)
    raise AttributeError(f"module 'pdqueue' has no attribute {name!r}")
