"""The KV transports: one registration each, the one list of their names.

A transport is one module holding both its halves: the receiver's ``base.Transport`` (how
a decode worker copies a ticket's blocks into its pool) and, where the sender must run
something beyond the ZeroMQ control channel every path shares, the sender's
``base.Source`` (the TCP data server, the NIXL agent). ``register`` names the module and
the classes as strings; nothing is imported until a half is asked for (as vLLM's
``KVConnectorFactory.register_connector``), so reading the names (the CLI's ``--transfer``
choices, a worker's configuration check) imports neither torch nor zmq nor NIXL.

Adding a transport: write ``pdqueue/transfer/<name>.py`` with its halves, add one
``register`` line at the bottom of this module, and its tests. Everything that lists
transports derives from here: ``--transfer``'s choices and help (workers/cli/worker.py),
``WorkerConfig``'s check (workers/common.py), mode ``auto``'s order (transfer.receiver),
which sender halves a ``KVSender`` starts (transfer.sender), which request ops reach them
(transfer.sender_admission), and whether a prefill worker hands off to its node's stream
(``same_host_possible``, workers/prefill.py and workers/migration.py).
Imports the standard library only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

AUTO = "auto"   # the mode that picks, per ticket, the first transport of ``auto_order()`` that can serve it


@dataclass(frozen=True, slots=True)
class TransportSpec:
    """One transport. ``module``: where both its halves live; ``receiver``: its
    ``Transport`` class; ``source``: its ``Source`` class (None: the sender serves it with
    what every sender runs, the ZeroMQ ROUTER and, for shm, its segment). ``auto_rank``: its
    place in mode ``auto`` (None: only when named, e.g. a ticket does not say whether its
    sender runs it). ``same_host``: it reaches only senders on this node (a prefill worker
    then hands off to the node's stream when a decode worker lives there). ``serve``:
    ``always`` (the sender half runs whenever it can serve the pool) or ``named`` (only on
    a worker started with ``--transfer <name>``). ``ops``: the request ops its sender half
    answers on the control channel; ``leased_ops``: those of them about a ticket's lease
    (checked against the ticket's MAC, as a fetch is). ``unserved``: what a sender that
    does not run it answers to those ops. ``missing``: a function of the module returning
    why the transport cannot run here (a dependency not installed) or None. ``encodes``: it
    moves KV in the format a receiver asks for (``--kv-wire-format``: engine.kv_codec); one
    that does not moves native KV. ``help``: its words in ``--transfer``'s help (for one in
    the auto order: how that order names it)."""

    name: str
    module: str
    receiver: str
    source: str | None = None
    auto_rank: int | None = None
    same_host: bool = False
    serve: str = "always"
    ops: tuple[str, ...] = ()
    leased_ops: tuple[str, ...] = ()
    unserved: str = ""
    missing: str | None = None
    encodes: bool = False
    help: str = ""

    def load(self, attr: str):
        return getattr(importlib.import_module(self.module), attr)

    def receiver_class(self):
        return self.load(self.receiver)

    def source_class(self):
        return self.load(self.source) if self.source else None


_SPECS: dict[str, TransportSpec] = {}


def register(name: str, module: str, receiver: str, **properties) -> TransportSpec:
    """Make a transport known by ``name`` (see ``TransportSpec``); its module is imported
    only when one of its halves is used."""
    if name == AUTO or name in _SPECS:
        raise ValueError(f"transport {name!r} is already registered" if name in _SPECS else f"{AUTO!r} is a mode")
    spec = TransportSpec(name, module, receiver, **properties)
    if spec.serve not in ("always", "named"):
        raise ValueError(f"transport {name}: serve must be 'always' or 'named', got {spec.serve!r}")
    _SPECS[name] = spec
    return spec


def names() -> tuple[str, ...]:
    """The registered transports, in registration order."""
    return tuple(_SPECS)


def modes() -> tuple[str, ...]:
    """What ``--transfer`` accepts: ``auto`` and every transport."""
    return (AUTO, *_SPECS)


def spec(name: str) -> TransportSpec:
    """The transport called ``name``; ValueError listing the known ones otherwise."""
    found = _SPECS.get(name)
    if found is None:
        raise ValueError(f"unknown transfer mode {name!r}; expected {AUTO} or one of {sorted(_SPECS)}")
    return found


def check_mode(mode: str) -> str:
    """``mode`` if it is ``auto`` or a transport; ValueError listing them otherwise."""
    if mode != AUTO:
        spec(mode)
    return mode


def auto_order() -> list[str]:
    """Mode ``auto``'s preference: the transports with an ``auto_rank``, lowest first."""
    ranked = sorted((s.auto_rank, i, s.name) for i, s in enumerate(_SPECS.values()) if s.auto_rank is not None)
    return [name for _rank, _i, name in ranked]


def candidates(mode: str) -> list[str]:
    """The transports a receiver in ``mode`` may use, in the order it tries them."""
    return auto_order() if mode == AUTO else [spec(mode).name]


def same_host_possible(mode: str) -> bool:
    """Whether a worker in ``mode`` may move KV over a same-host-only transport (shm), so
    its handoffs should go to its node's stream when a decode worker lives there."""
    return any(spec(name).same_host for name in candidates(mode))


def served(mode: str) -> list[TransportSpec]:
    """The transports with a sender half that a sender of a worker in ``mode`` starts."""
    return [s for s in _SPECS.values() if s.source and (s.serve == "always" or s.name == mode)]


def op_owner(op: str) -> TransportSpec | None:
    """The transport whose sender half answers request op ``op``, if any."""
    return next((s for s in _SPECS.values() if op in s.ops), None)


def leased_ops() -> frozenset[str]:
    """The ops of sender halves that name a ticket's lease (their MAC is checked)."""
    return frozenset(op for s in _SPECS.values() for op in s.leased_ops)


def missing(mode: str) -> str | None:
    """Why ``mode`` cannot run here (a dependency not installed), or None."""
    if mode == AUTO or spec(mode).missing is None:
        return None
    return spec(mode).load(spec(mode).missing)()


def encodes(name: str) -> bool:
    """Whether transport ``name`` moves KV in the format a receiver asks for (else native)."""
    return spec(name).encodes


def help_text() -> str:
    """``--transfer``'s help: auto's order, then each transport named only explicitly."""
    order = ", else ".join(_SPECS[n].help or n for n in auto_order())
    rest = "; ".join(f"{s.name}: {s.help}" for s in _SPECS.values() if s.auto_rank is None)
    return f"How KV reaches the decode side (auto: {order}" + (f"; {rest}" if rest else "") + ")."


# The transports. One line each; the order of auto_rank is mode auto's order.
register("shm", "pdqueue.transfer.shm", "ShmTransport", auto_rank=0, same_host=True,
         help="shm on the same node")
register("tcp", "pdqueue.transfer.tcp", "TcpTransport", source="DataSource", auto_rank=1, encodes=True,
         help="the TCP data wire")
register("zmq", "pdqueue.transfer.zmq", "ZmqTransport", auto_rank=2, encodes=True)
register("nixl", "pdqueue.transfer.nixl", "NixlTransport", source="NixlSource", serve="named",
         ops=("nixl_md", "acquire"), leased_ops=("acquire",), unserved="runs no NIXL agent", missing="nixl_missing",
         help="one-sided reads over NIXL/UCX, RDMA where the hardware has it, on prefill and decode workers "
              "alike; needs pdqueue[rdma]")
