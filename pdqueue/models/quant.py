"""Quantized weights for CPU decoding: linear layers in ``int8`` and ``int4``.

Owns: ``WEIGHT_FORMATS``, ``Int8Linear``, ``Int4Linear``, ``Q41Linear``, ``Q80Linear``,
``quantize_model`` (swap a loaded ``DecoderModel``'s linear layers and LM head for quantized
ones, in place), ``step_weight_bytes`` (the bytes of weights one decode step reads),
``RECIPE_VERSION`` and ``tensor_store`` (how the cache of quantized weights,
``pdqueue.models.quant_cache``, gives the layers their tensors and takes the ones they compute).

Why these kernels (SmolLM2-135M's shapes on a CPU; the figures are in docs/performance.md,
"The engine" and "Quantized weights"): a decode step reads every weight once, so the bytes
decide its speed. Of torch 2.13's own CPU kernels:

- ``int8``: fbgemm's dynamically quantized linear (``torch.ops.quantized.linear_dynamic``,
  the kernel behind ``torch.ao``'s dynamic quantization): int8 weights, per output channel
  scales; the activations are quantized to uint8 on the fly. It is several times faster than
  float32 at batch 1 and stays fast at larger batches. ``torch._weight_int8pack_mm``
  (weight-only int8) is slower than float32 here.
- ``int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (the "tinygemm" layout, bf16
  activations, asymmetric groups of 32 along the input): the fastest at batch 1, but its cost
  grows with the batch almost row for row (it does not reuse the weights across rows as a
  GEMM does).

fbgemm quantizes the activations with one (scale, zero point) for the whole matrix, from its
min and max: 8 bits for the activations cost more than the int8 weights do (SmolLM2's
inputs to q/k/v and down have channels 30-80x the row's median), and a row's result would
depend on the other rows of its batch. ``Int8Linear`` therefore (1) scales each row to an
absolute maximum of 127 and adds one anchor row holding -127.5 and 127.5, so the matrix's
range is always the same and fbgemm's grid is the integers, whatever the batch; and (2)
splits each row into integers (exact on that grid) and the remainder times 255, both as
rows of the same call: about 16 bits of activation for one read of the weights (a decode
step has rows to spare: the kernel is memory-bound there), which brings the divergence from
float32 (KL per token) down by an order of magnitude from plain 8-bit activations.

- ``q4_1``: the same 4-bit blocks as int4 with float scale and minimum, times activations
  quantized to 8 bits per block of 32 (llama.cpp's Q4_1 x Q8_1), in pdqueue's C kernel
  (``models.q4``), which reuses the unpacked weights across the rows of a batch.

``int4`` keeps the LM head in int8 and ``q4_1`` in q8_0 (GGUF's Q8_0 blocks times 8-bit
activations, the same kernel's 8-bit twin): SmolLM2's GGUF stores the embedding (its tied head) in
Q8_0, and 4 bits there would cost far more quality than the 4-bit layers do (their Q4_1
blocks are recovered up to the bf16 rounding of scale and zero).

Imports torch, ``models.q4`` and ``models.fused`` only.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings

import torch
from torch import nn

from pdqueue.models import fused, q4

WEIGHT_FORMATS = ("fp32", "int8", "int4", "q4_1")   # fp32: unquantized (in the engine's --dtype)
INT4_GROUP = 32                             # GGUF Q4_1's block size: its blocks map 1:1
# What the layers' constructors compute from a float weight (the math, the tensors kept):
# bump it whenever that changes. The cache of quantized weights (``pdqueue.models.
# quant_cache``) is keyed by it, so an entry made by other math is never loaded.
RECIPE_VERSION = 1

_STORE: contextvars.ContextVar = contextvars.ContextVar("pdqueue_quant_store", default=None)


@contextlib.contextmanager
def tensor_store(store):
    """While inside, each quantized layer made takes its quantized tensors from
    ``store.get(kind, weight)`` when that returns them (the cache of quantized weights), and
    hands the ones it computes to ``store.put(kind, weight, tensors)``; both keyed by the
    float weight (the parameter) it was given."""
    token = _STORE.set(store)
    try:
        yield store
    finally:
        _STORE.reset(token)


def check_format(weights: str) -> str:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    return weights


_EDGE = 127.5   # activations are fed in [-127.5, 127.5]: fbgemm then quantizes with scale 1, zero point 128


class Int8Linear(nn.Module):
    """``y = x @ W.T`` with W in int8, one float scale per output row (fbgemm).
    The input must be float32 [T, in_features]."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        store = _STORE.get()
        stored = None if store is None else store.get("int8", weight)
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():   # quantized tensors are "deprecated"; the op is the kernel we want
            warnings.simplefilter("ignore")
            if stored is None:
                w = weight.detach().float()
                scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
                qweight = torch.quantize_per_channel(w, scales.double(), zeros, 0, torch.qint8)
                if store is not None:
                    store.put("int8", weight, {"q": qweight.int_repr(), "scales": scales})
            else:   # the same quantized tensor (int8 values, scales, zero points), from the cache
                qweight = torch._make_per_channel_quantized_tensor(stored["q"], stored["scales"].double(), zeros, 0)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.nbytes = weight.numel() + 4 * self.out_features   # int8 weights + float scales
        # The row that fixes the activations' range (so their grid) whatever the batch.
        self.register_buffer("_anchor", torch.zeros(1, self.in_features), persistent=False)
        self._anchor[0, 0], self._anchor[0, -1] = -_EDGE, _EDGE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:   # the model's activations are [tokens, features] already
            return self(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        n = x.shape[0]
        # Few, in-place elementwise ops: at batch 1 their fixed costs are a third of the call.
        step = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_(min=1e-30).mul_(1 / 127.0)
        u = torch.div(x, step)                # each row in [-127, 127]
        hi = torch.round(u)                   # integers: fbgemm's grid for [-127.5, 127.5] is the integers
        lo = u.sub_(hi).mul_(255.0)           # the remainder (|.| <= 0.5) in the same range
        y = torch.ops.quantized.linear_dynamic(torch.cat((hi, lo, self._anchor)), self._packed, False)
        return y[:n].add_(y[n:2 * n], alpha=1 / 255).mul_(step)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int4Linear(nn.Module):
    """``y = x @ W.T`` with W in 4 bits: asymmetric groups of ``group`` weights along the
    input, ``w = (q - 8) * scale + zero`` with bf16 scale and zero (tinygemm's layout, the
    same values as GGUF Q4_1's ``d * q + m``). Activations go through bf16."""

    def __init__(self, weight: torch.Tensor, group: int = INT4_GROUP):
        super().__init__()
        self.out_features, self.in_features = n, k = weight.shape
        if k % group or n % 16:
            raise ValueError(f"int4: a {n} x {k} weight; the kernel needs out_features a multiple of 16 and "
                             f"in_features a multiple of the group size {group}")
        self.group = group
        store = _STORE.get()
        kind = f"int4g{group}"
        stored = None if store is None else store.get(kind, weight)
        if stored is None:
            g = weight.detach().float().reshape(n, k // group, group)
            lo, hi = g.amin(dim=-1), g.amax(dim=-1)
            scale = ((hi - lo) / 15).clamp(min=1e-12)
            q = torch.clamp(torch.round((g - lo[..., None]) / scale[..., None]), 0, 15).to(torch.int32).reshape(n, k)
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            zero = lo + 8 * scale
            # [k / group, n, 2] (scale, zero) as the kernel expects
            self._scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
            if store is not None:   # torch's packed layout as it is: the cache's key holds torch's version
                store.put(kind, weight, {"packed": self._packed, "scales_zeros": self._scales_zeros})
        else:
            self._packed, self._scales_zeros = stored["packed"], stored["scales_zeros"]
        self.nbytes = n * k // 2 + self._scales_zeros.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:   # the model's activations are [tokens, features] already
            return self(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self._packed, self.group,
                                                       self._scales_zeros)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group}"


def _stored(kind: str, weight: torch.Tensor, quantize) -> dict[str, torch.Tensor]:
    """``quantize(weight)``'s tensors, from the store (``tensor_store``) when it has them, else
    computed and handed to it."""
    store = _STORE.get()
    tensors = None if store is None else store.get(kind, weight)
    if tensors is None:
        tensors = quantize(weight)
        if store is not None:
            store.put(kind, weight, tensors)
    return tensors


class _KernelLinear(nn.Module):
    """What ``Q41Linear`` and ``Q80Linear`` share: blocks from the store (or made), kept in the
    layout that runs here (the kernel's tiles, or the blocks its torch reference reads), and
    a float32 [T, in_features] input."""
    kind = ""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        stored = _stored(self.kind, weight, self.quantize)
        self.nbytes = sum(t.numel() * t.element_size() for t in stored.values())
        self._kernel, _ = q4.kernel()
        self._layout = self.interleave(stored) if self._kernel is not None else stored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:   # the model's activations are [tokens, features] already
            return self(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        if self._kernel is None:
            return self.reference(x)
        return self.compiled(x.contiguous())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} x 8-bit activations"


class Q41Linear(_KernelLinear):
    """``y = x @ W.T`` with W in GGUF Q4_1 blocks of 32 (``w = d * q + m``, float16 d and m) and
    the activations quantized to 8 bits per block of 32: llama.cpp's arithmetic, in
    pdqueue's kernel (``models.q4``: why, and what runs without a C compiler)."""
    kind = "q4_1"
    quantize = staticmethod(q4.quantize_weight)
    interleave = staticmethod(q4.interleave)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return q4.reference_linear(x, self._layout["qs"], self._layout["d"], self._layout["m"])

    def compiled(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self._layout, self.out_features)


class Q80Linear(_KernelLinear):
    """``y = x @ W.T`` with W in GGUF Q8_0 blocks of 32 (``w = d * q``, float16 d) and the
    activations quantized to 8 bits per block of 32: the q4_1 format's LM head, in pdqueue's
    kernel (``models.q4``)."""
    kind = "q8_0"
    quantize = staticmethod(q4.quantize_weight8)
    interleave = staticmethod(q4.interleave8)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return q4.reference_linear8(x, self._layout["qs"], self._layout["d"])

    def compiled(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel.q8(x, self._layout, self.out_features)


class Biased(nn.Module):
    """A quantized layer and the float bias it keeps (Qwen2's q/k/v)."""

    def __init__(self, layer: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.layer, self.bias = layer, nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.forward(x).add_(self.bias)


_QUANT = {"int8": Int8Linear, "int4": Int4Linear, "q4_1": Q41Linear}
# The LM head: int8 (fbgemm) beside torch's kernels, q8_0 beside pdqueue's.
_HEAD = {"int8": Int8Linear, "int4": Int8Linear, "q4_1": Q80Linear}


def quantize_model(model, weights: str):
    """Replace every linear layer of ``model`` (a ``DecoderModel``: q/k/v, o, gate/up, down
    in each layer) with ``weights``' quantized layer and its LM head with an int8 one; the
    embedding and the norms stay as they are. A tied LM head gets its own quantized copy of
    the embedding matrix (the lookup keeps the float one). ``fp32``: the model unchanged."""
    check_format(weights)
    model.weights_format = weights
    if weights == "fp32":
        return model
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError(f"--weights {weights} needs --dtype float32 (its kernels take float32 activations)")
    if model.config.moe is not None:
        raise ValueError(f"--weights {weights}: a mixture-of-experts model's experts are held in float only "
                         "(use --weights fp32)")
    quantized = _QUANT[weights]

    def make(linear: nn.Linear) -> nn.Module:
        layer = quantized(linear.weight)
        return layer if linear.bias is None else Biased(layer, linear.bias)

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = make(attn.qkv_proj)
        attn.o_proj = make(attn.o_proj)
        mlp.gate_up_proj = make(mlp.gate_up_proj)
        mlp.down_proj = make(mlp.down_proj)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.logits_head = _HEAD[weights](head)   # 8 bits for int4 and q4_1 too: see the module docstring
    model.lm_head = None   # an untied float head is not kept: compute_logits uses logits_head
    if weights == "q4_1":   # its own library runs the layer's small ops too (None: torch's, without it)
        model.fused = fused.ops(model.config)
    return model


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every linear layer (quantized or not), the
    norms and the LM head; the embedding only where it is the (float) LM head."""
    total = 0
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear, _KernelLinear)):
            total += module.nbytes
        elif isinstance(module, nn.Linear) and module.weight.numel():
            total += module.weight.numel() * module.weight.element_size()
        elif type(module).__name__ == "RMSNorm":
            total += module.weight.numel() * module.weight.element_size()
    if getattr(model, "logits_head", None) is None and model.lm_head is None:
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total

