"""The paged KV pool's layout, and the pool tensor itself.

The pool is one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 of dim 1 holds K, index 1 holds V). It can live inside a caller-given buffer (the
shared-memory transport hands one in) so that prefill writes KV exactly once and a decode
worker on the same host copies blocks straight out of it.

Imports torch only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block in one (layer, K-or-V) plane."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def token_nbytes(self) -> int:
        """KV bytes of one token across all layers, K and V."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_nbytes

    def compatible_with(self, other: "KVCacheLayout") -> bool:
        """Blocks can be copied between pools of these layouts (pool sizes may differ)."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype) == (
            other.num_layers, other.block_size, other.num_kv_heads, other.head_dim, other.dtype)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVCacheLayout":
        fields = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype")
        return cls(**{k: data[k] for k in fields})

    def check_pool(self, pool: torch.Tensor) -> None:
        """ValueError unless ``pool`` is a pool tensor of exactly this layout."""
        if tuple(pool.shape) != self.shape or pool.dtype != self.torch_dtype:
            raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} does not match {self}")

    def allocate(self, buffer=None, device: str | torch.device = "cpu") -> torch.Tensor:
        """A zeroed pool tensor, or a view over ``buffer`` (writable, >= nbytes, not zeroed).

        The caller owns ``buffer`` and must keep it alive as long as the tensor is used.
        """
        if buffer is None:
            return torch.zeros(self.shape, dtype=self.torch_dtype, device=device)
        flat = torch.frombuffer(buffer, dtype=self.torch_dtype, count=self.nbytes // self.itemsize)
        return flat.view(self.shape)
