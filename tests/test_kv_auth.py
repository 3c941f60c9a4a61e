"""Authenticated KV channels and signed tickets (transfer.auth; docs/security.md), against
real senders in child processes, real worker processes, real sockets, no mocks.

- Peers without the secret (a plain request carrying a genuine ticket, a wrong secret, a
  recorded handshake replayed, a taken-over ZeroMQ identity, garbage) reach the TCP data
  port and the ZeroMQ endpoint of a live ``KVSender``: each is refused before any KV byte,
  counted in ``auth_failures`` (logged once per peer address), and the sender goes on
  serving a legitimate receiver. Fuzzed bytes never stop it.
- Receivers refuse a sender that cannot prove the secret, and tickets that are forged,
  altered, unsigned, of another cluster or of another secret, before any I/O; a sender
  refuses a ticket it did not issue. Two secrets at once (a rotation) interoperate.
- Through real workers: the cluster secret comes from Redis by default (SET NX), raw peers
  are refused by a real prefill worker, and forged, foreign and expired tickets are
  recomputed by the decode worker, token-equal to the colocated engine, nothing lost.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import socket
import struct
import threading
import time

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdqueue.client import Client
from pdqueue.keys import Keys
from pdqueue.transfer import FailureCode, KVAuth, KVReceiver, KVSender, TransferError, generate_secret, wire
from pdqueue.transfer import auth as kvauth
from pdqueue.transfer import sender as sender_module
from pdqueue.transfer.auth import ClientHandshake, parse_secrets
from pdqueue.transfer.base import TRANSFER_VERSION
from pdqueue.transfer.tcp import DataClient, parse_endpoint, recv_control, recv_frame, send_control
from pdqueue.transfer.zmq import ControlClient
from tests.cluster import Cluster
from tests.helpers import oracle, wait_for
from tests.kv_peers import AUTH, NODE, SMALL, Receiver, SenderProcess, no_segment_left_behind, resign, rid  # noqa: F401 (an autouse fixture)
from tests.oracle import assert_same_tokens

pytestmark = pytest.mark.timeout(180)

ATTACK_LEASE_S = 3.0   # tickets the tests do not fetch (or release) hold their blocks this long
OTHER_SECRET = KVAuth(generate_secret(), AUTH.cluster)       # another cluster's secret, same name
OTHER_CLUSTER = KVAuth(AUTH.key, "another-cluster")         # the same secret under another name
KV_BYTES = 2 * SMALL.num_layers * SMALL.block_nbytes        # one block's KV: what a leak would send at least




@pytest.fixture(scope="module")
def sender():
    proc = SenderProcess(lease_s=20)
    yield proc
    proc.close()


@pytest.fixture
def local_pool():
    return SMALL.allocate()


_next_block = itertools.count()


def blocks(n: int) -> list[int]:
    """Blocks no recent test leased (the sender's blocks 0..59 in turn; 60..63 are fetch_ok's)."""
    return [next(_next_block) % 60 for _ in range(n)]


def live_ticket(sender: SenderProcess, n: int = 2, **issued_as):
    """A ticket under a live lease that nobody fetches: what a leak would send."""
    return sender.export(rid(), blocks(n), ATTACK_LEASE_S, **issued_as)


def fetch_ok(sender: SenderProcess, modes=("tcp", "zmq"), node: str = "another-node") -> None:
    """A legitimate receiver still gets bit-exact KV over each path."""
    pool = SMALL.allocate()
    for mode in modes:
        ticket = sender.export(rid(), [62, 63])
        with Receiver(pool, SMALL, node, mode=mode, timeout_s=5) as receiver:
            assert receiver.fetch(ticket, [0, 1]).path == mode
        assert torch.equal(pool[:, :, [0, 1]], sender.expected()[:, :, [62, 63]])
        pool.zero_()


# -- raw peers on the TCP data wire ---------------------------------------------------------

def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def tcp_peer(endpoint: str) -> socket.socket:
    return socket.create_connection(parse_endpoint(endpoint), timeout=5)


def drain(sock: socket.socket, quiet_s: float = 1.0) -> tuple[bytes, bool]:
    """Everything the other end sends until it closes (True) or is quiet for ``quiet_s``."""
    sock.settimeout(quiet_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


def control_messages(data: bytes) -> list[dict]:
    """Parse a byte stream as control messages only; AssertionError if anything else is in it
    (raw KV bytes would be)."""
    out = []
    while data:
        assert len(data) >= 4, f"stray bytes after the control messages: {data!r}"
        (length,) = struct.unpack("<I", data[:4])
        assert length <= len(data) - 4, "a message longer than what came: raw data?"
        out.append(msgpack.unpackb(data[4:4 + length], raw=False))
        data = data[4 + length:]
    return out


def assert_refused_without_kv(data: bytes, closed: bool) -> None:
    messages = control_messages(data)
    assert len(data) < KV_BYTES
    assert closed, f"the connection stayed open after {messages}"
    assert messages and messages[-1]["ok"] is False and messages[-1]["code"] == FailureCode.AUTH_FAILED.value
    assert messages[-1]["reason"] == "authentication failed", "an unauthenticated peer learns nothing more"
    assert not any(m.get("ok") and ("nbytes" in m or "block_ids" in m) for m in messages), messages


def plain_fetch(ticket, seq: int = 1) -> bytes:
    return wire.request("fetch", seq, ticket)


def hello_with(handshake: ClientHandshake, seq: int = 1) -> bytes:
    return wire.hello(seq, handshake)


def wrong_secret_exchange(sock_send, sock_recv, ticket) -> None:
    """A peer with another cluster's secret: it ignores that the sender's proof fails for it
    and answers the challenge with its own proof."""
    handshake = ClientHandshake(OTHER_SECRET)
    sock_send(hello_with(handshake))
    challenge = sock_recv()
    assert challenge["ok"] and len(challenge["sn"]) == kvauth.NONCE_BYTES
    assert handshake.finish(challenge) is None   # the sender's proof does not verify with this secret
    session = OTHER_SECRET.session(OTHER_SECRET.key, challenge["sn"], handshake.cn)
    session.proof = OTHER_SECRET.client_proof(challenge["sn"], handshake.cn)
    sock_send(wire.seal(session, plain_fetch(ticket, 2), 2))


class RecordingProxy:
    """A TCP proxy that records what the client sends, message by message, and drops the
    client's releases (so the leases it fetched stay live for a replay)."""

    def __init__(self, upstream: str):
        self.upstream = parse_endpoint(upstream)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent: list[bytes] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.upstream)

        def back():
            try:
                while chunk := server.recv(65536):
                    client.sendall(chunk)
            except OSError:
                pass
        threading.Thread(target=back, daemon=True).start()
        try:
            while True:
                raw = recv_frame(client)
                if raw is None:
                    break
                if msgpack.unpackb(raw, raw=False).get("op") == "release":
                    continue
                self.sent.append(raw)
                server.sendall(frame(raw))
        except OSError:
            pass
        finally:
            client.close()
            server.close()
            self.listener.close()


@pytest.mark.parametrize("attack", ["plain_with_genuine_ticket", "wrong_secret", "replayed_handshake",
                                    "sealed_without_handshake", "garbage", "oversized"])
def test_tcp_data_port_refuses_peers_without_the_secret(sender, attack):
    """Each attack gets one refusal, no KV byte and a closed connection; the sender counts
    it and keeps serving the legitimate receiver."""
    ticket = live_ticket(sender)
    if attack == "replayed_handshake":
        # A legitimate fetch through a recording proxy (the sender issued the ticket with
        # the proxy's address, so the receiver's MAC check passes), then its bytes replayed.
        proxy = RecordingProxy(sender.info["data_endpoint"])
        proxied = live_ticket(sender, data_endpoint=proxy.endpoint)
        pool = SMALL.allocate()
        with Receiver(pool, SMALL, "another-node", mode="tcp", timeout_s=5) as receiver:
            receiver.fetch(proxied, [0, 1])
        assert torch.equal(pool[:, :, [0, 1]], sender.expected()[:, :, list(proxied.block_ids)])
        proxy.thread.join(5)
        assert [msgpack.unpackb(m)["op"] for m in proxy.sent] == ["hello", "sealed"]
    before = sender.auth_failures()
    peer = tcp_peer(ticket.data_endpoint)
    with peer:
        if attack == "plain_with_genuine_ticket":   # what anyone who can read Redis has
            peer.sendall(frame(plain_fetch(ticket)))
        elif attack == "wrong_secret":
            wrong_secret_exchange(lambda raw: peer.sendall(frame(raw)), lambda: recv_control(peer), ticket)
        elif attack == "replayed_handshake":
            peer.sendall(b"".join(frame(m) for m in proxy.sent))
        elif attack == "sealed_without_handshake":
            fake = kvauth.Session(secrets.token_bytes(32))
            peer.sendall(frame(wire.seal(fake, plain_fetch(ticket, 5), 5)))
        elif attack == "garbage":
            peer.sendall(frame(b"\xc1\xff garbage \x00"))
        elif attack == "oversized":
            peer.sendall(struct.pack("<I", 1 << 30) + b"x" * 100)
        data, closed = drain(peer)
    if attack == "oversized":   # refused before a reply could be framed: just closed
        assert data == b"" and closed
    else:
        assert_refused_without_kv(data, closed)
    assert sender.auth_failures() == before + 1
    fetch_ok(sender, ("tcp",))


# -- raw peers on the ZeroMQ endpoint -------------------------------------------------------

@pytest.fixture(scope="module")
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def dealer(ctx: zmq.Context, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(endpoint)
    return sock


def zmq_replies(sock: zmq.Socket, quiet_s: float = 0.5, first_s: float = 5.0) -> list[list[bytes]]:
    """Every message that comes until none has come for ``quiet_s`` (the first may take ``first_s``)."""
    out, wait = [], first_s
    while sock.poll(int(wait * 1000), zmq.POLLIN):
        out.append(sock.recv_multipart())
        wait = quiet_s
    return out


def assert_zmq_refused(messages: list[list[bytes]], told: bool = False) -> None:
    assert len(messages) == 1 and len(messages[0]) == 1, f"more than one refusal: data frames? {messages}"
    reply = msgpack.unpackb(messages[0][0], raw=False)
    assert reply["ok"] is False and reply["code"] == FailureCode.AUTH_FAILED.value, reply
    if not told:
        assert reply["reason"] == "authentication failed"
    assert not any(len(m) > 1 or len(b"".join(m)) >= SMALL.block_nbytes for m in messages)


def legit_zmq_exchange(sock: zmq.Socket, tickets) -> list[bytes]:
    """A legitimate receiver's messages on a raw DEALER (hello, then one sealed fetch per
    ticket, taking the KV each time, releasing nothing); returns what it sent."""
    handshake, sent, seq = ClientHandshake(AUTH), [], 1
    sent.append(wire.hello(seq, handshake))
    sock.send(sent[-1])
    session = handshake.finish(msgpack.unpackb(sock.recv(), raw=False))
    assert session is not None
    for ticket in tickets:
        seq += 1
        sent.append(wire.seal(session, plain_fetch(ticket, seq), seq))
        sock.send(sent[-1])
        header = msgpack.unpackb(sock.recv(), raw=False)
        assert header["ok"], header
        for _ in range(header["num_frames"]):
            assert len(sock.recv_multipart()) == 2
    return sent


@pytest.mark.parametrize("attack", ["plain_with_genuine_ticket", "wrong_secret", "replayed_handshake",
                                    "taken_over_identity", "garbage"])
def test_zmq_endpoint_refuses_peers_without_the_secret(sender, zctx, attack):
    ticket = live_ticket(sender)
    endpoint, refusals = ticket.endpoint, 1
    if attack in ("replayed_handshake", "taken_over_identity"):
        identity = b"victim-" + secrets.token_hex(4).encode()
        victim = dealer(zctx, endpoint, identity if attack == "taken_over_identity" else None)
        recorded = legit_zmq_exchange(victim, [live_ticket(sender, 1), live_ticket(sender, 1)])
        victim.close()
        time.sleep(0.3)   # the ROUTER notices the disconnect and frees the identity
    before = sender.auth_failures()
    peer = dealer(zctx, endpoint, identity if attack == "taken_over_identity" else None)
    try:
        if attack == "plain_with_genuine_ticket":
            peer.send(plain_fetch(ticket))
            assert_zmq_refused(zmq_replies(peer))
        elif attack == "wrong_secret":
            wrong_secret_exchange(peer.send, lambda: msgpack.unpackb(peer.recv(), raw=False), ticket)
            assert_zmq_refused(zmq_replies(peer))
        elif attack == "replayed_handshake":
            peer.send(recorded[0])   # hello: a fresh challenge comes back
            assert msgpack.unpackb(peer.recv(), raw=False)["ok"]
            peer.send(recorded[1])   # the first fetch with the recorded proof: refused
            assert_zmq_refused(zmq_replies(peer))
        elif attack == "taken_over_identity":
            # The victim's session is still in the sender's table under this identity: a
            # replayed request and a request with a made-up tag are both refused.
            peer.send(recorded[2])
            assert_zmq_refused(zmq_replies(peer))
            body = plain_fetch(ticket, 99)
            peer.send(wire.pack({"v": TRANSFER_VERSION, "op": "sealed", "seq": 99, "body": body,
                                 "tag": secrets.token_bytes(kvauth.TAG_BYTES)}))
            assert_zmq_refused(zmq_replies(peer))
            refusals = 2
        elif attack == "garbage":
            peer.send_multipart([b"\xc1\xc1", b"\x00" * 10, os.urandom(300)])
            assert_zmq_refused(zmq_replies(peer))
    finally:
        peer.close()
    assert sender.auth_failures() == before + refusals
    if attack == "garbage":
        # Not even ZeroMQ: libzmq may read random bytes as old-style (ZMTP 1.0) messages,
        # which are refused like any other (how many depends on the bytes).
        raw = socket.create_connection(parse_endpoint(endpoint))
        raw.sendall(os.urandom(4096))
        raw.close()
    fetch_ok(sender, ("zmq",))


def test_refusals_are_counted_and_logged_once_per_peer(caplog, monkeypatch):
    """In-process sender (its log is this process's): refusals from one address are all
    counted, logged once; a connection that never authenticates is closed in time."""
    monkeypatch.setattr(sender_module, "HANDSHAKE_TIMEOUT_S", 0.5)
    pool = SMALL.allocate()
    with KVSender(pool, SMALL, "w-log", "inc-log", NODE, auth=AUTH) as kv, \
            caplog.at_level(logging.WARNING, logger="pdqueue.transfer.sender"):
        ticket = kv.export(rid(), [1], 3)
        for _ in range(3):
            with tcp_peer(kv.data_endpoint) as peer:
                peer.sendall(frame(plain_fetch(ticket)))
                assert_refused_without_kv(*drain(peer))
        with zmq.Context() as ctx:
            peer = dealer(ctx, kv.endpoint)
            for _ in range(2):
                peer.send(plain_fetch(ticket))
                assert_zmq_refused(zmq_replies(peer))
            peer.close()
        idle = tcp_peer(kv.data_endpoint)
        start = time.monotonic()
        data, closed = drain(idle, quiet_s=5)
        assert closed and data == b"" and time.monotonic() - start < 3
        idle.close()
        assert kv.auth_failures == 6
        refusals = [r for r in caplog.records if "refused a peer" in r.getMessage()]
        assert [r.getMessage().split(" at ")[1].split(":")[0] for r in refusals] == ["127.0.0.1", "zmq"], refusals
        # Still serving: a legitimate fetch (in this process) over both wires.
        dst = SMALL.allocate()
        for mode, src in (("tcp", [5, 6]), ("zmq", [7, 8])):
            with KVReceiver(dst, SMALL, "another-node", mode=mode, timeout_s=5, auth=AUTH) as receiver:
                receiver.fetch(kv.export(rid(), src, 7), [0, 1])
            assert torch.equal(dst[:, :, [0, 1]], pool[:, :, src])


def test_receiver_handshakes_again_with_a_sender_restarted_on_its_port():
    """A sender restarted on a pinned ZeroMQ port does not know the receiver's session: the
    receiver is told so, handshakes again on a new socket and fetches, without a failure."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool, dst = SMALL.allocate(), SMALL.allocate()
    pool.normal_()
    with KVReceiver(dst, SMALL, "another-node", mode="zmq", timeout_s=5, auth=AUTH) as receiver:
        for incarnation in ("first", "second"):
            with KVSender(pool, SMALL, "w-restart", incarnation, NODE, endpoint=f"tcp://127.0.0.1:{port}",
                          data_port=None, auth=AUTH) as kv:
                receiver.fetch(kv.export(rid(), [1, 2], 7), [0, 1])
                assert torch.equal(dst[:, :, [0, 1]], pool[:, :, [1, 2]])
                dst.zero_()
                refused = kv.auth_failures
        assert receiver.auth_failures == 0 and refused == 1   # the second sender refused the old session once


# -- fuzzing ----------------------------------------------------------------------------------

_value = st.one_of(st.binary(max_size=40), st.integers(-2**63, 2**64 - 1), st.text(max_size=10), st.none(),
                   st.booleans(), st.lists(st.integers(0, 10), max_size=3), st.floats(allow_nan=True))
_message = st.fixed_dictionaries(
    {"v": st.one_of(st.just(TRANSFER_VERSION), _value),
     "op": st.one_of(st.sampled_from(["hello", "sealed", "fetch", "release"]), _value)},
    optional={"seq": _value, "cn": st.one_of(st.binary(min_size=16, max_size=16), _value),
              "proof": st.one_of(st.binary(min_size=32, max_size=32), _value), "body": _value,
              "tag": st.one_of(st.binary(min_size=16, max_size=16), _value), "request_id": _value,
              "incarnation": _value, "nonce": _value, "mac": _value, "noreply": _value})
_payload = st.one_of(_message.map(lambda m: msgpack.packb(m, use_bin_type=True)), st.binary(max_size=300))


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=st.lists(_payload, min_size=1, max_size=4), framed=st.booleans())
def test_fuzzed_handshake_bytes_never_crash_the_sender(sender, zctx, messages, framed):
    """Fuzzed messages (valid msgpack maps with handshake fields, or random bytes, framed or
    not) to both wires: the sender answers with challenges or refusals only, never KV."""
    endpoint = sender.info["data_endpoint"]
    with tcp_peer(endpoint) as peer:
        peer.sendall(b"".join(frame(m) for m in messages) if framed else b"".join(messages))
        data, _ = drain(peer, quiet_s=0.3)
    if framed:
        for message in control_messages(data):
            assert not message.get("ok") or set(message) == {"v", "seq", "ok", "sn", "proof"}, message
    assert len(data) < KV_BYTES
    peer = dealer(zctx, sender.info["endpoint"])
    try:
        for m in messages:
            peer.send(m)
        for reply in zmq_replies(peer, quiet_s=0.1, first_s=0.3):
            assert len(reply) == 1, reply
            message = msgpack.unpackb(reply[0], raw=False)
            assert not message.get("ok") or set(message) == {"v", "seq", "ok", "sn", "proof"}, message
    finally:
        peer.close()


def test_sender_serves_after_the_fuzzing(sender):
    """(After the fuzz test in this module: the child is alive and serves both wires.)"""
    assert sender.proc.is_alive()
    fetch_ok(sender, ("tcp", "zmq"))
    fetch_ok(sender, ("shm",), node=NODE)


# -- tickets as capabilities ------------------------------------------------------------------

FORGERIES = {
    "other_blocks": lambda t: dataclasses.replace(t, block_ids=tuple(b ^ 1 for b in t.block_ids)),
    "longer_lease": lambda t: dataclasses.replace(t, lease_deadline=t.lease_deadline + 3600),
    "other_endpoint": lambda t: dataclasses.replace(t, data_endpoint="tcp://127.0.0.1:9",
                                                    endpoint="tcp://127.0.0.1:9"),
    "unsigned": lambda t: dataclasses.replace(t, mac=""),
    "random_mac": lambda t: dataclasses.replace(t, mac=secrets.token_hex(32)),
    "other_secret": lambda t: dataclasses.replace(t, mac=OTHER_SECRET.ticket_mac(t)),
    "other_cluster": lambda t: dataclasses.replace(dataclasses.replace(t, cluster=OTHER_CLUSTER.cluster),
                                                   mac=OTHER_CLUSTER.ticket_mac(
                                                       dataclasses.replace(t, cluster=OTHER_CLUSTER.cluster))),
}


@pytest.mark.parametrize("mode", ["shm", "tcp", "zmq", "auto"])
def test_forged_and_foreign_tickets_are_refused_before_any_io(sender, local_pool, mode):
    """The receiver checks the MAC first: nothing is copied, the sender is never asked (its
    count does not move); the genuine ticket then works."""
    ticket = sender.export(rid(), blocks(2))
    before = sender.auth_failures()
    with Receiver(local_pool, SMALL, NODE, mode=mode, timeout_s=5) as receiver:
        for name, forge in FORGERIES.items():
            with pytest.raises(TransferError) as err:
                receiver.fetch(forge(ticket), [0, 1])
            assert err.value.code == FailureCode.AUTH_FAILED, (name, err.value)
        assert receiver.auth_failures == len(FORGERIES)
        assert not local_pool.any()
        receiver.fetch(ticket, [0, 1])
    assert torch.equal(local_pool[:, :, [0, 1]], sender.expected()[:, :, list(ticket.block_ids)])
    assert sender.auth_failures() == before


@pytest.mark.parametrize("wire_name", ["tcp", "zmq"])
def test_sender_refuses_a_ticket_it_did_not_issue(sender, wire_name):
    """A peer in the cluster (it completes the handshake) presenting a MAC that is not the one
    issued for the lease: another secret's, another cluster's, a made-up one. Refused with a
    reason, no KV, counted; the genuine ticket is served on the same channel afterwards."""
    ticket = live_ticket(sender)
    bad = [FORGERIES[name](ticket) for name in ("other_secret", "other_cluster", "random_mac")]
    before = sender.auth_failures()
    if wire_name == "zmq":
        client = ControlClient(5, AUTH)
        try:
            for forged in bad:
                with pytest.raises(TransferError) as err:
                    client.fetch(forged)
                assert err.value.code == FailureCode.AUTH_FAILED and "not the one issued" in err.value.reason
            header, frames = client.fetch(ticket)
            assert header["block_ids"] == list(ticket.block_ids) and len(list(frames)) == header["num_frames"]
        finally:
            client.close()
    else:
        client = DataClient(5, AUTH)
        try:
            seq = 10
            for forged in bad + [ticket]:
                conn, _ = client.connect(ticket.data_endpoint)
                seq += 1
                send_control(conn, wire.seal(client.sessions[ticket.data_endpoint], plain_fetch(forged, seq), seq))
                reply = recv_control(conn)
                if forged is ticket:
                    assert reply["ok"] and reply["nbytes"] == 2 * KV_BYTES
                else:
                    assert reply["code"] == FailureCode.AUTH_FAILED.value and "not the one issued" in reply["reason"]
        finally:
            client.close()
    assert sender.auth_failures() == before + 3


def test_expired_ticket_is_refused(sender, local_pool):
    """Expiry is the sender's lease table's: refused over the network paths, and on the shm
    path once the blocks went back (their epochs moved); extending the ticket's deadline
    breaks its MAC (above)."""
    sender.poll()
    ticket = sender.export(rid(), blocks(1), lease_s=0.2)
    time.sleep(0.4)
    for mode in ("tcp", "zmq"):
        with Receiver(local_pool, SMALL, "another-node", mode=mode, timeout_s=5) as receiver:
            with pytest.raises(TransferError) as err:
                receiver.fetch(ticket, [0])
            assert err.value.code == FailureCode.LEASE_EXPIRED
    wait_for(lambda: any(rid_ == ticket.request_id for rid_, _ in sender.poll()), 5, "the lease handed back")
    with Receiver(local_pool, SMALL, NODE, mode="shm", timeout_s=5) as receiver:
        with pytest.raises(TransferError) as err:
            receiver.fetch(ticket, [0])
        assert err.value.code == FailureCode.LEASE_EXPIRED
    assert not local_pool.any()


def _impostor(kind: str, answer) -> tuple[str, threading.Thread, object]:
    """A TCP data server or a ZeroMQ ROUTER at a ticket's address that answers hello with
    ``answer(hello) -> reply``; it never serves KV."""
    if kind == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))

        def serve():
            conn, _ = listener.accept()
            with conn:
                send_control(conn, answer(recv_control(conn)))
                conn.recv(1)
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        return f"tcp://127.0.0.1:{listener.getsockname()[1]}", thread, listener
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve_zmq():
        if router.poll(5000):
            identity, raw = router.recv_multipart()
            router.send_multipart([identity, wire.pack(answer(msgpack.unpackb(raw, raw=False)))])
        router.poll(1000)   # the sealed fetch, if the receiver were fooled: ignored
        router.close()
        ctx.term()
    thread = threading.Thread(target=serve_zmq, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread, None


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
@pytest.mark.parametrize("answer", ["random_proof", "replayed_challenge", "no_auth"])
def test_receiver_refuses_a_sender_that_cannot_prove_the_secret(sender, local_pool, kind, answer):
    """Someone at the ticket's address (a port taken over after the sender died): a made-up
    proof, a genuine challenge recorded from another handshake, or a sender without
    authentication. The receiver refuses before it sends its proof or any request."""
    genuine = ClientHandshake(AUTH)   # a recorded challenge: genuine, but for another client nonce
    sn = secrets.token_bytes(16)
    recorded = {"v": TRANSFER_VERSION, "ok": True, "sn": sn, "proof": AUTH.server_proof(sn, genuine.cn)}
    answers = {
        "random_proof": lambda hello: {"v": TRANSFER_VERSION, "seq": hello["seq"], "ok": True,
                                       "sn": secrets.token_bytes(16), "proof": secrets.token_bytes(32)},
        "replayed_challenge": lambda hello: {**recorded, "seq": hello["seq"]},
        "no_auth": lambda hello: {"v": TRANSFER_VERSION, "seq": hello["seq"], "ok": False,
                                  "code": "auth_failed", "reason": "runs without KV authentication"},
    }
    address, thread, listener = _impostor(kind, answers[answer])
    field = "data_endpoint" if kind == "tcp" else "endpoint"
    ticket = resign(live_ticket(sender, 1), **{field: address})
    try:
        with Receiver(local_pool, SMALL, "another-node", mode=kind, timeout_s=2) as receiver:
            with pytest.raises(TransferError) as err:
                receiver.fetch(ticket, [0])
        assert err.value.code == FailureCode.AUTH_FAILED, err.value
        assert receiver.auth_failures == 1
    finally:
        thread.join(5)
        if listener is not None:
            listener.close()
    assert not local_pool.any()


def test_two_secrets_interoperate_during_a_rotation(local_pool):
    """Rotation: the sender signs with the new secret and accepts the old; a receiver that
    still signs with the old one (and knows the new) fetches over every path; a receiver
    with only the old secret is refused."""
    old, new = generate_secret(), generate_secret()
    proc = SenderProcess(seed=7, auth=KVAuth([new, old], AUTH.cluster))
    try:
        for mode, node in (("shm", NODE), ("tcp", "another-node"), ("zmq", "another-node")):
            rotating = KVAuth([old, new], AUTH.cluster)
            with KVReceiver(local_pool, SMALL, node, mode=mode, timeout_s=5, auth=rotating) as rx:
                rx.fetch(proc.export(rid(), [3, 4]), [0, 1])
            assert torch.equal(local_pool[:, :, [0, 1]], proc.expected()[:, :, [3, 4]])
            local_pool.zero_()
        with KVReceiver(local_pool, SMALL, "another-node", mode="tcp", timeout_s=5,
                        auth=KVAuth(old, AUTH.cluster)) as rx, pytest.raises(TransferError) as err:
            rx.fetch(proc.export(rid(), [5], lease_s=0.5), [0])
        assert err.value.code == FailureCode.AUTH_FAILED
    finally:
        proc.close()


def test_mixed_configurations_fail_closed(sender, local_pool):
    """A receiver without authentication cannot fetch from an authenticating sender over the
    network (shm has no channel: it copies, and its release still needs the ticket's MAC);
    an authenticating receiver refuses an unsigned ticket."""
    with KVReceiver(local_pool, SMALL, "another-node", mode="tcp", timeout_s=5) as open_rx:
        for mode in ("tcp", "zmq"):
            open_rx.mode = mode
            with pytest.raises(TransferError) as err:
                open_rx.fetch(live_ticket(sender, 1), [0])
            assert err.value.code == FailureCode.AUTH_FAILED
    assert not local_pool.any()
    unauthenticated = SenderProcess(seed=8, auth=None)
    try:
        ticket = unauthenticated.export(rid(), [2])
        assert ticket.mac == "" and ticket.cluster == ""
        with Receiver(local_pool, SMALL, NODE, timeout_s=5) as receiver, pytest.raises(TransferError) as err:
            receiver.fetch(ticket, [0])
        assert err.value.code == FailureCode.AUTH_FAILED and "unsigned" in err.value.reason
        with KVReceiver(local_pool, SMALL, "another-node", mode="tcp", timeout_s=5) as open_rx:
            open_rx.fetch(ticket, [0])   # both off: as before authentication existed
        assert torch.equal(local_pool[:, :, [0]], unauthenticated.expected()[:, :, [2]])
    finally:
        unauthenticated.close()


def test_secret_parsing():
    key = generate_secret()
    assert parse_secrets(key.hex()) == [key]
    assert parse_secrets(f"# rotation\n{key.hex()}\n{'ab' * 16}, {'cd' * 20}\n") == [key, b"\xab" * 16, b"\xcd" * 20]
    assert parse_secrets(key) == [key]   # a raw 32-byte file
    for bad in ("", "# nothing", "zz" * 32, "ab" * 8, b"\x01" * 8):
        with pytest.raises(ValueError):
            parse_secrets(bad)
    with pytest.raises(ValueError):
        KVAuth(b"short", "c")
    assert "secrets=1" in repr(KVAuth(key, "c")) and key.hex() not in repr(KVAuth(key, "c"))


# -- through real workers -------------------------------------------------------------------

MAX_TOKENS = 8


def secret_file(tmp_path, name: str, key: bytes | None = None) -> str:
    path = tmp_path / name
    path.write_text((key or generate_secret()).hex() + "\n")
    path.chmod(0o600)
    return str(path)


def prompts_alike(loaded, n: int) -> list[str]:
    """``n`` prompts of the same length (their tickets have as many blocks)."""
    prompts = [f"request {i} asks about the {w} fox" for i, w in enumerate("blue grey pink gold teal navy".split())]
    prompts = prompts[:n]
    assert len({len(loaded.tokenizer.encode(p)) for p in prompts}) == 1
    return prompts


def submit_all(cluster: Cluster, prompts: list[str]):
    params = [{"max_tokens": MAX_TOKENS, "temperature": 0.0 if i % 2 else 0.8, "seed": 100 + i, "ignore_eos": True}
              for i in range(len(prompts))]
    client = Client(cluster.redis_url, cluster.cluster)
    return params, client.submit_many([dict(prompt=p, **kw) for p, kw in zip(prompts, params)])


def check_results(cluster: Cluster, loaded, prompts, params, handles, path: str):
    """Every request answered, token-equal to the colocated engine, over ``path``."""
    prompt_ids, expected, sampling = oracle(loaded, prompts, params)
    results = [h.result(timeout=120) for h in handles]
    for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
        assert_same_tokens(loaded, pid, exp, list(res.token_ids), sp)
    assert {r.transfer_path for r in results} == {path}, {w: cluster.log(w)[-2000:] for w in cluster.procs}
    return results


def load_of(cluster: Cluster, name: str) -> dict:
    return cluster.workers()[name].get("load", {})


def test_workers_authenticate_by_default_and_refuse_raw_peers(cluster, tiny, zctx):
    """No secret given: the first worker creates it in Redis (SET NX) and both use it; raw
    peers holding a genuine ticket are refused by the real prefill worker on both wires,
    counted in its heartbeat; requests still flow over the authenticated TCP wire."""
    cluster.start("prefill", "--transfer", "tcp", worker_id="prefill0")
    cluster.start("decode", "--transfer", "tcp", worker_id="decode0")
    stored = cluster.r.get(Keys(cluster.cluster).kv_secret)
    assert stored is not None and len(bytes.fromhex(stored.decode())) == 32
    endpoints = cluster.workers()["prefill0"]["endpoints"]
    prompts = prompts_alike(tiny, 4)
    params, handles = submit_all(cluster, prompts)
    check_results(cluster, tiny, prompts, params, handles, "tcp")
    # What a reader of Redis has: a genuine ticket (from the done request's handoff, gone
    # by now, so a made-up one naming the worker's incarnation will do as well).
    incarnation = cluster.workers()["prefill0"]["incarnation"]
    fake = {"v": TRANSFER_VERSION, "op": "fetch", "seq": 1, "request_id": "x", "incarnation": incarnation,
            "nonce": None, "mac": "00" * 32}
    with tcp_peer(endpoints["kv_data"]) as peer:
        peer.sendall(frame(wire.pack(fake)))
        assert_refused_without_kv(*drain(peer))
    peer = dealer(zctx, endpoints["kv"])
    peer.send(wire.pack(fake))
    assert_zmq_refused(zmq_replies(peer))
    peer.close()
    wait_for(lambda: load_of(cluster, "prefill0").get("auth_failures") == 2, 15, "the refusals in the heartbeat")
    assert "refused a peer at 127.0.0.1" in cluster.log("prefill0")
    assert load_of(cluster, "decode0").get("auth_failures") == 0


def test_forged_tickets_in_redis_are_recomputed(cluster, tiny, tmp_path):
    """Someone who can write to Redis but lacks the secret rewrites handoffs: tickets
    swapped between requests (the shm path would copy another request's KV), one signed
    with another cluster's secret, one unsigned. The decode worker refuses each ticket and
    recomputes: every request answered, token-equal, nothing lost."""
    key = secret_file(tmp_path, "cluster.hex")
    cluster.start("prefill", "--kv-secret-file", key, "--lease-s", "3", worker_id="prefill0")
    prompts = prompts_alike(tiny, 4)
    params, handles = submit_all(cluster, prompts)
    keys = Keys(cluster.cluster)
    entries = wait_for(lambda: (lambda e: e if len(e) == 4 else None)(cluster.r.xrange(keys.handoff)), 60,
                       "four handoffs")
    bodies = [msgpack.unpackb(fields[b"data"], raw=False) for _eid, fields in entries]
    tickets = [body["ticket"] for body in bodies]
    assert all(t["mac"] and t["segment"] for t in tickets)
    swapped = [dict(tickets[0], block_ids=tickets[1]["block_ids"], block_epochs=tickets[1]["block_epochs"]),
               dict(tickets[1], block_ids=tickets[0]["block_ids"], block_epochs=tickets[0]["block_epochs"])]
    from pdqueue.transfer.base import Ticket
    foreign = Ticket.from_dict(tickets[2])
    forged = swapped + [dict(tickets[2], mac=OTHER_SECRET.ticket_mac(foreign)), dict(tickets[3], mac="")]
    for (eid, fields), body, ticket in zip(entries, bodies, forged):
        cluster.r.xadd(keys.handoff, {b"id": fields[b"id"], b"data": msgpack.packb(dict(body, ticket=ticket))})
        cluster.r.xdel(keys.handoff, eid)
    cluster.start("decode", "--kv-secret-file", key, worker_id="decode0")
    check_results(cluster, tiny, prompts, params, handles, "recompute")
    wait_for(lambda: load_of(cluster, "decode0").get("auth_failures") == 4, 15, "four refused tickets")


def test_expired_tickets_are_recomputed(cluster, tiny, tmp_path):
    """Leases ran out before any decode worker came: the sender refuses the fetches
    (lease_expired), the decode worker recomputes, tokens equal."""
    key = secret_file(tmp_path, "cluster.hex")
    cluster.start("prefill", "--transfer", "tcp", "--lease-s", "0.5", "--kv-secret-file", key, worker_id="prefill0")
    prompts = prompts_alike(tiny, 3)
    params, handles = submit_all(cluster, prompts)
    wait_for(lambda: cluster.r.xlen(Keys(cluster.cluster).handoff) == 3, 60, "three handoffs")
    # A heartbeat written after the leases' end says none is left (one written before the
    # handoffs says 0 too: with a decode worker that starts fast, that one let it fetch in time).
    expired_ms = time.time() * 1000 + 500

    def leases_gone() -> bool:
        w = cluster.workers()["prefill0"]
        return w.get("beat_ms", 0) > expired_ms and w.get("load", {}).get("leases") == 0
    wait_for(leases_gone, 15, "the leases expired")
    cluster.start("decode", "--transfer", "tcp", "--kv-secret-file", key, worker_id="decode0")
    check_results(cluster, tiny, prompts, params, handles, "recompute")
    assert "lease_expired" in cluster.log("decode0")
    assert load_of(cluster, "decode0").get("auth_failures") == 0


def test_another_clusters_secret_is_refused_and_recomputed(cluster, tiny, tmp_path):
    """A decode worker with another secret: every ticket refused (nothing crosses), every
    request recomputed and answered; with PDQ_KV_SECRET set to the right one, a second decode
    worker fetches over TCP."""
    right = generate_secret()
    cluster.start("prefill", "--transfer", "tcp", "--lease-s", "3",
                  "--kv-secret-file", secret_file(tmp_path, "a.hex", right), worker_id="prefill0")
    cluster.start("decode", "--transfer", "tcp", "--kv-secret-file", secret_file(tmp_path, "b.hex"),
                  worker_id="decode0")
    prompts = prompts_alike(tiny, 3)
    params, handles = submit_all(cluster, prompts)
    check_results(cluster, tiny, prompts, params, handles, "recompute")
    wait_for(lambda: load_of(cluster, "decode0").get("auth_failures") == 3, 15, "three refused tickets")
    cluster.stop("decode0")
    cluster.start("decode", "--transfer", "tcp", worker_id="decode1", env={"PDQ_KV_SECRET": right.hex()})
    params, handles = submit_all(cluster, prompts)
    check_results(cluster, tiny, prompts, params, handles, "tcp")


def test_kv_auth_off_is_a_warning_and_works_both_sides(cluster, tiny):
    cluster.start("prefill", "--transfer", "zmq", "--kv-auth", "off", worker_id="prefill0")
    cluster.start("decode", "--transfer", "zmq", "--kv-auth", "off", worker_id="decode0")
    prompts = prompts_alike(tiny, 2)
    params, handles = submit_all(cluster, prompts)
    check_results(cluster, tiny, prompts, params, handles, "zmq")
    assert "authentication is OFF" in cluster.log("prefill0") and "authentication is OFF" in cluster.log("decode0")
    assert cluster.r.get(Keys(cluster.cluster).kv_secret) is None


def test_sender_takes_a_config_or_its_fields_and_refuses_unknown_ones():
    from pdqueue.transfer import SenderConfig
    pool = SMALL.allocate()
    with KVSender(pool, SMALL, "w-cfg", "inc-cfg", NODE, config=SenderConfig(lease_s=5.0, data_port=None)) as kv:
        assert kv.leases.lease_s == 5.0 and kv.data_endpoint == "" and kv.auth_failures == 0
    with KVSender(pool, SMALL, "w-cfg", "inc-cfg", NODE, lease_s=7.0, auth=AUTH) as kv:
        assert kv.config.lease_s == 7.0 and kv.data_endpoint.startswith("tcp://127.0.0.1:")
        assert kv.export(rid(), [1], 3).mac   # signed: the config's auth is the sender's
    with pytest.raises(TypeError):
        KVSender(pool, SMALL, "w-cfg", "inc-cfg", NODE, lease_seconds=3.0)
