"""The ``q4_1`` weight format: GGUF Q4_1 blocks (4-bit weights, a float16 scale and minimum
per 32) times 8-bit activations, llama.cpp's arithmetic, in a C kernel of pdqueue's own; and
its LM head in Q8_0 the same way.

Owns: ``quantize_weight`` / ``quantize_weight8`` (float [N, K] -> the blocks), ``interleave`` /
``interleave8`` (the blocks -> the kernel's tiles), ``reference_linear`` / ``reference_linear8``
(the kernel's arithmetic in torch ops, bit for bit) and ``kernel`` (the compiled library,
built once per machine and cached, or None with the reason). The layers are
``models.quant.Q41Linear`` and ``Q80Linear``.

Why: torch's int4 kernel (``int4``, tinygemm) dequantizes its weights again for every row, so
a decode step's cost grows with its batch (docs/performance.md, "The engine"). The kernel in
``q4_kernel.c`` quantizes each row's activations to int8 in blocks of 32 and computes each
block's dot product in integers (exact), 16 outputs per AVX-512 VNNI instruction (8 with AVX2)
from weights unpacked once per call for all the rows of the step. A row's result does not
depend on the other rows, the path or the threads (disaggregated == colocated token for
token), and ``reference_linear`` gives the same bits: what the tests check, and what runs
where no C compiler is found (much slower, with a log line saying so).

The library is compiled at first use with the system's C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``) into ``<cache_root>/kernels/q4-<hash of source, flags and compiler>.so``:
a worker's second start loads it (milliseconds). docs/architecture/quantized-weights.md, "The q4_1 kernel",
has the layout and the measurements.

Imports torch and ``pdqueue.models.cache`` only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdqueue.models import cache

log = logging.getLogger(__name__)

BLOCK = 32
# One library: the 4-bit and 8-bit linear layers, and the decoder layer's small ops (models.fused).
_SOURCES = [Path(__file__).with_name("q4_kernel.c"), Path(__file__).with_name("decode_ops.c")]
# No -march=native: a binary built for the build host's newest extensions can die with
# SIGILL on a VM that advertises them. The AVX2 and AVX-512 functions carry their own target
# attributes (the latter runs only where the CPU has it); the rest is baseline x86-64.
_FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fPIC", "-shared"]
# Threads through OpenMP: its libgomp.so.1 is the one torch has loaded already (same soname),
# so torch and the kernel share one thread pool. Without OpenMP the kernel runs on one thread.
_OPENMP = ["-fopenmp"]
TILE = 16   # outputs per tile of the interleaved layout


# --- the weights ------------------------------------------------------------------------

def quantize_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float [N, K] -> {"qs": uint8 [N, K/2] (block b's 16 bytes at 16 b, byte j: q[j] |
    q[j+16] << 4, GGUF's order), "d", "m": float16 [N, K/32]}: per block of 32 along the input,
    ``w ~= d * q + m`` with q in 0..15 from the block's min and max, d and m in float16 as
    GGUF stores them (a GGUF Q4_1 block dequantized to float comes back as the same q, d, m)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"q4_1: a {n} x {k} weight; in_features must be a multiple of {BLOCK}")
    g = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d = ((hi - lo) / 15).clamp(min=1e-7).half()   # 1e-7: float16's subnormals, never 0
    m = lo.half()
    q = torch.round((g - m.float()[..., None]) / d.float()[..., None])
    q = torch.clamp(q, 0, 15).to(torch.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
    return {"qs": qs.contiguous(), "d": d.contiguous(), "m": m.contiguous()}


def interleave(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``quantize_weight``'s blocks -> the kernel's layout (``q4_kernel.c``): tiles of 16
    outputs (zero outputs added up to a multiple of 16), per tile and block 256 bytes where
    byte 4t + i of group p holds output t's q[4p + i] (low nibble) and q[4p + 16 + i] (high);
    d and m as [tiles, blocks, 16] float16."""
    qs, d, m = tensors["qs"], tensors["d"], tensors["m"]
    n, nb = d.shape
    pad = -n % TILE
    tiles = (n + pad) // TILE
    q = qs.reshape(n, nb, BLOCK // 2)
    q = torch.stack((q & 0x0F, q >> 4), dim=-2).reshape(n, nb, BLOCK)          # [N, blocks, 32] in 0..15
    q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad)).view(tiles, TILE, nb, BLOCK).transpose(1, 2)
    low, high = q[..., :16].reshape(tiles, nb, TILE, 4, 4), q[..., 16:].reshape(tiles, nb, TILE, 4, 4)
    packed = (low | (high << 4)).transpose(2, 3).reshape(tiles, nb, TILE * 16)  # [tile, block, p, t, i]
    return {"w": packed.contiguous(), "d": _tiled_scales(d, pad), "m": _tiled_scales(m, pad)}


def _tiled_scales(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Per-block scales [N, blocks] -> [tiles, blocks, 16] float16, zero outputs added (``pad``)."""
    n, nb = t.shape
    padded = torch.nn.functional.pad(t.half(), (0, 0, 0, pad))
    return padded.view((n + pad) // TILE, TILE, nb).transpose(1, 2).contiguous()


def quantize_weight8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float [N, K] -> {"qs": int8 [N, K], "d": float16 [N, K/32]}: GGUF Q8_0 blocks, ``w ~= d * q``
    with ``d = amax / 127`` per block of 32 (a Q8_0 block dequantized to float comes back)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"q8_0: a {n} x {k} weight; in_features must be a multiple of {BLOCK}")
    g = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (g.abs().amax(dim=-1) / 127).clamp(min=1e-7).half()
    q = torch.clamp(torch.round(g / d.float()[..., None]), -127, 127).to(torch.int8)
    return {"qs": q.reshape(n, k).contiguous(), "d": d.contiguous()}


def interleave8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``quantize_weight8``'s blocks -> the q8_0 kernel's layout: tiles of 16 outputs, per tile
    and block 512 bytes where byte 4t + i of group p holds output t's q[4p + i] + 128."""
    qs, d = tensors["qs"], tensors["d"]
    n, nb = d.shape
    pad = -n % TILE
    tiles = (n + pad) // TILE
    q = (qs.to(torch.int16) + 128).to(torch.uint8)
    q = torch.nn.functional.pad(q, (0, 0, 0, pad), value=128)   # zero weights
    q = q.view(tiles, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, nb, TILE * BLOCK)
    return {"w": q.contiguous(), "d": _tiled_scales(d, pad)}


# --- the arithmetic, in torch ops ---------------------------------------------------------

def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (qa [M, K/32, 32] int8 values as float, da, sa [M, K/32]): per block,
    ``da = amax / 127``, ``qa = round(x / da)`` (to the nearest even), ``sa = da * sum(qa)``."""
    m, k = x.shape
    xb = x.reshape(m, k // BLOCK, BLOCK)
    da = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(da != 0, 1.0 / da, torch.zeros_like(da))
    qa = torch.round(xb * inv[..., None])
    sa = da * qa.sum(dim=-1)   # integers below 2**24: the float sum is exact
    return qa, da, sa


def reference_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``q4_kernel.c``'s ``pdq_q4_linear`` in torch ops, bit for bit: x [M, K] float32, the
    weight's blocks as ``quantize_weight`` made them (d and m [N, K/32]) -> y [M, N]."""
    rows, k = x.shape
    n, nb = qs.shape[0], k // BLOCK
    qa, da, sa = quantize_activations(x.float())
    qs = qs.reshape(n, nb, BLOCK // 2)
    q = torch.stack((qs & 0x0F, qs >> 4), dim=-2).reshape(n, nb, BLOCK)   # per block: low nibbles, then high
    # Each block's integer dot product, exact in float64 (|sum| <= 32 * 15 * 127).
    isum = torch.einsum("rbj,nbj->rnb", qa.double(), q.double()).float()
    macc = torch.zeros(rows, n)
    m = m.float()   # float16 -> float32 is exact
    for b in range(nb):   # the kernel's order: block by block
        macc = macc + m[None, :, b] * sa[:, None, b]
    return _scaled_block_sums(isum, d, da) + macc


def _scaled_block_sums(isum: torch.Tensor, d: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """Sum over the blocks, in order, of each block's integer sum [M, N, blocks] times its
    weight scale d [N, blocks] (float16, widened exactly) times its activation scale da
    [M, blocks]: the float part both kernels share."""
    rows, n, nb = isum.shape
    d = d.float()
    acc = torch.zeros(rows, n)
    for b in range(nb):
        acc = acc + isum[..., b] * (d[None, :, b] * da[:, None, b])
    return acc


def reference_linear8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``pdq_q8_linear`` in torch ops, bit for bit: x [M, K] float32, ``quantize_weight8``'s
    blocks -> y [M, N]."""
    k = x.shape[1]
    n, nb = qs.shape[0], k // BLOCK
    qa, da, _ = quantize_activations(x.float())
    isum = torch.einsum("rbj,nbj->rnb", qa.double(), qs.reshape(n, nb, BLOCK).double()).float()
    return _scaled_block_sums(isum, d, da)


# --- the compiled kernel --------------------------------------------------------------------

@dataclass(frozen=True)
class Kernel:
    """The compiled library's linear layers and the path they take on this CPU."""
    linear: object    # ctypes pdq_q4_linear
    vnni: bool        # the AVX-512 VNNI path (else AVX2): the same bits either way
    isa: str
    linear8: object   # ctypes pdq_q8_linear
    lib: object       # the whole library (models.fused takes the decoder layer's small ops from it)

    def __call__(self, x: torch.Tensor, layout: dict[str, torch.Tensor], out_features: int) -> torch.Tensor:
        """x [M, K] float32 contiguous, ``interleave``'s layout -> y [M, out_features]."""
        y = torch.empty(x.shape[0], out_features)
        if self.linear(x.data_ptr(), x.shape[0], x.shape[1], layout["w"].data_ptr(), layout["d"].data_ptr(),
                       layout["m"].data_ptr(), out_features, y.data_ptr(), self.vnni, torch.get_num_threads()):
            raise MemoryError("q4_1 kernel: no memory for its activation buffer")
        return y

    def q8(self, x: torch.Tensor, layout: dict[str, torch.Tensor], out_features: int) -> torch.Tensor:
        """x [M, K] float32 contiguous, ``interleave8``'s layout -> y [M, out_features]."""
        y = torch.empty(x.shape[0], out_features)
        if self.linear8(x.data_ptr(), x.shape[0], x.shape[1], layout["w"].data_ptr(), layout["d"].data_ptr(),
                        out_features, y.data_ptr(), self.vnni, torch.get_num_threads()):
            raise MemoryError("q8_0 kernel: no memory for its activation buffer")
        return y


_KERNEL: tuple[Kernel | None, str] | None = None   # (the kernel or None, why not)
# How this process got it: {"isa", "built" (compiled now, not found in the cache), "seconds"
# (building or loading it)}; reported by `bench engine`.
KERNEL_INFO: dict = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cc: str, flags: list[str]) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    sources = b"".join(s.read_bytes() for s in _SOURCES)
    digest = hashlib.sha256(sources + repr((flags, version)).encode()).hexdigest()[:16]
    target = cache.cache_root() / "kernels" / f"q4-{digest}.so"
    if target.exists():
        return target
    KERNEL_INFO["built"] = True
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fd, tmp = tempfile.mkstemp(prefix=".q4-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, *map(str, _SOURCES), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)   # atomic: a worker building beside this one reads a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("q4_1: kernel built in %.1f s with %s (cached at %s)", time.monotonic() - started, cc, target)
    return target


def kernel() -> tuple[Kernel | None, str]:
    """(the compiled kernel, "") or (None, why the torch reference runs instead). Built or
    loaded once per process. ``PDQ_Q4_KERNEL=0``: the reference; ``PDQ_Q4_ISA=avx2``: the
    AVX2 path on a CPU with AVX-512 VNNI (tests compare the two)."""
    global _KERNEL
    if _KERNEL is None:
        started = time.monotonic()
        KERNEL_INFO["built"] = False
        _KERNEL = _load()
        KERNEL_INFO.update(isa=_KERNEL[0].isa if _KERNEL[0] else f"reference ({_KERNEL[1]})",
                           seconds=time.monotonic() - started)
        if _KERNEL[0] is None:
            log.warning("q4_1: %s; running its reference in torch ops (the same numbers, much slower)",
                        _KERNEL[1])
    return _KERNEL


def _load() -> tuple[Kernel | None, str]:
    if os.environ.get("PDQ_Q4_KERNEL", "1") == "0":
        return None, "PDQ_Q4_KERNEL=0"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"this CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found ($CC, cc, gcc, clang); install gcc or clang for the fast kernel"
    try:
        try:
            lib = ctypes.CDLL(str(_build(cc, _FLAGS + _OPENMP)))
        except (OSError, RuntimeError) as exc:   # a compiler without OpenMP (clang without libomp)
            log.info("q4_1: no OpenMP build (%s); the kernel runs on one thread", str(exc)[-200:])
            lib = ctypes.CDLL(str(_build(cc, _FLAGS)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"the kernel could not be built: {exc}"
    fn = lib.pdq_q4_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn8 = lib.pdq_q8_linear
    fn8.restype = ctypes.c_int
    fn8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    vnni = bool(lib.pdq_q4_has_vnni()) and os.environ.get("PDQ_Q4_ISA", "") != "avx2"
    return Kernel(fn, vnni, "avx512-vnni" if vnni else "avx2", fn8, lib), ""
