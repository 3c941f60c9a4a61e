"""KV formats in the PD pipeline: real worker processes (tiny model), real Redis.

What must hold:
- a decode worker started with ``--kv-wire-format fp16`` or ``int8`` fetching over TCP (and
  ZeroMQ) answers every prompt of a fixed set, the bytes it reports moved (``transfer_bytes`` of the
  done entry) shrinking by the format's factor against native's for the same blocks; fp16
  gives the native answer token for token (float16 keeps what the tiny model's greedy
  choices depend on); int8 gives token 0 (computed from the prefill, in full precision)
  and an answer of the asked length (its tokens may part from native's later: that is
  the loss ``bench quality`` measures);
- tier files of another format are read as what they are: a worker restarted with
  ``--kv-tier-format int8`` on a directory of fp16 files serves them (the history cached,
  the no-cache answer), never reads them as int8;
- formats that cannot apply are refused at the CLI with one line, before the model loads:
  an unknown name, fp16 of a 16-bit pool, a wire format with ``--transfer shm``/``nixl``,
  a tier format without a tier; ``bench quality --kv-formats`` likewise.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdqueue.engine.config import EngineConfig
from pdqueue.engine.kv_codec import KVCodec
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
BS = 16
PROMPTS = [[random.Random(s).randrange(0, 256) for _ in range(n)] for s, n in ((1, 37), (2, 64), (3, 90))]
MAX_TOKENS = 12


def native_answers(tiny) -> list[list[int]]:
    engine = LLMEngine(tiny, EngineConfig(model=tiny.config.name, num_blocks=64, prefix_caching=False))
    return engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))


def ask(client, prompt_ids: list[int]):
    return client.submit(prompt_ids=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0, seed=0,
                         ignore_eos=True).result(timeout=60)


@pytest.mark.parametrize("transfer,fmt", [("tcp", "native"), ("tcp", "fp16"), ("tcp", "int8"), ("zmq", "int8")])
def test_pd_over_the_network_in_each_wire_format(cluster, tiny, transfer, fmt):
    from pdqueue.client import Client

    expected = native_answers(tiny)
    cluster.start_together(("prefill", "--transfer", transfer),
                           ("decode", "--transfer", transfer, "--kv-wire-format", fmt))
    client = Client(cluster.redis_url, cluster.cluster)
    layout = LLMEngine(tiny, EngineConfig(model=tiny.config.name, num_blocks=8)).layout
    native_unit, unit = layout.block_nbytes, KVCodec.for_layout(fmt, layout).unit_nbytes
    for prompt, want in zip(PROMPTS, expected):
        got = ask(client, prompt)
        assert got.transfer_path == transfer, got
        blocks = got.transfer_bytes // (2 * layout.num_layers * unit)
        assert got.transfer_bytes == blocks * 2 * layout.num_layers * unit and blocks == -(-len(prompt) // BS)
        assert got.transfer_bytes / (blocks * 2 * layout.num_layers * native_unit) == unit / native_unit
        assert len(got.token_ids) == MAX_TOKENS and got.token_ids[0] == want[0]
        if fmt != "int8":
            assert list(got.token_ids) == want, fmt
    assert {"native": 1.0, "fp16": 0.5}.get(fmt, 0.3) >= unit / native_unit > 0.25   # int8: ~0.28


TURN1 = [random.Random(7).randrange(0, 256) for _ in range(9 * BS + 5)]
MORE = [random.Random(8).randrange(0, 256) for _ in range(BS + 3)]
FILLERS = [[random.Random(s).randrange(0, 256) for _ in range(50 * BS)] for s in (11, 12, 13)]


def test_tier_files_of_another_format_are_read_as_what_they_are(cluster, tiny, tmp_path):
    """A colocated worker with a 1 MiB pool and both tiers in fp16: the second turn of a
    conversation, after the pool evicted the first, has its history from the host tier and
    the no-cache answer. Stopped (its blocks written to disk: fp16 files) and started again
    with --kv-tier-format int8 on the same directory: the fp16 files are read as fp16, the
    second turn's prompt is cached (its blocks were written at the stop too), and the
    answer is still the no-cache one."""
    from pdqueue.client import Client

    plain = LLMEngine(tiny, EngineConfig(model=tiny.config.name, num_blocks=256, prefix_caching=False))
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)   # noqa: E731
    out1 = plain.generate([TURN1], greedy(2 * BS))[0]
    turn2 = TURN1 + out1 + MORE
    out2 = plain.generate([turn2], greedy(8))[0]
    history = (len(TURN1) + len(out1) - 1) // BS * BS
    disk = tmp_path / "kv"
    tiers = ("--kv-cache-mb", "1", "--kv-host-tier-mb", "4", "--kv-disk-dir", str(disk))
    cluster.start("colocated", *tiers, "--kv-tier-format", "fp16", worker_id="c1")
    client = Client(cluster.redis_url, cluster.cluster)
    client_ask = lambda prompt, n: client.submit(prompt_ids=prompt, max_tokens=n, temperature=0.0, seed=0,   # noqa: E731
                                                 ignore_eos=True).result(timeout=60)
    assert list(client_ask(TURN1, 2 * BS).token_ids) == out1
    for filler in FILLERS:
        client_ask(filler, 1)
    second = client_ask(turn2, 8)
    assert list(second.token_ids) == out2 and second.cached_tokens == history
    assert cluster.stop("c1") == 0
    files = [f for d in disk.iterdir() for f in d.iterdir()]
    assert files and all(f.read_bytes()[:8] == b"PDQKV2\0\0" and b"fp16" in f.read_bytes()[:80] for f in files)
    cluster.start("colocated", *tiers, "--kv-tier-format", "int8", worker_id="c2")
    third = client_ask(turn2, 8)
    # the second turn's own blocks were written at the stop too: its whole prompt is cached
    assert list(third.token_ids) == out2 and third.cached_tokens == (len(turn2) - 1) // BS * BS


def pdq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_KV_")}
    return subprocess.run([sys.executable, "-m", "workers", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args,needle", [
    (["worker", "decode", "--model", "tiny", "--kv-wire-format", "int4"], "--kv-wire-format"),
    (["worker", "decode", "--model", "tiny", "--dtype", "bfloat16", "--kv-wire-format", "fp16"], "bfloat16 already"),
    (["worker", "decode", "--model", "tiny", "--transfer", "shm", "--kv-wire-format", "int8"], "native KV only"),
    (["worker", "colocated", "--model", "tiny", "--kv-tier-format", "int8"], "no KV tier"),
    (["bench", "quality", "--model", "tiny", "--kv-formats", "native,int3"], "--kv-formats"),
])
@pytest.mark.processes
def test_formats_that_cannot_apply_are_refused_in_one_line(args, needle):
    result = pdq(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
