"""Which workers may exchange KV: the compatibility record of the handshake.

A decode worker continues a request from KV another worker computed (a handoff, a running
decode migrated to it) or prefills a prompt another worker placed on it. That is right only
when both compute the same KV for the same tokens and read each other's messages: the same
model (its config and its weights' fingerprint), the same KV layout and format (layers, KV
heads, head_dim, block size, dtype), the same handoff message (``PROTOCOL_VERSION``) and the
same transfer wire (``pdqueue.transfer.base.TRANSFER_VERSION``: tickets and every message of
the KV wires). A cluster half-way through an upgrade has workers that differ in one of them.

``Compat`` is one worker's record of those, and ``key`` the one string they make: two
workers exchange KV only when their keys are equal. Where it shows:

- the heartbeat, field ``compat`` (JSON: ``kv``, ``format``, ``handoff``, ``transfer``;
  ``record``/``compat_of``), written by every worker from its start;
- a handoff stream entry, field ``compat`` (the sender's key), beside ``id`` and ``data``:
  readable without decoding ``data``, whose version may be one this worker does not speak
  (protocol/handoff.py writes it from the handoff's ``kv_identity`` and ``transfer_version``);
- the stream ``handoff:kv:<key>`` (``Keys.handoff_compat``): the handoffs of one kind, which
  only decode workers of that key read (workers/decode_peers.py says when senders use it).

A worker that shows no record (an older build: ``compat_of`` None) is compatible with every
other, as every worker was before the handshake; a handoff with no ``compat`` field and no
``kv_identity`` likewise. Whether a record matches is the only question asked here: what a
worker does about it (route around the peer, say so once) is in workers/compat.py.

Imports nothing but the protocol's own version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .wire import PROTOCOL_VERSION

COMPAT_FIELD = "compat"   # the heartbeat's field (JSON) and the handoff entry's (the key)


def compat_key(kv_identity: str, transfer: int, handoff: int = PROTOCOL_VERSION) -> str:
    """The key of a record: ``<kv identity>.<handoff version>.<transfer version>``."""
    return f"{kv_identity}.{int(handoff)}.{int(transfer)}"


@dataclass(frozen=True, slots=True)
class Compat:
    """What a worker's KV and wires are (see the module docstring)."""

    kv_identity: str            # LLMEngine.kv_identity: the model and the KV layout, dtype included
    transfer: int               # its transfer wire version (TRANSFER_VERSION)
    handoff: int = PROTOCOL_VERSION
    kv_format: str = ""         # the layout for people ("float32, block 16, ..."); not compared

    @property
    def key(self) -> str:
        return compat_key(self.kv_identity, self.transfer, self.handoff)

    def record(self) -> dict[str, Any]:
        """The heartbeat's ``compat`` field."""
        return {"kv": self.kv_identity, "format": self.kv_format, "handoff": self.handoff, "transfer": self.transfer}

    @classmethod
    def from_record(cls, record: Any) -> "Compat | None":
        """The record of a heartbeat's ``compat`` field; None when absent or unreadable."""
        if not isinstance(record, Mapping) or not isinstance(record.get("kv"), str) or not record.get("kv"):
            return None
        try:
            return cls(record["kv"], int(record.get("transfer") or 0), int(record.get("handoff") or 0),
                       str(record.get("format") or ""))
        except (TypeError, ValueError):
            return None

    def accepts(self, other: "Compat | None") -> bool:
        """Whether this worker may exchange KV with one of record ``other`` (None: an older
        worker that says nothing, compatible as before)."""
        return other is None or other.key == self.key

    def differs(self, other: "Compat") -> str:
        """What differs between this record and ``other``, in words (for the one log line)."""
        parts = []
        if other.kv_identity != self.kv_identity:
            ids = f"KV identity {other.kv_identity} there, {self.kv_identity} here"
            if other.kv_format and self.kv_format and other.kv_format != self.kv_format:
                parts.append(f"KV format {other.kv_format} there, {self.kv_format} here")
            elif other.kv_format and self.kv_format:
                parts.append(f"model or weights ({ids})")
            else:
                parts.append(f"model, weights or KV layout ({ids})")
        if other.handoff != self.handoff:
            parts.append(f"handoff version {other.handoff} there, {self.handoff} here")
        if other.transfer != self.transfer:
            parts.append(f"transfer wire version {other.transfer} there, {self.transfer} here")
        return "; ".join(parts) or "nothing"


def compat_of(worker: Mapping) -> Compat | None:
    """The record of a worker as ``queue.registry.list_workers`` returns it (None: none)."""
    return Compat.from_record(worker.get(COMPAT_FIELD))


def entry_compat(fields: Mapping | None) -> str:
    """The ``compat`` field of a handoff stream entry ("" when it has none: an older sender)."""
    if not fields:
        return ""
    value = fields.get(COMPAT_FIELD.encode(), fields.get(COMPAT_FIELD))
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode(errors="replace")
    return value if isinstance(value, str) else ""
