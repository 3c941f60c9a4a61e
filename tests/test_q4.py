"""The q4_1 kernels (pdqueue/models/q4_kernel.c, q4.py, quant.Q41Linear and the q8_0 LM head
quant.Q80Linear): the compiled kernel
against its torch reference bit for bit, on every instruction path this CPU has, a row's
result independent of its batch, the weights' blocks, and the build cache.

Pure tier: no Redis, no worker process (the kernel is built with the system's C compiler
into the test's cache directory)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdqueue.models import q4, quant

pytestmark = pytest.mark.pure

SHAPES = [(960, 576), (3072, 576), (576, 1536), (40, 96), (8, 32)]   # SmolLM2's, and N not a multiple of 16


def compiled() -> q4.Kernel:
    kernel, why = q4.kernel()
    if kernel is None:
        pytest.skip(f"no q4_1 kernel here: {why}")
    return kernel


def paths(kernel: q4.Kernel) -> list[q4.Kernel]:
    """The AVX2 path, and the AVX-512 VNNI one where this CPU has it."""
    avx2 = q4.Kernel(kernel.linear, False, "avx2", kernel.linear8, kernel.lib)
    return [avx2, kernel] if kernel.vnni else [avx2]


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """SmolLM2-like rows: outlier channels, rows of very different scales, a zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * 3
    x[:, 5] *= 50
    if rows > 2:
        x[1] *= 1e4
        x[2] = 0
    return x


@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_equals_its_reference_bit_for_bit_on_every_path(n, k):
    kernel = compiled()
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    blocks = q4.quantize_weight(w)
    layout = q4.interleave(blocks)
    for rows in (1, 3, 8, 33):
        x = activations(rows, k, rows)
        ref = q4.reference_linear(x, blocks["qs"], blocks["d"], blocks["m"])
        for path in paths(kernel):
            assert torch.equal(path(x, layout, n), ref), (path.isa, rows)


@pytest.mark.parametrize("n,k", [(49152, 576), (40, 96)])   # SmolLM2's LM head; N not a multiple of 16
def test_q8_0_head_equals_its_reference_bit_for_bit_on_every_path(n, k):
    kernel = compiled()
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05
    blocks = q4.quantize_weight8(w)
    layout = q4.interleave8(blocks)
    for rows in (1, 3, 8):
        x = activations(rows, k, rows)
        ref = q4.reference_linear8(x, blocks["qs"], blocks["d"])
        for path in paths(kernel):
            assert torch.equal(path.q8(x, layout, n), ref), (path.isa, rows)
    together = kernel.q8(x, layout, n)
    assert all(torch.equal(kernel.q8(x[i:i + 1].contiguous(), layout, n)[0], together[i]) for i in range(8))


def test_a_rows_result_does_not_depend_on_its_batch():
    """Disaggregated == colocated rests on it: a row alone, or among 32 others of any scale."""
    compiled()
    layer = quant.Q41Linear(torch.randn(960, 576, generator=torch.Generator().manual_seed(1)))
    x = activations(33, 576, 7)
    together = layer(x)
    for i in range(33):
        assert torch.equal(layer(x[i:i + 1])[0], together[i]), i
    assert torch.equal(layer(x[5:9]), together[5:9])


def test_layer_is_close_to_float_and_recovers_q4_1_blocks():
    """Weights that are Q4_1 blocks (d * q + m, each block spanning 0..15) come back as the same
    q, d and m, so the only error left is the 8-bit activations (~1%); off-grid weights add theirs."""
    gen = torch.Generator().manual_seed(3)
    n, k = 304, 576
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 0.001).half().float()   # GGUF: float16 d and m
    m = (-8 * d + (torch.rand(n, k // 32, 1, generator=gen) - 0.5) * 0.01).half().float()
    w = (d * q + m).reshape(n, k)
    blocks = q4.quantize_weight(w)
    assert torch.equal(torch.stack((blocks["qs"].reshape(n, -1, 16) & 15, blocks["qs"].reshape(n, -1, 16) >> 4),
                                   -2).reshape(n, -1, 32).float(), q)
    assert torch.equal(blocks["d"].float(), d[..., 0]) and torch.equal(blocks["m"].float(), m[..., 0])
    x = torch.randn(9, k, generator=gen)
    ref = x @ w.T
    err = float((quant.Q41Linear(w)(x) - ref).norm() / ref.norm())
    assert err < 0.02, err
    off = quant.Q41Linear(w + torch.randn(n, k, generator=gen) * 0.003)(x)
    assert float((off - ref).norm() / ref.norm()) > 2 * err


def test_in_features_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.Q41Linear(torch.randn(64, 48))


def test_built_once_then_loaded_from_the_cache(tmp_path):
    """A second process finds the built kernel in the cache (no compiler run), and a process
    told to do without it runs the reference with a warning that says why."""
    compiled()
    env = {"PDQ_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    script = ("import logging, time; logging.basicConfig(level=logging.INFO)\n"
              "from pdqueue.models import q4\n"
              "t = time.monotonic(); k, why = q4.kernel(); print(k.isa if k else 'none', why, time.monotonic() - t)\n")
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and "kernel built" in first.stderr, first.stderr
    [built] = (tmp_path / "kernels").glob("q4-*.so")
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "kernel built" not in second.stderr, second.stderr
    assert list((tmp_path / "kernels").glob("q4-*.so")) == [built]
    off = subprocess.run([sys.executable, "-c", script], env={**env, "PDQ_Q4_KERNEL": "0"}, capture_output=True,
                         text=True, timeout=120)
    assert off.stdout.startswith("none") and "running its reference" in off.stderr, off.stderr


def test_threads_share_the_tiles_and_change_no_bit():
    compiled()
    layer = quant.Q41Linear(torch.randn(3072, 576, generator=torch.Generator().manual_seed(2)))
    x = activations(9, 576, 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), one)
        assert torch.equal(layer(x[:1]), one[:1])
    finally:
        torch.set_num_threads(before)
