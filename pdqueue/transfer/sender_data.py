"""A ``KVSender``'s TCP data wire (see tcp.py): a ``DataServer`` whose connection threads
write a fetch's blocks straight from a pool in host memory; the lease is held until the
``sendmsg`` calls have returned."""

from __future__ import annotations

import threading

import torch

from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.transfer.auth import Peer
from pdqueue.transfer.sender_admission import Admission, Fetch
from pdqueue.transfer.tcp import DataServer, send_control, send_views, source_pieces


class DataHandler:
    """Owns the ``DataServer`` (its listener, connections and their threads) from
    construction (bound at once) to ``close``."""

    def __init__(self, admission: Admission, pool_tensor: torch.Tensor, pool_planes: torch.Tensor,
                 layout: KVCacheLayout, host: str, port: int, timeout_s: float, *, name: str,
                 handshake_timeout_s: float | None):
        self.admission, self.layout = admission, layout
        self._planes = pool_planes
        self._pool_bytes = memoryview(pool_tensor.view(-1).view(torch.uint8).numpy())
        self.server = DataServer(host, port, self.serve, timeout_s, name=name,
                                 handshake_timeout_s=handshake_timeout_s,
                                 on_refused=lambda peer, reason: admission.refuse(peer, None, reason))
        self.address = self.server.address

    def close(self) -> None:
        self.server.close()

    def serve(self, conn, raw: bytes, peer: Peer) -> bool:
        """Serve one message; False (or an exception) closes the connection. A peer without
        a session that gets any reply is refused: it is closed."""
        msg, authenticated, reply = self.admission.admit(raw, peer)
        if msg is None:
            if reply is not None:
                send_control(conn, reply)
            return authenticated   # here: whether the peer may go on
        sending = threading.Event()
        sending.set()
        try:
            answer = self.admission.answer(msg, authenticated=authenticated, peer=peer, answer_release=False,
                                           hold=lambda: not sending.is_set())
            if not isinstance(answer, Fetch):
                if answer is not None:
                    send_control(conn, answer)
                return authenticated or answer is None
            num_planes, block_nbytes = self._planes.shape[0], self.layout.block_nbytes
            plane_nbytes = self._planes.shape[1] * block_nbytes
            send_control(conn, answer.header(nbytes=num_planes * len(answer.block_ids) * block_nbytes))
            send_views(conn, [self._pool_bytes[start:start + n * block_nbytes]   # from the pool, no copy
                              for p, first, n in source_pieces(num_planes, answer.block_ids)
                              for start in (p * plane_nbytes + first * block_nbytes,)])
            return True
        finally:
            sending.clear()   # sent: the kernel holds copies, the blocks may go back
