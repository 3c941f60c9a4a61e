"""The decoder layer's small operations in C (``decode_ops.c``, in the q4_1 kernel's library):
RMSNorm, RoPE, SiLU x up, and decode attention over each sequence's K/V for the whole batch in
one call per layer. The q4_1 format's forward pass uses them (``quantize_model`` sets
``DecoderModel.fused``); other formats, and machines where the library could not be built, run
the same layer in torch ops.

Why: at batch 1 a q4_1 step spent nearly as long in its many small torch ops (their fixed
costs, not their bytes) as in reading its weights (docs/performance-history.md, "the q4_1
kernel against llama.cpp in the same sitting"). Each
sequence's numbers are still its own (no dependence on the batch, the threads or the ISA), so
disaggregated == colocated holds; against the torch ops they differ in the last bits (RMSNorm,
SiLU and softmax sum in their own order; RoPE is bit for bit torch's).

Imports torch and ``models.q4`` only.
"""

from __future__ import annotations

import ctypes
import os

import torch

from pdqueue.models import q4

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
META = 6   # per sequence: k address, v address, head stride, token stride, tokens, store (decode_ops.c)


class FusedOps:
    def __init__(self, lib):
        self._rms = _fn(lib.pdq_rms_norm, None, [_P, _P, _I, _I, _F, _P])
        self._silu = _fn(lib.pdq_silu_mul, None, [_P, _I, _I, _P])
        self._rope = _fn(lib.pdq_rope, None, [_P, _I, _I, _I, _I, _P, _P])
        self._attend = _fn(lib.pdq_decode_attention, ctypes.c_int,
                           [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _F, _P, ctypes.c_int])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, K] float32 contiguous (K a multiple of 16) -> a new [T, K]."""
        y = torch.empty_like(x)
        self._rms(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, y.data_ptr())
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
        rows, width = gate_up.shape
        y = gate_up.new_empty(rows, width // 2)
        self._silu(gate_up.data_ptr(), rows, width // 2, y.data_ptr())
        return y

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """Rotate the first ``heads`` heads of each row of ``x`` [T, >= heads * head_dim] in
        place; ``cos``, ``signed_sin`` [T, head_dim] contiguous (``models.decoder.apply_rope``)."""
        self._rope(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(), signed_sin.data_ptr())

    def decode_attention(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, meta: torch.Tensor,
                         scale: float, pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """One query per row of ``qkv`` ([B, (H + 2 Hkv) D] rows: q, the new k, the new v, rotated)
        against each sequence's K/V as ``meta`` [B, META] int64 says; ``pool``: (the layer's K
        plane, its V plane, the slots) to store the new K/V in first. -> [B, H * D]."""
        rows = qkv.shape[0]
        out = qkv.new_empty(rows, heads * head_dim)
        pk, pv, slots = (p.data_ptr() for p in pool) if pool is not None else (None, None, None)
        if self._attend(qkv.data_ptr(), rows, qkv.stride(0), heads, kv_heads, head_dim, pk, pv, slots,
                        meta.data_ptr(), scale, out.data_ptr(), torch.get_num_threads()):
            raise MemoryError("decode attention: no memory for its score buffer")
        return out


def _fn(fn, restype, argtypes):
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def ops(config) -> FusedOps | None:
    """The ops for a model of ``config`` (a ``ModelConfig``) from the compiled library, or None
    where it could not be built (q4.kernel says why) or the shapes do not fit its vectors
    (head_dim and hidden_size multiples of 16, intermediate_size of 8) or the model is not
Llama-shaped (``ModelConfig.plain_attention``, SwiGLU, no sandwich norms). ``PDQ_FUSED_OPS=0``: None
    (torch's ops; for comparisons)."""
    if os.environ.get("PDQ_FUSED_OPS", "1") == "0":
        return None
    kernel, _ = q4.kernel()
    if kernel is None or config.head_dim % 16 or config.hidden_size % 16 or config.intermediate_size % 8:
        return None
    if not config.plain_attention or config.sandwich_norms or config.activation != "silu" or config.moe:
        return None   # the kernels implement Llama's layer: other families run torch's ops on q4_1 weights
    return FusedOps(kernel.lib)
