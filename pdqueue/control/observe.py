"""The planner's eyes: one ``Observation`` of a pdqueue cluster, read from Redis.

``observe(r, keys)`` reads, and only reads (the same sources as ``pdqueue status``):
- the ``worker:<id>`` heartbeats (``pdqueue.queue.registry.list_workers``): role, node,
  incarnation, and from ``load`` running/waiting/backlog/fetching/kv_free/kv_total, plus
  what switchable workers add: ``role_epoch`` (missing: 0), ``switchable`` (missing:
  False), and optionally ``step_ms`` (recent engine step time at ``running``) and
  ``role_since_ms`` (when the worker took its current role). Those may sit in ``load``
  (what ``Heartbeat.update(role_epoch=...)`` writes) or as top-level hash fields;
  ``load`` wins;
- the backlog (``pdqueue.queue.backlog``) of the request streams (group ``prefill``) and
  of the handoff streams (``handoff``, ``handoff:<node>`` for every node and
  ``handoff:kv:<key>`` for every compatibility kind named by a
  heartbeat; group ``decode``): lag (entries not yet delivered) and pending (delivered,
  not acknowledged);
- the ``done`` entries of the last ``window_s`` seconds (at most ``done_limit``, newest
  first), parsed with ``pdqueue.protocol.parse_result``; malformed ones are skipped.

Times: ``now`` (Unix seconds) defaults to the Redis server's clock, the clock of the
stream entry ids, so the window and the completions' finish times agree.

Imports redis and pdqueue.keys/protocol/queue and the planner's observation types.
"""

from __future__ import annotations

from typing import Any

import redis

from pdqueue.control.decision import PlannerConfig
from pdqueue.control.observation import CompletionObs, Observation, WorkerObs
from pdqueue.keys import DECODE_GROUP, PREFILL_GROUP, Keys
from pdqueue.protocol import ProtocolError, ResultType, as_str, entry_id_ms, parse_result
from pdqueue.queue.backlog import streams_backlog
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import handoff_streams_of, request_streams_of

DONE_LIMIT = 2000


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(float(as_str(value, "replace")))
    except (TypeError, ValueError):
        return default


def _float(value: Any) -> float | None:
    try:
        out = float(as_str(value, "replace"))
    except (TypeError, ValueError):
        return None
    return out if out == out else None  # NaN -> None


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    return as_str(value, "replace").strip().lower() in ("1", "true", "yes", "on")


def _field(w: dict, name: str) -> Any:
    load = w.get("load") or {}
    if isinstance(load, dict) and name in load:
        return load[name]
    return w.get(name)


def worker_obs(w: dict, now_ms: int) -> WorkerObs:
    """A ``list_workers`` dict as a ``WorkerObs``."""
    load = w.get("load") if isinstance(w.get("load"), dict) else {}
    kv_total = load.get("kv_total")
    kv_free = load.get("kv_free")
    since_ms = _float(_field(w, "role_since_ms"))
    step_ms = _float(_field(w, "step_ms"))
    beat_ms = _int(w.get("beat_ms"), now_ms) or now_ms
    return WorkerObs(
        worker_id=w["worker_id"], role=as_str(w.get("role", ""), "replace"),
        role_epoch=_int(_field(w, "role_epoch"), 0),
        switchable=_bool(_field(w, "switchable") or False),
        running=_int(load.get("running")), waiting=_int(load.get("waiting")),
        backlog=_int(load.get("backlog")), fetching=_int(load.get("fetching")),
        kv_free=None if kv_free is None else _int(kv_free),
        kv_total=None if kv_total is None else _int(kv_total),
        node=as_str(w.get("node", ""), "replace"), incarnation=as_str(w.get("incarnation", ""), "replace"),
        beat_age_s=max(0, now_ms - beat_ms) / 1000.0,
        step_ms=step_ms if step_ms and step_ms > 0 else None,
        role_since=None if since_ms is None else since_ms / 1000.0,
        tbt_budget_ms=(_float(load.get("tbt_budget_ms")) or None), budgetable="tbt_budget_ms" in load,
        takes_prompts=_bool(load.get("takes_prompts") or False),
        draining=_bool(load.get("draining") or False) or bool(as_str(w.get("switching_to") or "", "replace")))


def completion_obs(entry_id: Any, fields: dict) -> CompletionObs | None:
    """A ``done`` stream entry as a ``CompletionObs``; None if malformed or not a done entry."""
    try:
        event = parse_result(entry_id, fields)
    except ProtocolError:
        return None
    c = event.completion
    if event.type is not ResultType.DONE or c is None:
        return None
    finish_ms = entry_id_ms(entry_id)   # 0: not an entry id
    if not finish_ms:
        return None
    return CompletionObs(
        finish_time=finish_ms / 1000.0, ttft_ms=c.ttft_ms, tbt_p50_ms=c.tbt_p50_ms,
        tbt_max_ms=c.tbt_max_ms, num_prompt_tokens=c.num_prompt_tokens,
        num_output_tokens=len(c.token_ids), prefill_ms=c.prefill_ms, decode_ms=c.decode_ms,
        queue_ms=c.queue_ms, e2e_ms=c.e2e_ms, transfer_path=c.transfer_path,
        prefill_worker=c.prefill_worker, decode_worker=c.decode_worker,
        finish_reason=c.finish_reason.value, request_id=c.request_id)


def server_time(r: redis.Redis) -> float:
    seconds, micros = r.time()
    return int(seconds) + int(micros) / 1e6


def observe(r: redis.Redis, keys: Keys, now: float | None = None, window_s: float | None = None, *,
            done_limit: int = DONE_LIMIT) -> Observation:
    """One ``Observation`` of the cluster (see the module docstring); ``window_s`` None: the
    planner's default (``PlannerConfig.window_s``). Raises redis errors."""
    if window_s is None:
        window_s = PlannerConfig().window_s
    if now is None:
        now = server_time(r)
    now_ms = int(now * 1000)
    listed = list_workers(r, keys)
    workers = tuple(worker_obs(w, now_ms) for w in listed)

    requests = streams_backlog(r, request_streams_of(r, keys), PREFILL_GROUP)
    handoffs = streams_backlog(r, handoff_streams_of(keys, listed), DECODE_GROUP)

    since_ms = max(0, now_ms - int(window_s * 1000))
    entries = r.xrevrange(keys.done, str(now_ms), f"{since_ms}-0", count=done_limit)
    completions = []
    for entry_id, fields in entries:
        c = completion_obs(entry_id, fields)
        if c is not None and c.finish_time <= now + 1e-3:
            completions.append(c)
    completions.sort(key=lambda c: c.finish_time)
    return Observation(time=now, workers=workers, request_lag=requests.waiting,
                       request_pending=requests.held, handoff_lag=handoffs.waiting,
                       handoff_pending=handoffs.held, completions=tuple(completions),
                       window_s=window_s)


__all__ = ["DONE_LIMIT", "completion_obs", "observe", "server_time", "worker_obs"]
