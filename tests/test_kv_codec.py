"""KV formats (pdqueue/engine/kv_codec.py) where KV rests and travels.

What must hold:
- the codec alone: every format round-trips every pool dtype within its bound (native bit
  for bit; fp16 to float16's rounding, clamped at its range; int8 to half a step of its
  group's scale, max|x| / 254), odd block sizes and head counts included; any range of
  planes and blocks encodes to the same bytes as the whole; a block payload decodes as
  what it is, whatever the codec's own format;
- the tiers: payloads are stored in the tier's format (fewer bytes), a disk file's header
  names its format and a file of another format is decoded as what it is (never read as
  this tier's), files of the first version are native, a header of an unknown format or a
  payload of the wrong size is a miss;
- the wires, in one process (a real ``KVSender`` and ``KVReceiver`` over real sockets): tcp
  and zmq move a ticket's blocks in the asked format, into shuffled destination blocks,
  the bytes moved shrinking by the format's factor; a sender that does not know the ask
  sends native, which the receiver reads as such; shm stays a bit-exact copy;
- ``bench quality``'s KV part runs on the tiny model (native's round trip is the identity).
Real worker processes in the PD pipeline: tests/test_kv_formats_pipeline.py.
"""

from __future__ import annotations

import random
import uuid

import pytest
import torch

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.engine.kv_codec import FORMATS, FP16_MAX, KVCodec, effective
from pdqueue.engine.kv_tiers import _HEADER, _HEADER_V1, _MAGIC_V1, DiskTier, KVTiers
from pdqueue.transfer import KVReceiver, KVSender
from pdqueue.transfer.blocks import planes
from pdqueue.transfer.sender_admission import Admission

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def random_pool(layout: KVCacheLayout, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(layout.shape, generator=gen) * scale).to(layout.torch_dtype)


def bound(fmt: str, x: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """The largest error each value of ``x`` (a pool, float32) may get through ``fmt``."""
    fmt = effective(fmt, layout.torch_dtype)
    if fmt == "native":
        return torch.zeros_like(x)
    if fmt == "fp16":
        return x.abs().clamp(max=FP16_MAX) * 2.0 ** -11 + 2.0 ** -24 + (x.abs() - FP16_MAX).clamp(min=0)
    # int8: half a step of the group's scale (K: per block, head and channel, over the tokens;
    # V: per token and head, over the dimensions), the scale's rounding, the pool dtype's
    amax = torch.cat([x[:, :1].abs().amax(dim=3, keepdim=True).expand_as(x[:, :1]),
                      x[:, 1:].abs().amax(dim=5, keepdim=True).expand_as(x[:, 1:])], dim=1)
    itemsize_eps = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
    return (amax / 254 + x.abs() * itemsize_eps[layout.torch_dtype]) * 1.002 + 2.0 ** -15


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dims", [(2, 8, 4, 2, 8), (3, 5, 3, 3, 5), (1, 3, 1, 1, 1)])   # odd sizes too
def test_every_format_round_trips_every_pool_dtype_within_its_bound(dtype, fmt, dims):
    layers, blocks, block_size, heads, head_dim = dims
    layout = KVCacheLayout(layers, blocks, block_size, heads, head_dim, str(dtype).removeprefix("torch."))
    src = random_pool(layout, seed=sum(dims), scale=3.0)
    src[0, 0, 0] *= 1000   # a group with a large range beside small ones
    codec = KVCodec.for_layout(fmt, layout)
    ids = random.Random(1).sample(range(blocks), blocks)
    buf = torch.empty(2 * layers, blocks, codec.unit_nbytes, dtype=torch.uint8)
    codec.encode(planes(src), ids, buf)
    dst = layout.allocate()
    dst_ids = random.Random(2).sample(range(blocks), blocks)
    codec.decode(buf, planes(dst), dst_ids)
    back = layout.allocate()
    back[:, :, ids] = dst[:, :, dst_ids]   # back in the source's block order
    err = (back.float() - src.float()).abs()
    assert bool((err <= bound(fmt, src.float(), layout)).all()), (fmt, float(err.max()))
    if codec.format == "native":
        assert torch.equal(back, src)
    expected_unit = {"native": layout.block_nbytes, "fp16": layout.block_nbytes // (layout.itemsize // 2),
                     "int8": -(-2 * heads * max(head_dim, block_size) // 4) * 4
                     + -(-block_size * heads * head_dim // 4) * 4}[codec.format]
    assert codec.unit_nbytes == expected_unit and codec.unit_nbytes % (4 if codec.format == "int8" else 1) == 0


def test_fp16_of_a_16_bit_pool_is_native_and_fp16_clamps_its_range():
    assert effective("fp16", torch.bfloat16) == effective("fp16", torch.float16) == "native"
    assert effective("fp16", torch.float32) == "fp16"
    with pytest.raises(ValueError, match="unknown KV format"):
        effective("int4", torch.float32)
    layout = KVCacheLayout(1, 2, 2, 1, 2)
    pool = torch.tensor([1e6, -1e6, 0.5, 3.0, 7e4, -1.0, 2.0, 1e-9] * 2).view(layout.shape)
    codec = KVCodec.for_layout("fp16", layout)
    buf = torch.empty(2, 2, codec.unit_nbytes, dtype=torch.uint8)
    codec.encode(planes(pool), [0, 1], buf)
    out = layout.allocate()
    codec.decode(buf, planes(out), [0, 1])
    assert torch.isfinite(out).all() and out.abs().max() == FP16_MAX


def test_any_range_of_planes_and_blocks_encodes_as_the_whole_does():
    layout = KVCacheLayout(3, 12, 4, 2, 8)
    pool = random_pool(layout, 5)
    codec = KVCodec.for_layout("int8", layout)
    ids = [7, 8, 9, 2, 11, 0]
    whole = torch.empty(6, len(ids), codec.unit_nbytes, dtype=torch.uint8)
    codec.encode(planes(pool), ids, whole)
    part = torch.empty(2, 3, codec.unit_nbytes, dtype=torch.uint8)
    codec.encode(planes(pool), ids[2:5], part, plane_start=3)
    assert torch.equal(part, whole[3:5, 2:5])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_block_payload_decodes_as_what_it_is(fmt):
    layout = KVCacheLayout(2, 4, 4, 2, 8)
    pool = random_pool(layout, 9)
    payload = KVCodec.for_layout(fmt, layout).encode_block(pool, 2)
    assert payload.device.type == "cpu"
    expected_bytes = {"native": 1.0, "fp16": 0.5, "int8": (32 + 64) / 256}[fmt]   # int8: K's 2 x 8 scales
    assert payload.numel() * payload.element_size() == expected_bytes * 2 * layout.num_layers * layout.block_nbytes
    for reader in FORMATS:   # whatever the reading codec's own format
        out = layout.allocate()
        KVCodec.for_layout(reader, layout).decode_block(payload, out, 1)
        assert torch.allclose(out[:, :, 1], pool[:, :, 2], atol=0.05, rtol=0.01)
        assert not out[:, :, [0, 2, 3]].any()
    with pytest.raises(ValueError):
        KVCodec.for_layout("native", layout).decode_block(payload.view(-1)[:7].clone(), layout.allocate(), 0)


# --- the tiers ------------------------------------------------------------------------------------

TIER_LAYOUT = KVCacheLayout(2, 8, 4, 2, 8)


def bind(tiers: KVTiers, pool: torch.Tensor) -> KVTiers:
    tiers.bind(pool, b"root" * 4)
    return tiers


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_the_tiers_store_their_format_and_load_it_back(tmp_path, fmt):
    pool = random_pool(TIER_LAYOUT, 3)
    host = bind(KVTiers(host_bytes=2**20, kv_format=fmt), pool)
    host.spill(b"a" * 16, 1)
    native = 2 * TIER_LAYOUT.num_layers * TIER_LAYOUT.block_nbytes
    assert host.host.nbytes == KVCodec.for_layout(fmt, TIER_LAYOUT).unit_nbytes * 2 * TIER_LAYOUT.num_layers < native
    (payload,) = host.fetch([b"a" * 16])
    host.load(5, payload)
    assert torch.allclose(pool[:, :, 5], pool[:, :, 1], atol=0.05, rtol=0.01)
    assert not torch.equal(pool[:, :, 5], pool[:, :, 1])   # lossy: it went through the format

    disk = bind(KVTiers(disk_dir=tmp_path, disk_bytes=2**30, kv_format=fmt), pool)
    disk.spill(b"b" * 16, 2)
    (path,) = list(disk.disk.dir.iterdir())
    assert path.stat().st_size == disk.disk.file_nbytes == _HEADER.size + disk.disk.payload_nbytes
    assert disk.disk.payload_nbytes <= native // 2
    assert path.read_bytes()[:8] == b"PDQKV2\0\0" and fmt.encode() in path.read_bytes()[:80]


def test_a_disk_file_of_another_format_is_decoded_as_what_it_is(tmp_path):
    pool = random_pool(TIER_LAYOUT, 4)
    writer = bind(KVTiers(disk_dir=tmp_path, disk_bytes=2**30, kv_format="int8"), pool)
    writer.persist([(b"c" * 16, 3)])
    reader = bind(KVTiers(disk_dir=tmp_path, disk_bytes=2**30, kv_format="native"), TIER_LAYOUT.allocate())
    (payload,) = reader.fetch([b"c" * 16])
    assert payload.dtype == torch.uint8   # int8's bytes, not this tier's float32
    reader.load(0, payload)
    expected = TIER_LAYOUT.allocate()
    KVCodec.for_layout("int8", TIER_LAYOUT).decode_block(KVCodec.for_layout("int8", TIER_LAYOUT).encode_block(pool, 3),
                                                         expected, 0)
    assert torch.equal(reader.pool[:, :, 0], expected[:, :, 0])


def test_first_version_files_are_native_and_an_unknown_or_short_format_is_a_miss(tmp_path):
    import hashlib

    pool = random_pool(TIER_LAYOUT, 6)
    tiers = bind(KVTiers(disk_dir=tmp_path, disk_bytes=2**30, kv_format="fp16"), pool)
    disk = tiers.disk
    data = pool[:, :, 4].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    shape = list(disk.shape) + [0]
    v1 = _HEADER_V1.pack(_MAGIC_V1, b"d" * 16, b"float32", *shape, hashlib.blake2b(data, digest_size=16).digest())
    disk.path(b"d" * 16).write_bytes(v1 + data)
    assert tiers.leading([b"d" * 16]) == 1   # found by its name (as another worker's file is)
    (payload,) = tiers.fetch([b"d" * 16])
    assert torch.equal(payload, pool[:, :, 4])   # native, exact

    tiers.persist([(b"e" * 16, 5), (b"f" * 16, 6)])
    raw = disk.path(b"e" * 16).read_bytes()
    disk.path(b"e" * 16).write_bytes(raw.replace(b"fp16", b"fp12", 1))   # a format this build does not know
    raw = disk.path(b"f" * 16).read_bytes()
    disk.path(b"f" * 16).write_bytes(raw.replace(b"fp16", b"int8", 1))   # claims int8, holds fp16's bytes
    fresh = bind(KVTiers(disk_dir=tmp_path / "other", disk_bytes=2**30, kv_format="fp16"), pool)
    fresh.disk = DiskTier(tmp_path, b"root" * 4, 2**30, disk.shape, "float32", "fp16")   # a restart on the directory
    assert fresh.leading([b"e" * 16, b"f" * 16]) == 2   # named, not yet read
    assert fresh.fetch([b"e" * 16]) == [] and fresh.fetch([b"f" * 16]) == []
    assert fresh.disk.corrupt == 2 and not disk.path(b"e" * 16).exists()


def test_a_disk_tier_bound_counts_its_format(tmp_path):
    native = DiskTier(tmp_path / "n", b"r" * 16, 2**30, (2, 2, 4, 2, 8), "float32")
    small = DiskTier(tmp_path / "i", b"r" * 16, 2**30, (2, 2, 4, 2, 8), "float32", "int8")
    assert small.payload_nbytes * 2 < native.payload_nbytes


# --- the wires, in one process -------------------------------------------------------------------

WIRE = KVCacheLayout(num_layers=3, num_blocks=64, block_size=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def sender():
    pool = random_pool(WIRE, 11)
    s = KVSender(pool, WIRE, "s1", uuid.uuid4().hex[:8], "node-a", data_port=0, max_frame_bytes=1024,
                 shared_blocks=True)   # tickets may share blocks (the releases are fire-and-forget)
    yield s, pool
    s.close()


def expect(fmt: str, pool: torch.Tensor, src_ids: list[int]) -> torch.Tensor:
    """What ``fmt`` makes of ``pool``'s blocks ``src_ids``."""
    codec = KVCodec.for_layout(fmt, WIRE)
    buf = torch.empty(2 * WIRE.num_layers, len(src_ids), codec.unit_nbytes, dtype=torch.uint8)
    codec.encode(planes(pool), src_ids, buf)
    out = WIRE.allocate()
    codec.decode(buf, planes(out), range(len(src_ids)))
    return out[:, :, :len(src_ids)]


@pytest.mark.parametrize("mode", ["tcp", "zmq"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_network_wires_move_the_asked_format(sender, mode, fmt):
    s, pool = sender
    src_ids = random.Random(3).sample(range(WIRE.num_blocks), 13)   # frames of 1 KiB: block ranges
    dst_ids = random.Random(4).sample(range(WIRE.num_blocks), 13)
    dst = WIRE.allocate()
    with KVReceiver(dst, WIRE, "node-b", mode=mode, timeout_s=5, kv_format=fmt) as receiver:
        ticket = s.export(f"r-{uuid.uuid4().hex[:6]}", src_ids, 13 * WIRE.block_size)
        result = receiver.fetch(ticket, dst_ids)
    assert result.path == mode
    codec = KVCodec.for_layout(fmt, WIRE)
    assert result.nbytes == 2 * WIRE.num_layers * 13 * codec.unit_nbytes
    assert torch.equal(dst[:, :, dst_ids], expect(fmt, pool, src_ids))
    untouched = [b for b in range(WIRE.num_blocks) if b not in set(dst_ids)]
    assert not dst[:, :, untouched].any()
    ratio = result.nbytes / (2 * WIRE.num_layers * 13 * WIRE.block_nbytes)
    assert ratio == {"native": 1.0, "fp16": 0.5, "int8": (32 + 64) / 256}[fmt]   # int8: K's 2 x 8 scales


@pytest.mark.parametrize("mode", ["tcp", "zmq"])
def test_a_fetch_from_a_first_block_moves_the_rest_in_the_format(sender, mode):
    """The receiver holds the first blocks (prefix caching): only the rest travel, encoded."""
    s, pool = sender
    src_ids = [40, 41, 42, 50, 51]
    dst = WIRE.allocate()
    with KVReceiver(dst, WIRE, "node-b", mode=mode, timeout_s=5, kv_format="int8") as receiver:
        result = receiver.fetch(s.export(f"r-{uuid.uuid4().hex[:6]}", src_ids, 20), [7, 9], first_block=3)
    assert result.nbytes == 2 * WIRE.num_layers * 2 * KVCodec.for_layout("int8", WIRE).unit_nbytes
    assert torch.equal(dst[:, :, [7, 9]], expect("int8", pool, [50, 51]))
    assert not dst[:, :, [b for b in range(WIRE.num_blocks) if b not in (7, 9)]].any()


@pytest.mark.parametrize("mode", ["tcp", "zmq"])
def test_a_sender_that_does_not_know_the_ask_sends_native_and_it_is_read_as_such(sender, mode):
    """An older sender ignores ``kv_format`` (here: the real admission with the field taken
    out of every request) and its reply names none: the receiver reads native, bit for bit."""
    s, pool = sender
    real = s.admission.answer
    s.admission.answer = lambda msg, **kw: Admission.answer(s.admission, {k: v for k, v in msg.items()
                                                                          if k != "kv_format"}, **kw)
    try:
        dst = WIRE.allocate()
        with KVReceiver(dst, WIRE, "node-b", mode=mode, timeout_s=5, kv_format="int8") as receiver:
            result = receiver.fetch(s.export(f"r-{uuid.uuid4().hex[:6]}", [5, 6, 7], 12), [0, 1, 2])
    finally:
        s.admission.answer = real
    assert result.nbytes == 2 * WIRE.num_layers * 3 * WIRE.block_nbytes
    assert torch.equal(dst[:, :, [0, 1, 2]], pool[:, :, [5, 6, 7]])


def test_a_format_the_sender_does_not_know_is_answered_native(sender):
    s, pool = sender
    dst = WIRE.allocate()
    with KVReceiver(dst, WIRE, "node-b", mode="tcp", timeout_s=5) as receiver:
        receiver._ctx.kv_format = "int3"   # asked past the receiver's own check, as a newer peer might
        result = receiver.fetch(s.export(f"r-{uuid.uuid4().hex[:6]}", [9], 4), [3])
    assert result.nbytes == 2 * WIRE.num_layers * WIRE.block_nbytes and torch.equal(dst[:, :, 3], pool[:, :, 9])


def test_a_receiver_refuses_an_unknown_format_and_bf16_pools_take_fp16_as_native():
    layout = KVCacheLayout(1, 4, 2, 1, 4, "bfloat16")
    with pytest.raises(ValueError, match="unknown KV format"):
        KVReceiver(layout.allocate(), layout, "n", kv_format="int4")
    with KVReceiver(layout.allocate(), layout, "n", kv_format="fp16") as receiver:
        assert receiver.kv_format == "native"


def test_the_worker_options_know_the_codecs_formats():
    from workers.common import KV_FORMATS, WorkerConfig

    assert KV_FORMATS == FORMATS
    with pytest.raises(ValueError, match="kv_wire_format"):
        WorkerConfig(kv_wire_format="int4")


# --- bench quality's KV part -----------------------------------------------------------------------

def test_bench_quality_kv_formats_on_the_tiny_model():
    from pdqueue.bench import kv_quality

    result = kv_quality.run("tiny", ["fp16", "int8"], max_tokens=4, contexts=1, context_tokens=40,
                            progress=lambda _: None)
    res = result["results"]
    assert list(res) == ["native", "fp16", "int8"] and result["prompts"] == result["short_prompts"] + 1
    assert res["native"]["kl_max"] == 0 and res["native"]["greedy_identical"] == 1.0
    assert res["fp16"]["bytes_vs_native"] == 0.5 and 0.25 < res["int8"]["bytes_vs_native"] < 0.4
    assert 0 <= res["fp16"]["kl_mean"] <= res["int8"]["kl_max"] + 1e-9
    assert all(0 <= r["greedy_token_agreement"] <= 1 for r in res.values())
    assert "int8" in kv_quality.format_table(result)
