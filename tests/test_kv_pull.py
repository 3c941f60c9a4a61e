"""The next turn pulls the last turn's KV from the worker that holds it (workers/kv_holds.py,
workers/kv_pull.py; issue 41, item 2).

What must hold:
- the pieces alone: the pull cost estimate starts from its seed and follows what pulls
  measure; ``auto`` pulls only when the pull is predicted cheaper than the recompute (or the
  recompute cost is unknown), ``always`` and ``never`` do what they say; payloads staged
  under a chain's names serve a second turn on the real tiny model with the no-cache
  tokens and are counted as cached;
- real worker processes (tiny model, real Redis): a second turn, taken by another worker
  than the one that decoded the first, pulls the history from the holder and answers the
  no-cache greedy tokens, through PD (the decode worker holds it) and colocated, on shm
  (same node) and TCP (the puller on another node: ``PDQ_NODE_ID``); the puller's heartbeat
  counts the pulled tokens and the done entry counts them as cached; history a worker
  restored from its disk tier after a restart (and used) is pulled by a worker without that
  directory; a holder SIGKILLed mid-pull, or a ticket signed with another cluster
  secret: recompute, same tokens; a holder of other weights (another prefix root) is never
  pulled from.
"""

from __future__ import annotations

import json
import random
import signal

import pytest
import torch

from pdqueue.engine.config import EngineConfig
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from tests.helpers import wait_for
from workers.kv_pull import SEED, PullCost, StagedTier, decide

BS = 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread."""


# --- the pieces alone ------------------------------------------------------------------------

def test_the_pull_cost_starts_from_its_seed_and_follows_measured_pulls():
    cost = PullCost()
    latency, bandwidth = SEED["tcp"]
    assert cost.predict("tcp", 10**6) == pytest.approx(latency + 10**6 / bandwidth)
    for _ in range(20):   # pulls ten times as fast as the seed says
        cost.observe("tcp", 10**7, latency + 10**7 / (10 * bandwidth))
    assert cost.predict("tcp", 10**7) < latency + 10**7 / (5 * bandwidth)
    assert cost.predict("shm", 10**6) == pytest.approx(SEED["shm"][0] + 10**6 / SEED["shm"][1])   # its own path


def test_auto_pulls_only_when_cheaper_and_the_other_modes_do_what_they_say():
    assert decide("auto", recompute=0.5, pull=0.1)
    assert not decide("auto", recompute=0.05, pull=0.1)
    assert decide("auto", recompute=None, pull=0.1)          # nothing learned yet: pull
    assert decide("always", recompute=0.001, pull=1.0)
    assert not decide("never", recompute=9.0, pull=0.001)


def test_up_passes_the_tier_and_pull_options_to_its_workers():
    """`up`'s --kv-host-tier-mb, --kv-disk-dir, --kv-disk-gb and --kv-pull become the worker
    options it starts every worker with (none for a default)."""
    import click
    from click.testing import CliRunner

    from workers.cli.common import kv_tier_options

    seen = []

    @click.command()
    @kv_tier_options
    def cmd(kv_args):
        seen.append(kv_args)

    runner = CliRunner()
    assert runner.invoke(cmd, []).exit_code == 0
    assert runner.invoke(cmd, ["--kv-host-tier-mb", "64", "--kv-disk-dir", "/tmp/kv", "--kv-disk-gb", "2.5",
                               "--kv-pull", "never"]).exit_code == 0
    assert runner.invoke(cmd, ["--kv-pull", "sometimes"]).exit_code == 2
    assert seen == [(), ("--kv-host-tier-mb", "64", "--kv-disk-dir", "/tmp/kv", "--kv-disk-gb", "2.5",
                         "--kv-pull", "never")]


def make_engine(tiny, num_blocks: int = 64, caching: bool = True) -> LLMEngine:
    return LLMEngine(tiny, EngineConfig(model=tiny.config.name, block_size=BS, num_blocks=num_blocks,
                                        prefix_caching=caching))


def test_staged_payloads_serve_the_second_turn_with_the_no_cache_tokens(tiny):
    """The holder's engine runs turn 1; its history's blocks (copied out as a pull would)
    are staged in another engine's StagedTier; that engine's turn 2 answers the no-cache
    tokens and reports the history cached, loaded from the stage (then dropped from it)."""
    rng = random.Random(3)
    turn1 = [rng.randrange(0, 256) for _ in range(5 * BS + 3)]
    plain = make_engine(tiny, 256, caching=False)
    out1 = plain.generate([turn1], SamplingParams(max_tokens=2 * BS, temperature=0, ignore_eos=True))[0]
    turn2 = turn1 + out1 + [rng.randrange(0, 256) for _ in range(BS + 1)]
    out2 = plain.generate([turn2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]

    holder = make_engine(tiny)
    assert holder.generate([turn1], SamplingParams(max_tokens=2 * BS, temperature=0, ignore_eos=True))[0] == out1
    bm = holder.block_manager
    history = (len(turn1) + len(out1) - 1) // BS
    from pdqueue.engine.block_manager import chain_hashes

    hashes = chain_hashes(bm.root, turn2[:history * BS], BS)
    blocks = bm.hold_cached(hashes)
    assert len(blocks) == history
    payloads = [holder.kv_cache[:, :, b].clone() for b in blocks]
    bm.free_blocks(blocks)

    puller = make_engine(tiny)
    tier = StagedTier(None, puller.kv_cache, max_bytes=puller.layout.nbytes)
    puller.block_manager.tier = tier
    tier.stage(hashes, payloads)
    puller.add_request("t2", turn2, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    got, cached = [], 0
    while puller.has_unfinished:
        for out in puller.step():
            got.append(out.token_id)
            cached = out.cached_tokens
    assert got == out2
    assert cached == history * BS and tier.loaded == history and not tier.has(hashes[0])


def test_payloads_staged_under_another_roots_names_are_never_used(tiny):
    """Names from another chain start (another model, weights or dtype) never equal a
    prompt's: a stage under them serves nothing, and the answer is computed."""
    rng = random.Random(4)
    prompt = [rng.randrange(0, 256) for _ in range(4 * BS + 1)]
    from pdqueue.engine.block_manager import chain_hashes

    puller = make_engine(tiny)
    other = chain_hashes(b"another root".ljust(16, b"\0"), prompt[:4 * BS], BS)
    tier = StagedTier(None, puller.kv_cache, max_bytes=puller.layout.nbytes)
    puller.block_manager.tier = tier
    tier.stage(other, [torch.zeros_like(puller.kv_cache[:, :, 0]) for _ in other])
    puller.add_request("x", prompt, SamplingParams(max_tokens=1, temperature=0))
    outs = [out for _ in range(8) for out in puller.step()]
    assert outs and outs[0].cached_tokens == 0 and tier.loaded == 0


# --- real worker processes ---------------------------------------------------------------------

TURN1 = [random.Random(17).randrange(0, 256) for _ in range(9 * BS + 5)]
MORE = [random.Random(18).randrange(0, 256) for _ in range(BS + 3)]


def turns(tiny) -> tuple[list[int], list[int], list[int]]:
    """The first turn's answer, the second turn's prompt (first prompt + answer + more) and
    its answer, by the engine without any cache."""
    plain = make_engine(tiny, 256, caching=False)
    out1 = plain.generate([TURN1], SamplingParams(max_tokens=2 * BS, temperature=0, ignore_eos=True))[0]
    turn2 = TURN1 + out1 + MORE
    out2 = plain.generate([turn2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    return out1, turn2, out2


def ask(client, prompt_ids: list[int], max_tokens: int):
    return client.submit(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=0.0, seed=0,
                         ignore_eos=True).result(timeout=60)


def load_of(cluster, name: str) -> dict:
    return json.loads(cluster.r.hget(cluster.keys.worker(cluster.id(name)), "load") or b"{}")


def to_own_stream(cluster, client, name: str) -> None:
    """``client``'s requests go to worker ``name``'s own stream (read by it before anything
    else: workers/routing.py), not to the shared one another worker might read first."""
    own = cluster.keys.requests_for(cluster.id(name))
    client._stream_of = lambda req: own


def first_turn_held(cluster, client, holder: str, out1: list[int] | None) -> None:
    """The first turn on worker ``holder`` (its answer ``out1``, unless None: another model's
    answer), which then holds its KV (its heartbeat shows the hold)."""
    to_own_stream(cluster, client, holder)
    answer = ask(client, TURN1, 2 * BS)
    if out1 is not None:
        assert list(answer.token_ids) == out1
    wait_for(lambda: load_of(cluster, holder).get("kv_holds", 0) == 1, 10, f"{holder}'s hold")


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_second_turn_on_another_prefill_worker_pulls_its_history_from_the_decode_worker(cluster, tiny, path):
    """p1 + d1 serve the first turn; p1 stops and p2 (its pool empty) takes the second: it
    pulls the history (first prompt and answer) that d1 holds, over shm on the same node (d1's
    pool a segment), over TCP when d1 is on another node, and answers the no-cache tokens; p2's heartbeat
    counts the pulled tokens, the done entry the history as cached, d1's a hold pulled."""
    from pdqueue.client import Client

    out1, turn2, out2 = turns(tiny)
    history = (len(TURN1) + len(out1) - 1) // BS * BS
    # shm: d1's pool a shared segment (--switchable), copied by p2 on its node; tcp: d1 elsewhere.
    where = ({"env": {"PDQ_NODE_ID": f"node-b-{cluster.tag}"}},) if path == "tcp" else ("--switchable", {})
    cluster.start_together(("prefill", {"worker_id": "p1"}), ("decode", *where[:-1], {"worker_id": "d1", **where[-1]}))
    client = Client(cluster.redis_url, cluster.cluster)
    assert list(ask(client, TURN1, 2 * BS).token_ids) == out1
    assert cluster.stop("p1") == 0
    cluster.start("prefill", "--kv-pull", "always", worker_id="p2")
    second = ask(client, turn2, 8)
    assert list(second.token_ids) == out2
    assert second.prefill_worker == cluster.id("p2") and second.cached_tokens == history
    wait_for(lambda: load_of(cluster, "p2").get("kv_pulled_tokens") == history, 10, "p2's pull counters")
    assert load_of(cluster, "p2")[f"kv_pulls_{path}"] == 1 and load_of(cluster, "p2")["kv_pull_failed"] == 0
    wait_for(lambda: load_of(cluster, "d1").get("kv_holds_pulled", 0) >= 1, 10, "d1's hold pulled")


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_colocated_worker_pulls_the_history_another_colocated_worker_holds(cluster, tiny, path):
    """c1 answers the first turn and holds it; the second goes to c2 (its own stream), which
    pulls the history from c1 (shm on this node; TCP from another) and answers the no-cache
    tokens, the history counted as cached."""
    from pdqueue.client import Client

    out1, turn2, out2 = turns(tiny)
    history = (len(TURN1) + len(out1) - 1) // BS * BS
    # shm: c1's pool a shared segment (--switchable), copied by c2 on its node; tcp: c2 elsewhere.
    other_node = {"env": {"PDQ_NODE_ID": f"node-b-{cluster.tag}"}} if path == "tcp" else {}
    holder = ("--switchable",) if path == "shm" else ()
    cluster.start_together(("colocated", "--routing", "off", *holder, {"worker_id": "c1"}),
                           ("colocated", "--routing", "off", "--kv-pull", "always", {"worker_id": "c2", **other_node}))
    client = Client(cluster.redis_url, cluster.cluster)
    first_turn_held(cluster, client, "c1", out1)
    to_own_stream(cluster, client, "c2")
    second = ask(client, turn2, 8)
    assert list(second.token_ids) == out2
    assert second.prefill_worker == cluster.id("c2") and second.cached_tokens == history
    wait_for(lambda: load_of(cluster, "c2").get("kv_pulled_tokens") == history, 10, "c2's pull counters")
    assert load_of(cluster, "c2")[f"kv_pulls_{path}"] == 1
    wait_for(lambda: load_of(cluster, "c1").get("kv_holds_pulled", 0) == 1, 10, "c1's hold pulled")


@pytest.fixture
def killing(redis_url, tmp_path):
    """A cluster whose workers are killed on purpose: only those that exited cleanly must
    have removed their segments."""
    from tests.cluster import Cluster

    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_and_check(killed_ok=True)


@pytest.mark.processes
def test_a_holder_killed_mid_pull_leaves_the_history_to_be_computed(killing, tiny):
    """The holder (c1, on another node: TCP) is frozen (SIGSTOP) after it advertised its hold,
    so c2's pull of the second turn's history starts and waits on it; c1 is then SIGKILLed
    mid-pull: the pull fails and the history is computed: the no-cache tokens, nothing
    cached, a failed pull counted."""
    import time

    from pdqueue.client import Client

    cluster = killing
    out1, turn2, out2 = turns(tiny)
    cluster.start_together(("colocated", "--routing", "off", {"worker_id": "c1",
                                                              "env": {"PDQ_NODE_ID": f"node-b-{cluster.tag}"}}),
                           ("colocated", "--routing", "off", "--kv-pull", "always", {"worker_id": "c2"}))
    client = Client(cluster.redis_url, cluster.cluster)
    first_turn_held(cluster, client, "c1", out1)
    cluster.signal("c1", signal.SIGSTOP)
    to_own_stream(cluster, client, "c2")
    handle = client.submit(prompt_ids=turn2, max_tokens=8, temperature=0.0, seed=0, ignore_eos=True)
    time.sleep(1.0)   # c2 reads it and pulls: its request waits on the frozen holder (timeout 5 s)
    assert cluster.r.xlen(cluster.keys.out(handle.request_id)) == 0   # no token yet: still pulling
    cluster.signal("c1", signal.SIGKILL)
    cluster.stop("c1", signalled=True)
    second = handle.result(timeout=60)
    assert list(second.token_ids) == out2 and second.cached_tokens == 0
    wait_for(lambda: load_of(cluster, "c2").get("kv_pull_failed") == 1, 10, "c2's failed pull")
    assert load_of(cluster, "c2")["kv_pulled_tokens"] == 0


def test_a_holder_of_other_weights_is_never_pulled_from(cluster, tiny):
    """c1 runs int8 weights (another prefix root); c2 (float32) takes the second turn with
    --kv-pull always: no hold of c1's matches its prompt's chain, nothing is pulled, the
    answer is its own no-cache one."""
    from pdqueue.client import Client

    out1, turn2, out2 = turns(tiny)
    cluster.start_together(("colocated", "--routing", "off", "--weights", "int8", {"worker_id": "c1"}),
                           ("colocated", "--routing", "off", "--kv-pull", "always", {"worker_id": "c2"}))
    client = Client(cluster.redis_url, cluster.cluster)
    first_turn_held(cluster, client, "c1", None)   # int8 weights: another answer
    to_own_stream(cluster, client, "c2")
    second = ask(client, turn2, 8)
    assert list(second.token_ids) == out2 and second.cached_tokens == 0
    wait_for(lambda: "kv_pulls" in load_of(cluster, "c2"), 10, "c2's heartbeat")
    assert load_of(cluster, "c2")["kv_pulls"] == 0 and load_of(cluster, "c2")["kv_pull_failed"] == 0


def test_history_restored_from_the_disk_tier_after_a_restart_is_pulled_by_a_worker_without_it(cluster, tiny, tmp_path):
    """c1 (a disk tier) answers the first turn and stops (its blocks written to disk); c1
    again on the same directory answers the second turn from disk and holds it; c2 (no disk
    directory, on another node) takes the third turn and pulls the whole history from c1,
    the blocks restored from disk among them: the no-cache tokens, all of it cached."""
    from pdqueue.client import Client

    out1, turn2, out2 = turns(tiny)
    turn3 = turn2 + out2 + MORE
    plain = make_engine(tiny, 256, caching=False)
    out3 = plain.generate([turn3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    disk = ("--routing", "off", "--kv-disk-dir", str(tmp_path / "kv"))
    cluster.start("colocated", *disk, worker_id="c1")
    client = Client(cluster.redis_url, cluster.cluster)
    to_own_stream(cluster, client, "c1")
    assert list(ask(client, TURN1, 2 * BS).token_ids) == out1
    assert cluster.stop("c1") == 0
    cluster.start_together(("colocated", *disk, {"worker_id": "c1b"}),
                           ("colocated", "--routing", "off", "--kv-pull", "always",
                            {"worker_id": "c2", "env": {"PDQ_NODE_ID": f"node-b-{cluster.tag}"}}))
    to_own_stream(cluster, client, "c1b")
    second = ask(client, turn2, 8)
    assert list(second.token_ids) == out2 and second.cached_tokens == (len(TURN1) + len(out1) - 1) // BS * BS
    wait_for(lambda: load_of(cluster, "c1b").get("kv_holds", 0) == 1, 10, "c1b's hold")
    to_own_stream(cluster, client, "c2")
    third = ask(client, turn3, 8)
    history = (len(turn2) + len(out2) - 1) // BS * BS
    assert list(third.token_ids) == out3 and third.cached_tokens == history
    wait_for(lambda: load_of(cluster, "c2").get("kv_pulled_tokens") == history, 10, "c2's pull counters")


def test_a_puller_with_another_kv_secret_computes_the_history(cluster, tiny):
    """c2 runs with another cluster secret than c1 (PDQ_KV_SECRET): c1's ticket does not
    verify there, the pull is refused before any byte moves, and the history is computed:
    the no-cache tokens, nothing cached, a failed pull counted."""
    from pdqueue.client import Client

    out1, turn2, out2 = turns(tiny)
    cluster.start_together(("colocated", "--routing", "off", {"worker_id": "c1"}),
                           ("colocated", "--routing", "off", "--kv-pull", "always",
                            {"worker_id": "c2", "env": {"PDQ_KV_SECRET": "ab" * 32}}))
    client = Client(cluster.redis_url, cluster.cluster)
    first_turn_held(cluster, client, "c1", out1)
    to_own_stream(cluster, client, "c2")
    second = ask(client, turn2, 8)
    assert list(second.token_ids) == out2 and second.cached_tokens == 0
    wait_for(lambda: load_of(cluster, "c2").get("kv_pull_failed") == 1, 10, "c2's failed pull")
    assert load_of(cluster, "c2")["kv_pulled_tokens"] == 0
