"""Leases on exported KV blocks, kept by the sender (prefill) side.

Ownership, the rule every caller follows:
- ``add`` (called by ``KVSender.export``) hands the blocks to the table: from then on the
  engine must neither free nor write them.
- The sender ``acquire``s before reading the blocks for a receiver (refused once the
  deadline has passed; a success extends the deadline by the lease length); a receiver
  ``release``s after copying; ``release`` answers True iff the blocks had not yet been
  handed back to the engine, i.e. the bytes the receiver copied were intact. (The shm path
  checks that itself with the segment's block epochs and releases without waiting.)
- ``hold_until(request_id, done)``: the blocks are still being read by someone else (the
  TCP data server sends straight out of the pool), so the lease is not handed back, even
  when released or expired, until ``done()`` is true.
- ``poll_freeable`` hands each released or expired lease back exactly once; from then on its
  blocks belong to the engine again (free or reuse them). ``revoke`` hands back a lease early
  (the ticket was never published).

Shared blocks (``shared_blocks=True``, the prefill role with its engine's prefix cache): a
block may belong to several leases at once (requests with the same cached prefix); the
engine holds one reference per lease, so it neither frees nor rewrites a block before its
last lease is handed back. Without it a block already under a lease is refused.

All methods are thread-safe (one lock): the serving thread acquires and releases while the
engine thread exports and polls. Deadlines are in the table's clock (monotonic by default).
Imports the standard library only.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Callable

_RECENT = 4096   # handed-back leases whose final state is remembered


class LeaseState(str, Enum):
    LEASED = "leased"        # exported, not yet being copied
    ACQUIRED = "acquired"    # a receiver is copying
    RELEASED = "released"    # the receiver is done; waiting for poll_freeable
    EXPIRED = "expired"      # the deadline passed; waiting for poll_freeable


@dataclass(slots=True)
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_s: float
    deadline: float
    state: LeaseState = LeaseState.LEASED
    hold: Callable[[], bool] | None = None   # see hold_until
    mac: str = ""                            # the MAC of the ticket issued for it (set_mac)


class LeaseTable:
    def __init__(self, lease_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 shared_blocks: bool = False):
        self.lease_s = lease_s
        self.clock = clock
        self.shared_blocks = shared_blocks   # see the module docstring
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._leased_blocks: Counter[int] = Counter()   # block -> leases not yet handed back
        self._freeable: list[str] = []   # request ids in RELEASED/EXPIRED, not yet handed back
        self._recent: OrderedDict[str, LeaseState] = OrderedDict()   # final states of handed-back leases

    def add(self, request_id: str, block_ids, num_tokens: int, lease_s: float | None = None) -> float:
        """Lease the blocks; returns the deadline. A request id may hold one lease at a time, and
        a block belongs to one lease at a time unless ``shared_blocks``."""
        lease_s = self.lease_s if lease_s is None else lease_s
        block_ids = tuple(block_ids)
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            if not self.shared_blocks and not self._leased_blocks.keys().isdisjoint(block_ids):
                raise ValueError(f"blocks {sorted(self._leased_blocks.keys() & set(block_ids))} are already leased")
            deadline = self.clock() + lease_s
            self._leases[request_id] = Lease(request_id, block_ids, num_tokens, lease_s, deadline)
            self._leased_blocks.update(block_ids)
            return deadline

    def acquire(self, request_id: str, now: float | None = None) -> bool:
        """A receiver starts copying: False if unknown, released or past its deadline."""
        with self._lock:
            now = self.clock() if now is None else now
            lease = self._leases.get(request_id)
            if lease is None or lease.state not in (LeaseState.LEASED, LeaseState.ACQUIRED):
                return False
            if now > lease.deadline:
                self._expire_one(lease)
                return False
            lease.state = LeaseState.ACQUIRED
            lease.deadline = max(lease.deadline, now + lease.lease_s)
            return True

    def release(self, request_id: str) -> bool:
        """A receiver is done copying: True iff the blocks were not handed back meanwhile."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            if lease.state in (LeaseState.LEASED, LeaseState.ACQUIRED):
                self._freeable.append(request_id)
            lease.state = LeaseState.RELEASED
            return True

    def set_mac(self, request_id: str, mac: str) -> None:
        """Remember the MAC of the ticket issued for the lease: a request must present it."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.mac = mac

    def hold_until(self, request_id: str, done: Callable[[], bool]) -> None:
        """Do not hand the lease back before ``done()`` is true (see the module docstring)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.hold = done

    def is_held(self, request_id: str) -> bool:
        """The blocks are still under the lease (not yet handed back to the engine)."""
        with self._lock:
            return request_id in self._leases

    def get(self, request_id: str) -> Lease | None:
        """A copy of the lease, or None once handed back (or never added)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return None if lease is None else Lease(**{k: getattr(lease, k) for k in Lease.__slots__})

    def revoke(self, request_id: str) -> bool:
        """Hand the lease back at the next poll_freeable, whatever its deadline."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.state in (LeaseState.RELEASED, LeaseState.EXPIRED):
                return False
            self._expire_one(lease)
            return True

    def holding(self) -> int:
        """How many leases a ``hold_until`` condition still holds (a TCP send reading their
        blocks)."""
        with self._lock:
            return sum(1 for lease in self._leases.values() if lease.hold is not None and not lease.hold())

    def expire(self, now: float | None = None) -> int:
        """Mark leases past their deadline as expired; returns how many."""
        with self._lock:
            now = self.clock() if now is None else now
            due = [lease for lease in self._leases.values()
                   if lease.state in (LeaseState.LEASED, LeaseState.ACQUIRED) and now > lease.deadline]
            for lease in due:
                self._expire_one(lease)
            return len(due)

    def poll_freeable(self, now: float | None = None) -> list[tuple[str, tuple[int, ...]]]:
        """Expire what is due, then hand back (once) every released or expired lease's blocks."""
        self.expire(now)
        with self._lock:
            handed, held = [], []
            for rid in self._freeable:
                lease = self._leases[rid]
                if lease.hold is not None and not lease.hold():
                    held.append(rid)
                    continue
                del self._leases[rid]
                for block_id in lease.block_ids:
                    self._leased_blocks[block_id] -= 1
                    if not self._leased_blocks[block_id]:
                        del self._leased_blocks[block_id]
                handed.append((rid, lease.block_ids))
                self._recent[rid] = lease.state
            self._freeable = held
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
            return handed

    def last_state(self, request_id: str) -> LeaseState | None:
        """The state of a lease, also shortly after it was handed back (for error messages)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return lease.state if lease is not None else self._recent.get(request_id)

    def num_held_blocks(self) -> int:
        with self._lock:
            return len(self._leased_blocks)

    def held_blocks(self) -> set[int]:
        """The blocks under a lease now (a copy): the engine may not free or write them."""
        with self._lock:
            return set(self._leased_blocks)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _expire_one(self, lease: Lease) -> None:
        lease.state = LeaseState.EXPIRED
        self._freeable.append(lease.request_id)
