"""The request and reply messages every wire speaks (the ZeroMQ wire, transfer.zmq; the TCP
data wire, transfer.tcp; the NIXL path's ops, transfer.nixl): msgpack maps, the version
``base.TRANSFER_VERSION`` (its bump rules beside it): every message carries it as ``v``, a reply of
another version is refused (``check_reply``: ``version_mismatch``), and workers show it in their
heartbeat's compatibility record so that KV never travels between two versions. The message
formats are described in transfer.zmq's docstring; a fetch may ask for a KV format
(``kv_format``, engine.kv_codec) and its reply says the one it sends (``reply_format``).
Imports msgpack; never zmq (so the TCP wire runs without it).
"""

from __future__ import annotations

import msgpack

from pdqueue.engine.kv_codec import NATIVE
from pdqueue.transfer.auth import ClientHandshake, Session
from pdqueue.transfer.base import TRANSFER_VERSION, Ticket
from pdqueue.transfer.errors import FailureCode, TransferError


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(raw: bytes) -> dict:
    message = msgpack.unpackb(raw, raw=False)
    if not isinstance(message, dict):
        raise ValueError("message is not a map")
    return message


def request(op: str, seq: int, ticket: Ticket, **extra) -> bytes:
    return pack({"v": TRANSFER_VERSION, "op": op, "seq": seq, "request_id": ticket.request_id,
                 "incarnation": ticket.incarnation, "nonce": ticket.nonce, "mac": ticket.mac, **extra})


def hello(seq: int, handshake: ClientHandshake) -> bytes:
    return pack({"v": TRANSFER_VERSION, "seq": seq, **handshake.hello_fields()})


def seal(session: Session, body: bytes, seq: int) -> bytes:
    """A request (``body``, packed, with this ``seq``) inside a sealed message; the first one
    of a session carries the client's proof."""
    message = {"v": TRANSFER_VERSION, "op": "sealed", "seq": seq, "body": body, "tag": session.tag(body)}
    if session.proof is not None:
        message["proof"], session.proof = session.proof, None
    return pack(message)


def data_tag(seq: int, index: int) -> bytes:
    return pack({"v": TRANSFER_VERSION, "seq": seq, "i": index})


def error_reply(seq, code: FailureCode, reason: str, **extra) -> bytes:
    return pack({"v": TRANSFER_VERSION, "seq": seq, "ok": False, "code": code.value,
                 "reason": reason, **extra})


def ok_reply(seq, **fields) -> bytes:
    return pack({"v": TRANSFER_VERSION, "seq": seq, "ok": True, **fields})


def check_reply(endpoint: str, op: str, header: dict) -> None:
    """Raise TransferError unless ``header`` is a successful reply of our version."""
    if header.get("v") != TRANSFER_VERSION:
        raise TransferError(f"{endpoint} speaks transfer version {header.get('v')}, "
                            f"expected {TRANSFER_VERSION}", FailureCode.VERSION_MISMATCH)
    if not header.get("ok"):
        try:
            code = FailureCode(header.get("code"))
        except ValueError:
            code = FailureCode.BAD_REPLY
        raise TransferError(f"{endpoint}: {header.get('reason')}", code)


def reply_format(endpoint: str, header: dict, asked: str) -> str:
    """The format of a fetch reply's data (engine.kv_codec): its header's ``kv_format``,
    absent meaning ``native`` (a sender that did not know the ask); anything but native or
    the format asked is refused."""
    fmt = header.get("kv_format", NATIVE)
    if fmt not in (NATIVE, asked):
        raise TransferError(f"{endpoint} answered in KV format {fmt!r}, asked for {asked!r}", FailureCode.BAD_REPLY)
    return fmt


def check_reply_describes(ticket: Ticket, header: dict, layout, first_block: int = 0) -> None:
    """A fetch reply must describe exactly the blocks asked for (``ticket.block_ids[first_block:]``)
    in the receiver's layout."""
    src_ids = list(ticket.block_ids[first_block:])
    expected_shape = [layout.num_layers, 2, len(src_ids), layout.block_size, layout.num_kv_heads,
                      layout.head_dim]
    if (header.get("request_id") != ticket.request_id or header.get("block_ids") != src_ids
            or header.get("shape") != expected_shape or header.get("dtype") != layout.dtype):
        raise TransferError(f"fetch reply for {ticket.request_id!r} describes other data: {header}",
                            FailureCode.BAD_REPLY)
