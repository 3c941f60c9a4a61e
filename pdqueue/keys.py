"""Every Redis key and consumer-group name of a pdqueue cluster, in one place.

All keys of cluster NAME start with ``pdq:{NAME}:``; the braces are literal and form a
Redis Cluster hash tag, so every key of one pdqueue cluster lands in the same slot and
the MULTI/EXEC transactions that span them (ack the input + write the output) also work
on Redis Cluster.

| key                    | type                     | written by          | read by            |
|------------------------|--------------------------|---------------------|--------------------|
| ``requests``,          | stream, group ``prefill``| producers           | prefill workers    |
| ``requests:high``, ... | (one per service class)  |                     | (in class order)   |
| ``handoff:<node>``     | stream, group ``decode`` | prefill             | decode (own node)  |
| ``handoff``            | stream, group ``decode`` | prefill             | decode (any node)  |
| ``handoff:kv:<key>``   | stream, group ``decode`` | prefill, decode     | decode of that key |
| ``out:<request_id>``   | stream, TTL              | prefill, decode     | the producer       |
| ``done``               | stream, trimmed          | decode              | observers, bench   |
| ``dead``               | stream, trimmed          | any worker          | operators          |
| ``worker:<id>``        | hash, TTL (heartbeat)    | each worker         | everyone           |
| ``cancel:<request_id>``| string, TTL              | producers           | workers            |
| ``seen:<request_id>``  | string, TTL              | prefill, batch      | prefill            |
| ``control:<worker_id>``| stream, TTL              | planners, operators | that worker        |
| ``events``             | stream, trimmed          | workers, planners   | operators, status  |
| ``plan``               | hash                     | the planner         | actuators, status  |
| ``kv_secret``          | string (hex), no TTL     | first worker, SET NX| workers (KV auth)  |
| ``gw:<request_id>``    | string (JSON), TTL       | gateways, SET NX    | gateways (resume)  |
| ``gwresp:<resp id>``,  | hash, TTL; sorted set    | gateways (the       | gateways           |
| ``gwresponses:active`` |                          | Responses API)      | (responses_store)  |
| ``read:<request_id>``  | string, TTL              | clients of ``up``'s | ``pdqueue up``     |
|                        |                          | embedded server     | (its stop)         |
| ``usage``              | stream, trimmed by age   | any worker          | ``pdqueue usage``  |
| ``usage:<request_id>`` | string, TTL              | any worker, SET NX  | workers            |

The request streams are the service classes' (pdqueue/protocol/classes.py names each class's
stream: ``requests:high`` interactive, ``requests`` standard, ``requests:batch`` batch):
``request_stream_for(cls)`` puts one under the prefix, ``queue.streams.request_streams`` lists
them in class order. Nothing here lists the classes.

Imports nothing but the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFILL_GROUP = "prefill"
DECODE_GROUP = "decode"

OUT_TTL_S = 3600
"""An answer stream lives this long after its last write (every write refreshes it)."""
HEARTBEAT_TTL_S = 10
"""A ``worker:<id>`` hash expires this long after the worker's last beat."""
CANCEL_TTL_S = 3600
SEEN_TTL_S = 86400
"""How long a request id is remembered for idempotency (a repeated id is not run twice)."""
DONE_MAXLEN = 10000
DEAD_MAXLEN = 10000
EVENTS_MAXLEN = 10000
"""``done``, ``dead`` and ``events`` are trimmed approximately (``XADD MAXLEN ~``) to about this many."""
CONTROL_TTL_S = 3600
"""A worker's command stream lives this long after the last command sent to it."""
USAGE_RETENTION_S = 7 * 86400
"""The usage ledger keeps a record this long by default (``PDQ_USAGE_RETENTION_S`` in the
workers' environment changes it: pdqueue/queue/ledger.py); older ones are trimmed as new
ones are added (``XADD MINID ~``)."""

_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names of one pdqueue cluster. ``Keys().requests == "pdq:{default}:requests"``."""

    cluster: str = "default"

    def __post_init__(self) -> None:
        # Braces would break the hash tag, glob characters the SCAN pattern.
        if not _CLUSTER_NAME.match(self.cluster):
            raise ValueError(
                f"cluster name must be 1..64 characters of [A-Za-z0-9._-], got {self.cluster!r}")

    @property
    def prefix(self) -> str:
        return f"pdq:{{{self.cluster}}}:"

    # -- streams -------------------------------------------------------------------------
    @property
    def requests(self) -> str:
        """The standard class's stream (``ServiceClass.STANDARD.stream``), whose name the
        workers' own streams (``requests_for``) extend."""
        return self.prefix + "requests"

    def request_stream_for(self, service_class) -> str:
        """The stream of a ``pdqueue.protocol.ServiceClass`` (its ``stream``; a request's
        ``Request.cls``): where a producer writes a request of that class."""
        return self.prefix + service_class.stream

    def requests_for(self, worker_id: str) -> str:
        """One prefill (or colocated) worker's own request stream: requests routed to it
        because it caches their prefix (workers/routing.py). Read after ``requests:high``
        and before ``requests``; others take entries over when it dies or lags."""
        return f"{self.prefix}requests:w:{worker_id}"

    @property
    def routed_streams(self) -> str:
        """The set of every worker's own request stream (``requests_for``) in the cluster."""
        return self.prefix + "routed-streams"

    def prefix_owner(self, block_hash_hex: str) -> str:
        """Which worker last computed or used the KV block with this prefix-cache hash
        (a string with a TTL: an advertisement, not a promise)."""
        return f"{self.prefix}prefix:{block_hash_hex}"

    def kv_hold(self, block_hash_hex: str) -> str:
        """Which hold (``kv_ticket``'s id) keeps the KV block with this prefix-cache hash
        exported for the next turn to pull (workers/kv_holds.py; a string with the hold's TTL)."""
        return f"{self.prefix}kvhold:{block_hash_hex}"

    def kv_ticket(self, hold_id: str) -> str:
        """The packed ticket of a hold (workers/kv_holds.py, workers/kv_pull.py), with its TTL."""
        return f"{self.prefix}kvticket:{hold_id}"

    @property
    def handoff(self) -> str:
        """The global handoff stream: any decode worker may take these."""
        return self.prefix + "handoff"

    def handoff_node(self, node: str) -> str:
        """The handoff stream of one shared-memory domain (decode workers there read it first)."""
        return f"{self.prefix}handoff:{node}"

    def handoff_compat(self, compat_key: str) -> str:
        """The handoff stream of one compatibility key (``pdqueue.protocol.compat``): only decode
        workers of that key read it. Senders use it while the cluster is mixed (an incompatible
        decode worker lives); a decode worker passes a handoff it must not run on to it."""
        return f"{self.prefix}handoff:kv:{compat_key}"

    def handoff_streams(self, node: str) -> tuple[str, str]:
        """The handoff streams in the order a decode worker on ``node`` reads them."""
        return (self.handoff_node(node), self.handoff)

    def out(self, request_id: str) -> str:
        """The answer stream of one request (token, done and error entries)."""
        return f"{self.prefix}out:{request_id}"

    @property
    def done(self) -> str:
        return self.prefix + "done"

    @property
    def dead(self) -> str:
        return self.prefix + "dead"

    # -- plain keys ------------------------------------------------------------------------
    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    @property
    def workers_pattern(self) -> str:
        """SCAN MATCH pattern of every ``worker:<id>`` hash."""
        return self.prefix + "worker:*"

    def worker_id_of(self, key: str | bytes) -> str:
        """The ``<id>`` part of a ``worker:<id>`` key."""
        if isinstance(key, bytes):
            key = key.decode()
        return key[len(self.prefix) + len("worker:"):]

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}cancel:{request_id}"

    def read(self, request_id: str) -> str:
        """A read receipt: a client has read the answer on ``out:<request_id>`` to its end.
        Written (TTL ``OUT_TTL_S``) only by clients of a ``pdqueue up``'s embedded server,
        which stays up at the stop until every answer it holds has one (or a grace runs out)."""
        return f"{self.prefix}read:{request_id}"

    @property
    def out_pattern(self) -> str:
        """SCAN MATCH pattern of every ``out:<id>`` answer stream."""
        return self.prefix + "out:*"

    def gateway_record(self, request_id: str) -> str:
        """What a gateway needs to resume a resumable request's answer (pdqueue.frontends.gateway)."""
        return f"{self.prefix}gw:{request_id}"

    @property
    def usage(self) -> str:
        """The usage ledger: one record per request, written with its final answer
        (pdqueue/queue/ledger.py); append-only, trimmed by age."""
        return self.prefix + "usage"

    def usage_guard(self, request_id: str) -> str:
        """Set (NX) by the script that writes a request's usage record: a second final answer
        for the same request id adds no second record."""
        return f"{self.prefix}usage:{request_id}"

    def seen(self, request_id: str) -> str:
        """Idempotency marker. Its value is the stream entry id that first carried the id:
        a redelivery of that same entry (after a crash) proceeds, another entry with the
        same request id is a duplicate and is not run."""
        return f"{self.prefix}seen:{request_id}"

    # -- control: role switching and the planner (pdqueue/control/commands.py) ----------------------
    def control(self, worker_id: str) -> str:
        """Commands to one worker (``switch``); it reads and deletes them."""
        return f"{self.prefix}control:{worker_id}"

    @property
    def events(self) -> str:
        """What workers and planners did: switch requested, refused, done; plan decisions."""
        return self.prefix + "events"

    @property
    def plan(self) -> str:
        """The planner's desired worker counts per role, with its reason (a hash)."""
        return self.prefix + "plan"

    # -- the KV channel's secret (docs/security.md) --------------------------------------------
    @property
    def kv_secret(self) -> str:
        """The cluster's KV secret (hex), when workers are given none: the first worker
        creates it (SET NX), every worker reads it. Whoever can read it can fetch KV."""
        return self.prefix + "kv_secret"
