"""The decoder layer's small ops in C (pdqueue/models/fused.py, decode_ops.c), which the q4_1
format's forward pass runs: each op against its torch counterpart, decode attention's
independence from the batch and the threads, and the engine's invariances (alone == together,
chunked == prefill_first, preempted == not, copies == gathered, disaggregated == colocated)
with the ops on, through tests/test_engine.py's own checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tests.test_engine as te
from pdqueue.models import fused
from pdqueue.models.decoder import apply_rope
from pdqueue.models.loader import TINY_CONFIG, load_model

pytestmark = pytest.mark.pure

OPS = fused.ops(TINY_CONFIG)
needs_ops = pytest.mark.skipif(OPS is None, reason="the q4_1 kernel library could not be built here (q4.kernel)")
H, HKV, D = 9, 3, 64   # SmolLM2's attention

@needs_ops
def test_rope_is_torchs_rotation():
    torch.manual_seed(0)
    rows = torch.randn(7, (H + 2 * HKV) * D)
    angles = torch.randn(7, D) * 50
    cos, ssin = angles.cos(), angles.sin()
    ssin[:, :D // 2] *= -1
    expected = apply_rope(rows[:, :(H + HKV) * D].view(7, H + HKV, D), cos[:, None], ssin[:, None])
    got = rows.clone()
    OPS.rope_(got, H + HKV, D, cos, ssin)
    # Bit for bit where torch's addcmul is one fused multiply-add (x86-64 builds of torch 2.13).
    torch.testing.assert_close(got[:, :(H + HKV) * D].view(7, H + HKV, D), expected, rtol=0, atol=1e-6)
    assert torch.equal(got[:, (H + HKV) * D:], rows[:, (H + HKV) * D:]), "v rotated too"

@needs_ops
def test_rms_norm_and_silu_match_torch():
    torch.manual_seed(1)
    x, w = torch.randn(5, 576) * 3, torch.randn(576)
    torch.testing.assert_close(OPS.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-6, atol=1e-6)
    gu = torch.randn(5, 2 * 1536) * 6
    gu[0, :8] = torch.tensor([-200.0, -90.0, -30.0, -1e-8, 0.0, 1e-8, 30.0, 90.0])   # exp's clamps
    torch.testing.assert_close(OPS.silu_mul(gu), F.silu(gu[:, :1536]) * gu[:, 1536:], rtol=1e-6, atol=1e-6)

def _copies(lens, seed=2):
    """Per sequence a decode_kv-like copy [2, Hkv, capacity, D] and its META row."""
    gen = torch.Generator().manual_seed(seed)
    copies = [torch.randn(2, HKV, n + 13, D, generator=gen) for n in lens]
    meta = torch.tensor([[c[0].data_ptr(), c[1].data_ptr(), c.shape[2] * D, D, n, 1] for c, n in zip(copies, lens)])
    return copies, meta

@needs_ops
def test_decode_attention_stores_the_new_kv_and_matches_sdpa():
    lens = [1, 5, 37, 300, 2100]
    rows = torch.randn(len(lens), (H + 2 * HKV) * D)
    copies, meta = _copies(lens)
    pool = torch.zeros(2, 64, HKV, D)
    slots = torch.tensor([3, 9, 17, 40, 63])
    out = OPS.decode_attention(rows, H, HKV, D, meta, D ** -0.5, (pool[0], pool[1], slots))
    for i, (c, n) in enumerate(zip(copies, lens)):
        new_k = rows[i, H * D:(H + HKV) * D].view(HKV, D)
        new_v = rows[i, (H + HKV) * D:].view(HKV, D)
        assert torch.equal(c[0, :, n - 1], new_k) and torch.equal(c[1, :, n - 1], new_v)
        assert torch.equal(pool[0, slots[i]], new_k) and torch.equal(pool[1, slots[i]], new_v)
        q = rows[i, :H * D].view(1, HKV, H // HKV, D)
        expected = F.scaled_dot_product_attention(q, c[0, None, :, :n], c[1, None, :, :n], scale=D ** -0.5)
        torch.testing.assert_close(out[i], expected.reshape(H * D), rtol=1e-5, atol=1e-6)

@needs_ops
def test_decode_attention_of_a_sequence_depends_on_nothing_else():
    """The same bits alone or in a batch, on one thread or several (the long context makes the
    call big enough to run on a thread team)."""
    lens = [2100, 7, 900, 1]
    rows = torch.randn(len(lens), (H + 2 * HKV) * D)
    copies, meta = _copies(lens, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = OPS.decode_attention(rows, H, HKV, D, meta, 0.125)
        torch.set_num_threads(2)
        threaded = OPS.decode_attention(rows, H, HKV, D, meta, 0.125)
        alone = [OPS.decode_attention(rows[i:i + 1], H, HKV, D, meta[i:i + 1], 0.125) for i in range(len(lens))]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, threaded)
    assert torch.equal(batch, torch.cat(alone))

@pytest.fixture(scope="module")
def tiny_q41():
    loaded = load_model("tiny", weights="q4_1")
    if loaded.model.fused is None:
        pytest.skip("the q4_1 kernel library could not be built here (q4.kernel)")
    return loaded

@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """The engine checks below run torch on one thread, as in tests/test_engine.py."""

@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_batch_invariance_with_the_ops(tiny_q41, kind):
    te.test_tiny_batch_invariance(tiny_q41, kind)

def test_policies_agree_with_the_ops(tiny_q41):
    """Decode rows beside prompt chunks (mixed steps: gathered K/V) == in pure decode steps (copies)."""
    te.test_tiny_policies_agree(tiny_q41, "sampled")

def test_preemption_by_recompute_with_the_ops(tiny_q41):
    te.test_tiny_preemption_by_recompute(tiny_q41, "chunked")

@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_copies_give_the_gathered_tokens_with_the_ops(tiny_q41, policy):
    te.test_decode_copies_give_the_gathered_tokens(tiny_q41, policy)

def test_disaggregated_matches_colocated_with_the_ops(tiny_q41):
    te.test_tiny_disaggregated_matches_colocated(tiny_q41, "chunked")
