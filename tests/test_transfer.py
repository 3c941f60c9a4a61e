"""KV transport against real processes, shared memory and sockets (no mocks).

A sender runs in a spawned child (``tests.kv_peers.SenderProcess``): it creates its pool in a
shm segment, fills it with seeded values, and exports tickets on command (over a Pipe). The
test process is the receiver. Segments use a per-run name prefix in /dev/shm; none may be
left behind. Senders and receivers authenticate with the cluster secret ``AUTH``, as workers
do by default (tests/test_kv_auth.py tests the authentication itself).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import random
import signal
import socket
import threading
import time
import uuid

import pytest
import torch

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.transfer import (
    FailureCode,
    KVReceiver,
    LeaseTable,
    SharedKVPool,
    Ticket,
    TransferError,
    cleanup_segments,
    node_id,
    wire,
)
from pdqueue.transfer.base import TRANSFER_VERSION
from pdqueue.transfer.blocks import plan_frames
from pdqueue.transfer.tcp import recv_control, send_control
from tests.kv_peers import (  # noqa: F401 (an autouse fixture)
    NODE,
    PREFIX,
    SHM_DIR,
    SMALL,
    Receiver,
    SenderProcess,
    no_segment_left_behind,
    own_segments,
    resign,
    rid,
)

pytestmark = pytest.mark.timeout(120)



@pytest.fixture(scope="module")
def sender():
    proc = SenderProcess()
    yield proc
    proc.close()


@pytest.fixture
def local_pool():
    return SMALL.allocate()


def shuffled(n: int, k: int) -> list[int]:
    return random.Random(k * 7919 + n).sample(range(n), k)


def assert_copied(dst_pool, dst_ids, expected, src_ids) -> None:
    assert torch.equal(dst_pool[:, :, dst_ids], expected[:, :, src_ids])
    untouched = [b for b in range(dst_pool.shape[2]) if b not in set(dst_ids)]
    assert not dst_pool[:, :, untouched].any(), "blocks outside dst_block_ids were written"


# -- the data paths ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["shm", "tcp", "zmq", "auto"])
@pytest.mark.parametrize("num_blocks", [1, 3, 11])   # 11 blocks: planes split across frames
def test_fetch_is_bit_exact_into_shuffled_blocks(sender, local_pool, mode, num_blocks):
    src_ids, dst_ids = shuffled(64, num_blocks), shuffled(64, num_blocks)[::-1]
    ticket = sender.export(rid(), src_ids)
    with Receiver(local_pool, SMALL, NODE, mode=mode, timeout_s=5) as receiver:
        result = receiver.fetch(ticket, dst_ids)
    assert result.path == ("shm" if mode == "auto" else mode)
    assert result.nbytes == num_blocks * 2 * SMALL.num_layers * SMALL.block_nbytes
    assert_copied(local_pool, dst_ids, sender.expected(), src_ids)


def test_auto_across_nodes_prefers_tcp_and_falls_back_to_zmq(sender, local_pool):
    src_ids = shuffled(64, 11)
    assert len(plan_frames(4, 11, SMALL.block_nbytes, 1024)) == 12   # 4 planes x 3 block ranges
    with Receiver(local_pool, SMALL, "another-node", mode="auto", timeout_s=5) as receiver:
        ticket = sender.export(rid(), src_ids)
        assert receiver.fetch(ticket.to_dict(), list(range(11))).path == "tcp"
        assert_copied(local_pool, list(range(11)), sender.expected(), src_ids)
        local_pool.zero_()
        without = sender.export(rid(), src_ids, data_endpoint="")   # as a ZeroMQ-only sender issues it
        assert receiver.fetch(without, list(range(11))).path == "zmq"
        assert_copied(local_pool, list(range(11)), sender.expected(), src_ids)
        local_pool.zero_()
        refused = sender.export(rid(), src_ids, data_endpoint=f"tcp://127.0.0.1:{free_port()}")
        assert receiver.fetch(refused, list(range(11))).path == "zmq"   # e.g. a firewall: ZeroMQ still works
    assert_copied(local_pool, list(range(11)), sender.expected(), src_ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_until(sender: SenderProcess, tickets: list[Ticket], timeout: float = 5.0) -> list:
    """What the engine thread would free of ``tickets``' leases, polled until all came back
    (releases are fire-and-forget, so those of earlier tests may land meanwhile: skipped),
    then polled a little longer to catch a second hand-back of any of them."""
    ids = {t.request_id for t in tickets}
    freed, deadline = [], time.monotonic() + timeout
    while len(freed) < len(ids) and time.monotonic() < deadline:
        freed += [item for item in sender.poll() if item[0] in ids]
        time.sleep(0.01)
    time.sleep(0.1)
    return freed + [item for item in sender.poll() if item[0] in ids]


def test_release_returns_blocks_to_the_engine_exactly_once(sender, local_pool):
    sender.poll()
    tickets = [sender.export(rid(), [10 + i, 30 + i]) for i in range(3)]
    with Receiver(local_pool, SMALL, NODE, timeout_s=5) as shm, \
            Receiver(local_pool, SMALL, NODE, mode="zmq", timeout_s=5) as zmq, \
            Receiver(local_pool, SMALL, NODE, mode="tcp", timeout_s=5) as tcp:
        shm.fetch(tickets[0], [0, 1])   # every release is fire-and-forget: poll until they land
        zmq.fetch(tickets[1], [2, 3])
        tcp.fetch(tickets[2], [4, 5])
        freed = poll_until(sender, tickets)   # exactly once each
        assert sorted(freed) == sorted([(tickets[0].request_id, (10, 30)), (tickets[1].request_id, (11, 31)),
                                        (tickets[2].request_id, (12, 32))])
        # Handed back: a ticket cannot be fetched again (the shm path sees the bumped epochs).
        for receiver, code in ((shm, FailureCode.LEASE_EXPIRED), (zmq, FailureCode.UNKNOWN_REQUEST),
                               (tcp, FailureCode.UNKNOWN_REQUEST)):
            with pytest.raises(TransferError) as err:
                receiver.fetch(tickets[0], [0, 1])
            assert err.value.code == code


@pytest.mark.parametrize("mode", ["shm", "tcp", "zmq"])
def test_expired_lease_frees_blocks_and_fetch_fails(sender, local_pool, mode):
    sender.poll()
    before = sender.export(rid(), [40, 41], lease_s=0.2)   # fetched after expiry, before poll
    after = sender.export(rid(), [42], lease_s=0.2)        # fetched after the engine polled
    time.sleep(0.4)   # 2x the leases
    with Receiver(local_pool, SMALL, NODE, mode=mode, timeout_s=5) as receiver:
        if mode == "shm":
            # Past its deadline but not handed back: the blocks are intact, and the epochs
            # say so, so the copy stands (the sender is never asked).
            receiver.fetch(before, [0, 1])
            assert torch.equal(local_pool[:, :, [0, 1]], sender.expected()[:, :, [40, 41]])
        else:
            with pytest.raises(TransferError) as err:   # the sender refuses to serve it
                receiver.fetch(before, [0, 1])
            assert err.value.code == FailureCode.LEASE_EXPIRED
        freed = poll_until(sender, [before, after])
        assert sorted(freed) == sorted([(before.request_id, (40, 41)), (after.request_id, (42,))])
        with pytest.raises(TransferError) as err:
            receiver.fetch(after, [2])
        assert err.value.code == FailureCode.LEASE_EXPIRED


@pytest.mark.parametrize("mode", ["shm", "tcp", "zmq", "auto"])
def test_stale_incarnation_is_rejected(sender, local_pool, mode):
    ticket = sender.export(rid(), [5])
    stale = resign(ticket, incarnation="0" * 12)
    with Receiver(local_pool, SMALL, NODE, mode=mode, timeout_s=5) as receiver:
        with pytest.raises(TransferError) as err:
            receiver.fetch(stale, [0])
        assert err.value.code == FailureCode.STALE_INCARNATION
        receiver.fetch(ticket, [0])   # the genuine ticket still works
    checked = Receiver(local_pool, SMALL, NODE, is_current=lambda worker, inc: False)
    with checked, pytest.raises(TransferError) as err:
        checked.fetch(sender.export(rid(), [6], lease_s=0.2), [0])   # never fetched: let it expire
    assert err.value.code == FailureCode.STALE_INCARNATION


@pytest.mark.parametrize("mode", ["shm", "tcp", "zmq", "auto"])
def test_nonce_mismatch_is_rejected(sender, local_pool, mode):
    ticket = resign(sender.export(rid(), [7], lease_s=0.2), nonce="ab" * 16)   # never fetched
    with Receiver(local_pool, SMALL, NODE, mode=mode, timeout_s=5) as receiver:
        with pytest.raises(TransferError) as err:
            receiver.fetch(ticket, [0])
    assert err.value.code == FailureCode.NONCE_MISMATCH
    assert not local_pool.any()


def test_bad_tickets_are_rejected_before_any_io(sender, local_pool):
    ticket = sender.export(rid(), [8, 9])
    other = dataclasses.replace(SMALL, head_dim=16)
    cases = {
        FailureCode.VERSION_MISMATCH: (dataclasses.replace(ticket, version=99), [0, 1]),
        FailureCode.LAYOUT_MISMATCH: (resign(ticket, layout=other.to_dict()), [0, 1]),
        FailureCode.BAD_TICKET: (ticket, [0, 0]),
    }
    with Receiver(local_pool, SMALL, NODE, timeout_s=5) as receiver:
        for code, (bad, dst) in cases.items():
            with pytest.raises(TransferError) as err:
                receiver.fetch(bad, dst)
            assert err.value.code == code
        with pytest.raises(TransferError) as err:
            receiver.fetch({"version": 1}, [0])
        assert err.value.code == FailureCode.BAD_TICKET
        receiver.fetch(ticket, [0, 1])


def test_fetches_from_background_threads(sender, local_pool):
    tickets = [(sender.export(rid(), [50 + i, 20 + i]), [2 * i, 2 * i + 1]) for i in range(6)]
    errors = []
    with Receiver(local_pool, SMALL, NODE, timeout_s=5) as receiver:
        def work(items):
            try:
                for ticket, dst in items:
                    receiver.fetch(ticket, dst)
            except Exception as exc:   # pragma: no cover - reported below
                errors.append(exc)
        threads = [threading.Thread(target=work, args=(tickets[i::2],)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert not errors
    expected = sender.expected()
    for ticket, dst in tickets:
        assert torch.equal(local_pool[:, :, dst], expected[:, :, list(ticket.block_ids)])


# -- failures of the sender ------------------------------------------------------------------

def test_killed_sender_fails_fast_and_its_segment_is_cleaned_up(sender, local_pool):
    victim = SenderProcess(seed=2)
    tickets = {mode: victim.export(rid(), [1 + i, 10 + i]) for i, mode in enumerate(("shm", "tcp", "zmq"))}
    assert victim.info["segment"] in own_segments()
    victim.kill()
    # Its segment outlives it, and nobody can rewrite blocks any more: the copy is good.
    with Receiver(local_pool, SMALL, NODE, mode="shm", timeout_s=0.5) as receiver:
        receiver.fetch(tickets.pop("shm"), [0, 1])
    assert torch.equal(local_pool[:, :, [0, 1]], victim.expected()[:, :, [1, 10]])
    for mode, ticket in tickets.items():
        with Receiver(local_pool, SMALL, NODE, mode=mode, timeout_s=0.5) as receiver:
            start = time.monotonic()
            with pytest.raises(TransferError) as err:
                receiver.fetch(ticket, [2, 3])
            assert time.monotonic() - start < 2.0
            assert err.value.code == FailureCode.PEER_TIMEOUT
    live = {(sender.worker_id, sender.incarnation)}
    removed = cleanup_segments(lambda worker, inc: (worker, inc) in live, name_prefix=PREFIX)
    assert removed == [victim.info["segment"]]
    assert own_segments() == [sender.info["segment"]]


def test_tcp_reconnects_once_to_a_sender_restarted_on_a_pinned_port(local_pool):
    port = free_port()
    with Receiver(local_pool, SMALL, "another-node", mode="tcp", timeout_s=5) as receiver:
        for seed in (5, 6):   # the second sender takes over the port; the kept connection is dead
            proc = SenderProcess(seed=seed, data_port=port)
            try:
                assert proc.info["data_endpoint"] == f"tcp://127.0.0.1:{port}"
                assert receiver.fetch(proc.export(rid(), [4, 5]), [0, 1]).path == "tcp"
                assert torch.equal(local_pool[:, :, [0, 1]], proc.expected()[:, :, [4, 5]])
            finally:
                proc.close()


def _bad_data_server(behaviour: str) -> tuple[socket.socket, threading.Thread]:
    """A TCP data server that misbehaves once: answers a fetch the way ``behaviour`` says."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            request = recv_control(conn)
            nbytes = 2 * SMALL.num_layers * SMALL.block_nbytes
            header = {"v": TRANSFER_VERSION, "seq": request["seq"], "ok": True, "request_id": request["request_id"],
                      "block_ids": [60], "shape": [SMALL.num_layers, 2, 1, SMALL.block_size, SMALL.num_kv_heads,
                                                   SMALL.head_dim], "dtype": SMALL.dtype, "nbytes": nbytes}
            if behaviour == "wrong_size":
                send_control(conn, {**header, "nbytes": nbytes + 4})
            elif behaviour == "other_blocks":
                send_control(conn, {**header, "block_ids": [61]})
            elif behaviour == "short_stream":
                send_control(conn, header)
                conn.sendall(b"\0" * (nbytes // 2))
            elif behaviour == "huge_control":
                conn.sendall((1 << 30).to_bytes(4, "little"))
            elif behaviour == "not_a_map":
                send_control(conn, wire.pack([1, 2, 3]))
            elif behaviour == "silent":
                time.sleep(2)
            conn.recv(1)   # wait for the receiver to give up

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize("behaviour,code", [
    ("wrong_size", FailureCode.BAD_REPLY), ("other_blocks", FailureCode.BAD_REPLY),
    ("short_stream", FailureCode.PEER_TIMEOUT), ("huge_control", FailureCode.BAD_REPLY),
    ("not_a_map", FailureCode.BAD_REPLY), ("silent", FailureCode.PEER_TIMEOUT),
])
def test_tcp_receiver_refuses_a_misbehaving_sender(sender, local_pool, behaviour, code):
    """Whatever comes back, the fetch fails fast with a clear code and does not hang."""
    listener, thread = _bad_data_server(behaviour)
    ticket = dataclasses.replace(sender.export(rid(), [60], lease_s=0.2),
                                 data_endpoint=f"tcp://127.0.0.1:{listener.getsockname()[1]}")
    try:
        # Without authentication: these servers test the wire's checks behind the handshake.
        with KVReceiver(local_pool, SMALL, "another-node", mode="tcp", timeout_s=0.5) as receiver:
            start = time.monotonic()
            with pytest.raises(TransferError) as err:
                receiver.fetch(ticket, [0])
            assert time.monotonic() - start < 2.0
        assert err.value.code == code, err.value
    finally:
        listener.close()
        thread.join(5)


def test_bf16_pool_and_clean_close_leaves_no_segment(local_pool):
    layout = dataclasses.replace(SMALL, dtype="bfloat16")
    proc = SenderProcess(layout, seed=3, max_frame_bytes=512)
    dst_pool = layout.allocate()
    try:
        for mode in ("shm", "tcp", "zmq"):
            ticket = proc.export(rid(), [3, 9, 4])
            with Receiver(dst_pool, layout, NODE, mode=mode, timeout_s=5) as receiver:
                receiver.fetch(ticket, [60, 2, 61])
            assert torch.equal(dst_pool[:, :, [60, 2, 61]], proc.expected()[:, :, [3, 9, 4]])
    finally:
        proc.close()
    assert proc.info["segment"] not in own_segments()


# -- the pieces on their own --------------------------------------------------------------------

def test_lease_table_hands_blocks_back_exactly_once():
    now = [100.0]
    table = LeaseTable(lease_s=10, clock=lambda: now[0])
    table.add("a", [1, 2], 5)
    table.add("b", [3], 2)
    table.add("c", [4], 2)
    with pytest.raises(ValueError):
        table.add("a", [9], 1)
    assert table.acquire("a") and table.release("a")
    assert table.poll_freeable() == [("a", (1, 2))]
    assert table.poll_freeable() == [] and not table.release("a") and not table.acquire("a")
    now[0] = 105.0
    assert table.acquire("b")          # pins: deadline is now 115
    now[0] = 111.0
    assert table.expire() == 1         # c expired (deadline 110); b is pinned
    assert not table.acquire("c")
    assert table.release("c")          # bytes still intact: not yet handed back
    assert table.poll_freeable() == [("c", (4,))]
    now[0] = 116.0
    assert table.poll_freeable() == [("b", (3,))]
    assert not table.release("b")      # too late: the engine may already reuse block 3
    assert len(table) == 0 and table.num_held_blocks() == 0


def test_lease_table_refuses_leased_blocks_and_holds_while_sending():
    now = [0.0]
    table = LeaseTable(lease_s=10, clock=lambda: now[0])
    table.add("a", [1, 2], 5)
    with pytest.raises(ValueError):
        table.add("b", [2, 3], 5)      # block 2 belongs to a's lease
    assert table.held_blocks() == {1, 2}
    sending = [True]
    table.hold_until("a", lambda: not sending[0])
    assert table.release("a")
    assert table.poll_freeable() == []   # released, but still being read
    now[0] = 100.0
    assert table.poll_freeable() == []   # not even expiry hands it back meanwhile
    sending[0] = False
    assert table.poll_freeable() == [("a", (1, 2))]
    assert table.held_blocks() == set()
    table.add("b", [2, 3], 5)          # free again


def test_node_id_is_shared_created_once_and_overridable(tmp_path, monkeypatch):
    monkeypatch.delenv("PDQ_NODE_ID", raising=False)
    ids = []
    threads = [threading.Thread(target=lambda: ids.append(node_id(str(tmp_path)))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(ids)) == 1 and len(ids[0]) == 32
    assert (tmp_path / "pdq-node-id").read_text().strip() == ids[0]
    assert sorted(os.listdir(tmp_path)) == ["pdq-node-id"]   # no temporary file left
    other = tmp_path / "other-domain"
    other.mkdir()
    assert node_id(str(other)) != ids[0]
    monkeypatch.setenv("PDQ_NODE_ID", "pinned")
    assert node_id(str(tmp_path)) == "pinned"


def test_a_segment_bigger_than_dev_shm_is_a_clear_error_and_leaves_nothing():
    """A pool that /dev/shm cannot hold fails at creation with a message saying what to change,
    not with SIGBUS when the pool is first touched; no file stays behind."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    block = 2 * SMALL.num_layers * SMALL.block_nbytes
    layout = dataclasses.replace(SMALL, num_blocks=free // block + 1024)
    worker = f"w{uuid.uuid4().hex[:6]}"
    with pytest.raises(OSError, match="too little for a .* KV segment.*--kv-cache-mb"):
        SharedKVPool.create(layout, PREFIX, worker, "inc1")
    assert not [n for n in os.listdir(SHM_DIR) if worker in n]


def test_segment_header_is_validated_and_owner_unlinks():
    layout = SMALL
    worker, incarnation = f"w{uuid.uuid4().hex[:6]}", "inc1"
    owner = SharedKVPool.create(layout, PREFIX, worker, incarnation)
    try:
        with pytest.raises(FileExistsError):
            SharedKVPool.create(layout, PREFIX, worker, incarnation)
        owner.tensor[1, 0, 5].fill_(3.5)
        peer = SharedKVPool.attach(owner.name, owner.nonce)
        assert float(peer.tensor[1, 0, 5, 0, 0, 0]) == 3.5 and peer.layout == layout
        assert (peer.info.worker_id, peer.info.incarnation) == (worker, incarnation)
        peer.close()
        with pytest.raises(TransferError) as err:
            SharedKVPool.attach(owner.name, "00" * 16)
        assert err.value.code == FailureCode.NONCE_MISMATCH
        with pytest.raises(TransferError) as err:
            SharedKVPool.attach(owner.name + "-missing", owner.nonce)
        assert err.value.code == FailureCode.SEGMENT_UNAVAILABLE
    finally:
        owner.close()
    assert owner.name not in own_segments()
    junk = os.path.join(SHM_DIR, f"{PREFIX}-junk-1")
    with open(junk, "wb") as f:
        f.write(b"not a segment")
    with pytest.raises(TransferError):
        SharedKVPool.attach(os.path.basename(junk), "00")
    assert cleanup_segments(lambda w, i: True, name_prefix=PREFIX) == []           # may still be in creation
    assert cleanup_segments(lambda w, i: True, name_prefix=PREFIX, grace_s=0) == [os.path.basename(junk)]


def _owner_main(conn, prefix: str, worker_id: str, keep_s: float) -> None:
    pool = SharedKVPool.create(SMALL, prefix, worker_id, "inc1", shm_dir=SHM_DIR)
    until = time.time() + keep_s
    pool.keep_until(until)   # as a prefill worker does before publishing tickets
    conn.send((pool.name, until))
    time.sleep(120)


def test_dead_owners_segment_is_kept_until_its_last_lease_ends_then_removed():
    """An owner that dies leaves its segment until the time it set with keep_until (the end of
    its last lease, so copies under its tickets still stand), whatever the registry says;
    the first cleanup after that removes it."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    owner = ctx.Process(target=_owner_main, args=(child, PREFIX, f"w{uuid.uuid4().hex[:6]}", 3.0), daemon=True)
    owner.start()
    assert conn.poll(60), "owner child did not start"
    name, until = conn.recv()
    os.kill(owner.pid, signal.SIGKILL)
    owner.join(10)
    unregistered = lambda worker, inc: False   # noqa: E731  (what this cluster's registry says)
    assert name not in cleanup_segments(unregistered, name_prefix=PREFIX)
    assert name in own_segments() and time.time() < until
    deadline = time.monotonic() + 30
    while name in own_segments() and time.monotonic() < deadline:
        cleanup_segments(unregistered, name_prefix=PREFIX)
        time.sleep(0.05)
    assert name not in own_segments()
    assert time.time() >= until


# -- throughput sanity (printed, not asserted) --------------------------------------------------

def _best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _raw_socket_seconds(nbytes: int) -> float:
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
    sink = bytearray(nbytes)
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()

    def receive():
        view, got = memoryview(sink), 0
        while got < nbytes:
            got += client.recv_into(view[got:])

    def once():
        thread = threading.Thread(target=receive)
        thread.start()
        conn.sendall(payload)
        thread.join()
    try:
        return _best(once)
    finally:
        for s in (conn, client, server):
            s.close()


def test_throughput_sanity(capsys):
    layout = KVCacheLayout(num_layers=8, num_blocks=192, block_size=16, num_kv_heads=4, head_dim=64)  # 48 MiB
    num_blocks = 128                                                                                 # 32 MiB
    proc = SenderProcess(layout, seed=4, max_frame_bytes=16 << 20, lease_s=60)
    try:
        dst_pool = layout.allocate()
        src_ids, dst_ids = shuffled(192, num_blocks), shuffled(192, num_blocks)
        nbytes = num_blocks * 2 * layout.num_layers * layout.block_nbytes
        results = {}
        for mode in ("shm", "tcp", "zmq"):
            with Receiver(dst_pool, layout, NODE, mode=mode, timeout_s=10) as receiver:
                def timed_fetch() -> float:
                    ticket = proc.export(rid(), src_ids)   # waits for the previous release
                    start = time.perf_counter()
                    receiver.fetch(ticket, dst_ids)
                    return time.perf_counter() - start
                timed_fetch()   # warm: map the segment, connect
                results[mode] = min(timed_fetch() for _ in range(5))
            assert torch.equal(dst_pool[:, :, dst_ids], proc.expected()[:, :, src_ids])
        a, b = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        b.copy_(a)
        torch_s = _best(lambda: b.copy_(a))
        raw_s = _raw_socket_seconds(nbytes)
    finally:
        proc.close()
    gbps = {name: nbytes / s / 1e9 for name, s in {**results, "torch": torch_s, "raw": raw_s}.items()}
    with capsys.disabled():
        print(f"\n[throughput, {nbytes >> 20} MiB, {num_blocks} scattered blocks] "
              f"shm fetch {gbps['shm']:.2f} GB/s vs torch copy {gbps['torch']:.2f} GB/s; "
              f"tcp fetch {gbps['tcp']:.2f} and zmq fetch {gbps['zmq']:.2f} GB/s vs raw TCP socket "
              f"{gbps['raw']:.2f} GB/s")


def test_transfer_errors_carry_a_code_and_no_retry_flag():
    err = TransferError("gone", FailureCode.LEASE_LOST)
    assert err.code is FailureCode.LEASE_LOST and str(err) == "lease_lost: gone" and not hasattr(err, "retryable")
    reply = wire.unpack(wire.error_reply(3, FailureCode.BAD_REPLY, "bad"))
    assert reply == {"v": TRANSFER_VERSION, "seq": 3, "ok": False, "code": "bad_reply", "reason": "bad"}
