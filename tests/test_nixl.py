"""The ``nixl`` KV path (transfer/nixl.py) against a real sender process and real NIXL agents
over UCX (no mocks): bit-exact one-sided reads into shuffled destination blocks, a suffix of
the ticket's blocks (``first_block``), the lease and incarnation fences, the KV secret
gating the agent metadata, a dead sender. The pipeline test (real prefill and decode
workers with ``--transfer nixl``) is in tests/test_pipeline.py's style at the end.

Skipped as a whole where NIXL is not installed (``pip install 'pdqueue[rdma]'``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from pdqueue.transfer.nixl import nixl_missing

_MISSING = nixl_missing()
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(_MISSING is not None, reason=f"the nixl path needs NIXL: {_MISSING}")]

from pdqueue.transfer import FailureCode, KVAuth, KVReceiver, TransferError, generate_secret  # noqa: E402
from pdqueue.transfer.zmq import ControlClient  # noqa: E402
from tests.helpers import FAST, wait_for, wait_pools_free  # noqa: E402
from tests.kv_peers import (  # noqa: E402
    NODE,
    SHM_DIR,
    SMALL,
    Receiver,
    SenderProcess,
    no_segment_left_behind,  # noqa: F401 (an autouse fixture)
    resign,
    rid,
)
from tests.test_transfer import assert_copied, poll_until, shuffled  # noqa: E402


@pytest.fixture(scope="module")
def sender():
    proc = SenderProcess(nixl=True)
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def receiver():
    pool = SMALL.allocate()
    with Receiver(pool, SMALL, NODE, mode="nixl", timeout_s=5) as r:
        yield r, pool


@pytest.fixture
def local(receiver):
    r, pool = receiver
    pool.zero_()
    return r, pool


@pytest.mark.parametrize("num_blocks", [1, 3, 11])
def test_nixl_read_is_bit_exact_into_shuffled_blocks(sender, local, num_blocks):
    r, pool = local
    src_ids, dst_ids = shuffled(64, num_blocks), shuffled(64, num_blocks)[::-1]
    result = r.fetch(sender.export(rid(), src_ids), dst_ids)
    assert result.path == "nixl"
    assert result.nbytes == num_blocks * 2 * SMALL.num_layers * SMALL.block_nbytes
    assert_copied(pool, dst_ids, sender.expected(), src_ids)


def test_nixl_reads_into_a_pool_of_another_size(sender):
    """Remote addresses follow the sender's layout (its block count), local ones the receiver's."""
    import dataclasses

    layout = dataclasses.replace(SMALL, num_blocks=24)
    pool = layout.allocate()
    src_ids = [63, 0, 31, 32]
    with Receiver(pool, layout, NODE, mode="nixl", timeout_s=5) as r:
        r.fetch(sender.export(rid(), src_ids), [23, 5, 6, 0])
    assert_copied(pool, [23, 5, 6, 0], sender.expected(), src_ids)


def test_nixl_reads_only_the_blocks_after_first_block(sender, local):
    r, pool = local
    src_ids = [5, 6, 7, 20, 21, 40]
    result = r.fetch(sender.export(rid(), src_ids), [9, 10, 11], first_block=3)
    assert result.nbytes == 3 * 2 * SMALL.num_layers * SMALL.block_nbytes
    assert_copied(pool, [9, 10, 11], sender.expected(), [20, 21, 40])


def test_nixl_metadata_is_fetched_once_per_sender_and_leases_come_back_once(sender, local):
    r, pool = local
    sender.poll()
    tickets = [sender.export(rid(), [50 + i]) for i in range(3)]
    for i, ticket in enumerate(tickets):
        r.fetch(ticket, [i])
    transport = r._transports["nixl"]
    assert [k[1:] for k in transport._remotes] == [(sender.worker_id, sender.incarnation)]
    freed = poll_until(sender, tickets)   # the fire-and-forget releases, each lease exactly once
    assert sorted(freed) == sorted((t.request_id, (50 + i,)) for i, t in enumerate(tickets))
    with pytest.raises(TransferError) as err:   # handed back: no second read under that ticket
        r.fetch(tickets[0], [0])
    assert err.value.code == FailureCode.UNKNOWN_REQUEST


def test_nixl_refuses_an_expired_lease(sender, local):
    r, pool = local
    ticket = sender.export(rid(), [60, 61], lease_s=0.2)
    time.sleep(0.4)
    with pytest.raises(TransferError) as err:
        r.fetch(ticket, [0, 1])
    assert err.value.code == FailureCode.LEASE_EXPIRED
    assert not pool.any(), "a refused read must not write the destination blocks"
    sender.poll()


def test_nixl_refuses_another_incarnation(sender, local):
    r, pool = local
    ticket = sender.export(rid(), [62])
    with pytest.raises(TransferError) as err:   # the sender itself refuses (metadata and acquire alike)
        r.fetch(resign(ticket, incarnation="an-earlier-life"), [0])
    assert err.value.code == FailureCode.STALE_INCARNATION
    pool_b = SMALL.allocate()
    with Receiver(pool_b, SMALL, NODE, mode="nixl", timeout_s=5,
                  is_current=lambda worker, incarnation: False) as fenced:   # a registry says: replaced
        with pytest.raises(TransferError) as err:
            fenced.fetch(ticket, [0])
    assert err.value.code == FailureCode.STALE_INCARNATION
    assert not pool.any() and not pool_b.any()
    r.fetch(ticket, [0])   # the real ticket still reads
    assert_copied(pool, [0], sender.expected(), [62])


def test_nixl_metadata_needs_the_cluster_secret(sender):
    ticket = sender.export(rid(), [63])
    before = sender.auth_failures()
    for auth in (None, KVAuth(generate_secret(), "test-cluster")):   # no secret; another secret
        control = ControlClient(2, auth)
        try:
            with pytest.raises(TransferError) as err:
                control._call(ticket, "nixl_md")
            assert err.value.code == FailureCode.AUTH_FAILED
        finally:
            control.close()
    pool = SMALL.allocate()
    with KVReceiver(pool, SMALL, NODE, mode="nixl", timeout_s=2) as unauthenticated:   # skips the MAC check
        with pytest.raises(TransferError) as err:
            unauthenticated.fetch(ticket, [0])
    assert err.value.code == FailureCode.AUTH_FAILED and not pool.any()
    # Refused and counted by the sender: the two requests without a session (the one with
    # another secret stopped at the handshake: the sender's proof did not verify).
    assert sender.auth_failures() == before + 2


def test_a_sender_without_nixl_is_refused_clearly():
    plain = SenderProcess()
    try:
        pool = SMALL.allocate()
        with Receiver(pool, SMALL, NODE, mode="nixl", timeout_s=5) as r:
            with pytest.raises(TransferError) as err:
                r.fetch(plain.export(rid(), [1]), [0])
        assert err.value.code == FailureCode.SEGMENT_UNAVAILABLE and "runs no NIXL agent" in err.value.reason
    finally:
        plain.close()


def test_nixl_read_from_a_stuck_then_dead_sender_fails_in_time():
    """A SIGSTOPped sender: the fetch gives up within the timeout, the sender's agent is
    unloaded, and nothing lands in the destination blocks after it resumes; a resumed sender
    serves again (metadata loaded afresh). Then a SIGKILLed one: the fetch fails in time."""
    peer = SenderProcess(nixl=True)
    pid, stopped = peer.proc.pid, False
    try:
        pool = SMALL.allocate()
        with Receiver(pool, SMALL, NODE, mode="nixl", timeout_s=1) as r:
            r.fetch(peer.export(rid(), [1]), [0])   # metadata loaded, connection made
            for how in ("stop", "kill"):
                ticket = peer.export(rid(), [2, 3] if how == "stop" else [8, 9])   # [2, 3] stay leased
                pool.zero_()
                os.kill(pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
                stopped = how == "stop"
                # The signal takes effect asynchronously: wait until the sender is stopped or gone.
                wait_for(lambda: _state(pid) in ("T", "Z", None), timeout=10, what=f"sender {how}")
                started = time.monotonic()
                with pytest.raises(TransferError) as err:
                    r.fetch(ticket, [4, 5])
                assert err.value.code == FailureCode.PEER_TIMEOUT, how
                assert time.monotonic() - started < 4, how
                assert not r._transports["nixl"]._remotes, f"{how}: the sender's agent must be unloaded"
                if how == "stop":
                    os.kill(pid, signal.SIGCONT)
                    stopped = False
                    time.sleep(0.5)
                    assert not pool.any(), "nothing may land in the destination blocks after a failed fetch"
                    r.fetch(peer.export(rid(), [6]), [7])   # resumed: served again
                    assert_copied(pool, [7], peer.expected(), [6])
                    peer.poll()
        peer.proc.join(10)
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        if peer.proc.is_alive():
            peer.kill()
        os.unlink(os.path.join(SHM_DIR, peer.info["segment"]))   # its owner was killed


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z, ...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None


# -- real prefill and decode workers --------------------------------------------------------

@pytest.fixture
def workers(redis_url, tmp_path):
    """Real worker processes; a killed prefill worker's segment is waited for (swept)."""
    from tests.cluster import Cluster

    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_and_check(killed_ok=True)


def test_pipeline_over_nixl_matches_colocated_engine(workers, tiny):
    from tests.test_pipeline import run_and_compare

    workers.start("prefill", "--transfer", "nixl", worker_id="prefill0")
    workers.start("decode", "--transfer", "nixl", worker_id="decode0")
    run_and_compare(workers, tiny, n=8, expect_path="nixl")
    wait_pools_free(workers)
    assert "loaded NIXL agent pdq-" in workers.log("decode0")


def test_dead_nixl_sender_is_recomputed_and_nothing_is_lost(workers, tiny):
    """The prefill worker is SIGKILLed once its handoffs are out: its agent is gone with it,
    so every nixl read fails (no answer to ``nixl_md``/``acquire``) and the decode worker
    recomputes each request, with the colocated engine's tokens, each answered once."""
    from pdqueue.keys import Keys
    from tests.test_faults import check_all, submit

    workers.start("prefill", *FAST, "--lease-s", "3", "--transfer", "nixl", worker_id="p0")
    client, handles, ids, expected = submit(workers, tiny, 4, 10)
    r = redis.Redis.from_url(workers.redis_url)
    wait_for(lambda: r.xlen(Keys().handoff) == 4, what="4 handoffs")
    workers.signal("p0", signal.SIGKILL)
    workers.procs["p0"].wait()
    workers.start("decode", *FAST, "--transfer", "nixl", worker_id="d0")
    results = check_all(workers, tiny, client, handles, ids, expected)
    assert {res.transfer_path for res in results} == {"recompute"}
    wait_for(lambda: not workers.segments(["p0"]), timeout=30, what="p0's segment swept")
    wait_pools_free(workers)
