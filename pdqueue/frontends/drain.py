"""The gateway process's stop, as state (``Gateway.drain``): whether it drains, whether it
must end every open answer now, and what is still open.

- ``draining``: set by the first SIGTERM/SIGINT (``request``); new completion, chat,
  ``/v1/requests`` and ``/v1/responses`` requests and ``/health`` get 503 with ``Retry-After``,
  and the batches this gateway runs are let go (another gateway, or this one restarted,
  resumes them).
- ``stopped``: set by a later signal (``forced``); every open answer waits on it and ends
  with an error, its request cancelled (answer.py).
- ``open``: the answers being written (answer.py's ``Reply`` adds and discards itself);
  ``busy``: requests not answered yet that may become one (the gateway's answering path
  counts them). ``idle``: draining with neither, nor a batch running: the process may exit.

``serve`` (gateway.py) turns the signals into ``request`` and exits once ``idle``; a socket
handover (runtime.py's ``Handover``) waits on ``open`` and ``busy`` too. Its own object
because the stop is its own job: the routes only read it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdqueue.frontends.answer import Reply
    from pdqueue.frontends.batch_runner import BatchRunner

log = logging.getLogger("pdqueue.frontends.gateway")


class Drain:
    def __init__(self):
        self.draining = False            # after the first signal
        self.stopped = asyncio.Event()   # set by the second
        self.open: set[Reply] = set()    # answers being written
        self.busy = 0                    # requests not answered yet that may become one

    def request(self, forced: bool, batches: BatchRunner | None) -> None:
        """A stop signal (the first: drain, and let ``batches`` go; a later one, ``forced``:
        end the open answers now)."""
        if not self.draining:
            self.draining = True
            if batches is not None:
                batches.let_go()   # another gateway (or this one restarted) resumes them
            log.warning("stopping: %d answers open run to their end; new requests get 503 (a second "
                        "SIGTERM/SIGINT ends them now)", len(self.open) + self.busy)
        if forced and not self.stopped.is_set():
            log.warning("stopping now: ending %d open answers with an error and cancelling their requests",
                        len(self.open) + self.busy)
            self.stopped.set()

    def idle(self, batches: BatchRunner | None) -> bool:
        """Draining, and no answer left to write (nor a batch of ``batches`` running): the
        process may exit."""
        return self.draining and not self.open and self.busy == 0 and not (batches and batches.busy())
