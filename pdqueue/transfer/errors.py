"""Why a KV transfer failed.

A ``TransferError`` never leaves the receiver's destination blocks in a usable state: the
caller (the decode worker) frees them and takes the recompute path (in mode "auto" a
path that cannot serve the ticket hands it to the next path first).
Imports nothing heavy.
"""

from __future__ import annotations

from enum import Enum


class FailureCode(str, Enum):
    BAD_TICKET = "bad_ticket"                  # malformed ticket or destination block ids
    VERSION_MISMATCH = "version_mismatch"      # ticket or wire message from another version
    LAYOUT_MISMATCH = "layout_mismatch"        # blocks cannot be copied between the pools
    UNKNOWN_REQUEST = "unknown_request"        # the sender holds no lease for this request
    STALE_INCARNATION = "stale_incarnation"    # ticket names an earlier life of the sender
    LEASE_EXPIRED = "lease_expired"            # the lease ran out before the copy began
    LEASE_LOST = "lease_lost"                  # the lease ran out during the copy: bytes unusable
    NONCE_MISMATCH = "nonce_mismatch"          # the segment is not the one the ticket names
    SEGMENT_UNAVAILABLE = "segment_unavailable"  # cannot map the segment (another path may work)
    PEER_TIMEOUT = "peer_timeout"              # the sender did not answer in time (dead or stuck)
    BAD_REPLY = "bad_reply"                    # the sender's reply failed validation
    CLOSED = "closed"                          # this receiver or sender was closed
    AUTH_FAILED = "auth_failed"                # a peer or ticket failed authentication (transfer.auth)


class TransferError(Exception):
    """A fetch failed; ``code`` says why."""

    def __init__(self, reason: str, code: FailureCode = FailureCode.BAD_REPLY):
        super().__init__(f"{code.value}: {reason}")
        self.reason = reason
        self.code = FailureCode(code)
