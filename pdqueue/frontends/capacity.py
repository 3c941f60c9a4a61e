"""Riding out a cluster with no capacity: a request that arrives while no worker can take it
(all stopped, crashed, a rolling restart's gap, scaling from zero) is not refused. It goes into
the durable queue as any request does and waits there for a worker; its answer is read as
usual once one comes. Only if none comes within ``capacity_wait_s`` (or the request's own
timeout, if shorter) is it cancelled (so a worker that starts later never runs it) and answered
``503`` with ``Retry-After``, before anything of the response was sent.

``Waiting`` wraps the handle of every request the gateway sends: its first read races a watch
of the view, which gives up once no capacity has been seen for the wait (from its first entry
on it is a plain read, under the gateway's ordinary timeout). Every answer
(chat, completions, the Responses API) reads through the handle, so all of them ride it out
the same way, streaming or not. ``NoCapacity`` is a ``RequestFailed``, so the replies answer it
as they answer a worker's refusal: ``openai_compat.worker_error`` makes it the 503.

While no worker lives the gateway still knows the models it last saw served (``ClusterView``
keeps them, in Redis too, so a gateway restarted during the gap knows them): an unknown model
is still a 404 and a prompt over the known context still a 400, at once."""

from __future__ import annotations

import asyncio
import time

from pdqueue.client import RequestFailed
from pdqueue.frontends import http_errors as errs

__all__ = ["NO_CAPACITY", "NoCapacity", "Waiting", "models_meanwhile", "waiting_for_capacity"]

NO_CAPACITY = "no_capacity"   # the code of the error: openai_compat.worker_error makes it a 503


class NoCapacity(RequestFailed):
    def __init__(self, waited_s: float, request_id: str):
        super().__init__(f"no worker could take the request within {waited_s:.0f} s (no live prefill and decode "
                         f"worker, nor a colocated one); it was cancelled: retry later", NO_CAPACITY, request_id)


class Waiting:
    """A request handle whose answer must find capacity first (see the module). Every
    gateway request's handle is one: until its first entry arrives, a watch gives up on it
    once the view has shown no capacity for ``limit_s`` since the later of its submit and the
    last poll that saw some (``ClusterView.capacity_seen_at``), which also covers capacity
    that leaves after the request was sent. Everything but the reads is the handle's own."""

    def __init__(self, handle, view, cancel, limit_s: float):
        self._handle, self._view, self._cancel = handle, view, cancel
        self._limit_s = limit_s
        # The watch looks this often: a tenth of the wait (a 503 comes at most that late), no
        # more than the view's polls: one wakeup per request and period, cheap at any load.
        self._poll_s = min(max(view.poll_s, limit_s / 10), 5.0)
        self._since = time.monotonic()
        self._watching = True   # until its first entry

    def __getattr__(self, name):
        return getattr(self._handle, name)

    async def _capacity_back(self) -> None:
        """Raises ``NoCapacity`` (the request cancelled) once the view has shown no capacity
        for the wait; never returns otherwise (the read it races ends the race)."""
        while True:
            view = self._view
            if not (view.ok and view.serving()):
                gone_s = time.monotonic() - max(self._since, view.capacity_seen_at)
                if gone_s >= self._limit_s:
                    await self._cancel(self._handle.request_id)
                    raise NoCapacity(self._limit_s, self._handle.request_id)
            await asyncio.sleep(self._poll_s)

    async def _first(self, read):
        """``read`` (an awaitable's factory) raced against the watch, while watching."""
        if not self._watching:
            return await read()
        task = asyncio.ensure_future(read())
        watch = asyncio.ensure_future(self._capacity_back())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                self._watching = False
                return task.result()
            watch.result()   # NoCapacity
            raise AssertionError("the capacity watch ended without a reason")
        finally:
            for t in (task, watch):
                if not t.done():
                    t.cancel()
                    try:
                        await t
                    except BaseException:
                        pass

    async def result(self, timeout: float | None = None):
        return await self._first(lambda: self._handle.result(timeout=timeout))

    async def batches(self, timeout: float | None = None, **options):
        reading = self._handle.batches(timeout=timeout, **options).__aiter__()
        while True:
            try:
                batch = await self._first(reading.__anext__)
            except StopAsyncIteration:
                return
            yield batch


def models_meanwhile(view, model: str | None, wait_s: float) -> dict[str, dict]:
    """The models a request is admitted against while no worker lives: those last seen served.
    None ever seen: a named model is taken on trust (the workers check its prompt). 503 when
    the gateway does not wait (``wait_s`` 0) or cannot name a model."""
    models = view.models_known() if wait_s else {}
    if models:
        return models
    if model is None or not wait_s:
        raise errs.unavailable(f"no workers to serve the request (live workers: {view.live_roles()}; needed: "
                               f"prefill and decode, or colocated)")
    return {model: {"max_model_len": 0, "created": None}}


def waiting_for_capacity(handle, view, cancel, config):
    """``handle`` as a ``Waiting`` one (for ``config.capacity_wait_s`` or the request's timeout,
    whichever is shorter); ``handle`` itself when the gateway does not wait (0)."""
    if not config.capacity_wait_s:
        return handle
    return Waiting(handle, view, cancel, min(config.capacity_wait_s, config.timeout_s or float("inf")))
