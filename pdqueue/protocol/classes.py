"""Service classes: the one table of them (field ``class`` of a request, issue 27).

Each row of ``ServiceClass`` is a class with everything the rest of pdqueue knows of it;
nothing else lists the classes or their properties, so a new class is a new row here:

- its name (the request field ``class``) and its rank: the row's place, 0 first. The rank is
  the admission order everywhere: the engine's waiting order (``Sequence.rank``), a decode
  worker's backlog, the interactive stream read alone while lower ranks wait in an engine;
- ``stream``: its request stream, under the cluster's key prefix
  (``Keys.request_stream_for``); ``queue.streams.request_streams`` lists them in rank order;
- ``yields``: it runs only in the capacity the others leave (the batch class): a request
  role reads its stream through the gate of workers/admission.py, and in the engine its
  sequences take a bounded share of slots, prompt tokens and decode rows and are preempted
  first (engine/policies.py ``ClassShare``, which is told the ranks that yield,
  ``YIELDING_RANKS``, and asks each sequence only its rank);
- ``priority``: the ``priority`` a classless request of this class has (older producers: high
  is interactive, normal standard; None: a classless request is never in it). A classed
  request carries it too when it is not the default, which is what a worker older than the
  ``class`` field reads;
- ``routed``: a worker may move its requests to a peer that caches a longer prefix of them
  (workers/routing.py); their entries wait in the peer's own stream, which a request role
  reads just before this class's stream.

Standard library only, like the rest of the protocol.
"""

from __future__ import annotations

from enum import Enum

from .wire import Priority


class ServiceClass(str, Enum):
    """A request's service class; the members are the table (see the module docstring).
    ``ServiceClass("batch")`` is the class named on the wire."""

    #             name           stream            yields  priority         routed
    INTERACTIVE = ("interactive", "requests:high", False, Priority.HIGH, False)
    STANDARD = ("standard", "requests", False, Priority.NORMAL, True)
    BATCH = ("batch", "requests:batch", True, None, False)

    rank: int
    stream: str
    yields: bool
    priority: Priority | None
    routed: bool

    def __new__(cls, name: str, stream: str, yields: bool, priority: Priority | None, routed: bool):
        member = str.__new__(cls, name)
        member._value_ = name
        member.rank = len(cls.__members__)
        member.stream, member.yields, member.priority, member.routed = stream, yields, priority, routed
        return member

    # Formats as its value ("batch"), as the plain strings it replaced did.
    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def of(cls, service_class: ServiceClass | None, priority: Priority) -> ServiceClass:
        """The class a request is admitted in: its own, else the one its ``priority`` names
        (the default priority's for any other value: the request's check reports it)."""
        if service_class is not None:
            return service_class
        return _BY_PRIORITY.get(priority) or _BY_PRIORITY[Priority.NORMAL]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every class's name, in rank order (choices, error messages)."""
        return tuple(c.value for c in cls)


_BY_PRIORITY = {c.priority: c for c in ServiceClass if c.priority is not None}
YIELDING_RANKS = frozenset(c.rank for c in ServiceClass if c.yields)
"""The ranks of the classes that yield (``ServiceClass.yields``): what the engine's
``ClassShare`` is keyed by."""
