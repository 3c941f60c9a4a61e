"""What ``pdqueue status`` and the live view of ``pdqueue up`` show: a snapshot of one
pdqueue cluster read from Redis (``collect``), and its rendering with rich (``render``).

A snapshot is a plain JSON-able dict:
- ``workers``: every registered worker (role, node, pid, load incl. KV pool use and
  leases, heartbeat age, ``compat``: its compatibility record or None (drawn only when the
  workers are of more than one kind, and for a prefill worker whose load says
  ``no_compatible_decode``), ``metrics``: the host:port of its Prometheus endpoint or "",
  ``prefix_hit_pct``: of the prompt tokens its prefix cache was asked for, the share it had,
  or None before any);
- ``streams``: ``requests``, ``requests:high``, ``handoff`` and every ``handoff:<node>``,
  with length and, per consumer group, consumers, pending entries, lag (entries not yet
  delivered) and the idle time of the oldest pending entry; ``done`` and ``dead`` lengths;
- ``recent``: completions on the ``done`` stream within the last ``window_s`` seconds:
  count, tokens, tokens/s, and TTFT, TBT (per-request medians) and end-to-end percentiles;
- ``plan``: the planner's last published plan (``pdqueue.control.commands.read_plan``: desired
  counts per role and the reason), or None; ``switches``: the last few switch events.

Reads only; imports redis, rich (for ``render``) and pdqueue.keys/queue.registry.
"""

from __future__ import annotations

import json
import math
import time

import redis

from pdqueue.control import commands
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.protocol import as_str, entry_id_ms
from pdqueue.queue.backlog import group_backlog
from pdqueue.queue.registry import list_workers
from pdqueue.queue.streams import handoff_streams_found, request_streams_of

DONE_SCAN_LIMIT = 2000
"""At most this many of the newest ``done`` entries are read for the ``recent`` numbers."""


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles ({"p50": ..., ...}); None for an empty list."""
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for q in qs:
        if not ordered:
            out[f"p{q}"] = None
        else:
            rank = max(1, math.ceil(q / 100 * len(ordered)))
            out[f"p{q}"] = round(ordered[rank - 1], 3)
    return out


def _server_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _worker_row(w: dict, now_ms: int) -> dict:
    load = w.get("load") or {}
    total = load.get("kv_total") or 0
    free = load.get("kv_free")
    used_pct = round(100.0 * (total - free) / total, 1) if total and free is not None else None
    queries = int(load.get("prefix_cache_queries") or 0)
    hit_pct = round(100.0 * int(load.get("prefix_cache_hits") or 0) / queries, 1) if queries else None
    return {"worker_id": w["worker_id"], "role": w.get("role", ""), "node": w.get("node", ""),
            "host": w.get("host", ""), "pid": w.get("pid"), "model": w.get("model", ""),
            "weights": w.get("weights", ""), "compat": w.get("compat") or None,
            "endpoints": w.get("endpoints") or {}, "metrics": w.get("metrics") or "", "load": load,
            "kv_used_pct": used_pct, "prefix_hit_pct": hit_pct,
            "heartbeat_age_s": round(max(0, now_ms - int(w.get("beat_ms") or now_ms)) / 1000, 2)}


def _group_row(r: redis.Redis, stream: str, g: dict) -> dict:
    name = as_str(g.get("name", ""), "replace")
    backlog = group_backlog(r, stream, name)
    pending, lag = backlog.held, backlog.waiting
    oldest_idle_ms = None
    if pending:
        first = r.xpending_range(stream, name, "-", "+", 1)
        if first:
            oldest_idle_ms = int(first[0]["time_since_delivered"])
    return {"name": name, "consumers": int(g.get("consumers") or 0), "pending": pending,
            "lag": int(lag), "oldest_pending_idle_ms": oldest_idle_ms}


def _stream_info(r: redis.Redis, keys: Keys, key: str) -> dict:
    length = r.xlen(key)
    try:
        groups = r.xinfo_groups(key)
    except redis.ResponseError:  # no such key yet
        groups = []
    return {"key": key, "length": int(length), "groups": [_group_row(r, key, g) for g in groups]}


def _recent(r: redis.Redis, keys: Keys, now_ms: int, window_s: float) -> dict:
    since_ms = now_ms - int(window_s * 1000)
    entries = r.xrevrange(keys.done, "+", f"{since_ms}-0", count=DONE_SCAN_LIMIT)
    ttft, tbt, e2e = [], [], []
    num_tokens = 0
    first_start_ms = now_ms
    reasons: dict[str, int] = {}
    for entry_id, fields in entries:
        f = {as_str(k, "replace"): as_str(v, "replace") for k, v in fields.items()}
        try:
            n = len(json.loads(f.get("token_ids", "[]")))
            e2e_ms = float(f.get("e2e_ms", 0))
            ttft_ms = float(f.get("ttft_ms", 0))
            tbt_ms = float(f.get("tbt_p50_ms", 0))
        except ValueError:
            continue
        num_tokens += n
        reason = f.get("finish_reason", "")
        reasons[reason] = reasons.get(reason, 0) + 1
        if n:
            ttft.append(ttft_ms)
            e2e.append(e2e_ms)
        if n > 1:
            tbt.append(tbt_ms)
        done_ms = entry_id_ms(entry_id)
        first_start_ms = min(first_start_ms, done_ms - int(e2e_ms))
    # Rates over the active part of the window: from the arrival of its first request.
    span_s = max(1e-3, min(window_s, (now_ms - first_start_ms) / 1000)) if entries else window_s
    return {"window_s": window_s, "span_s": round(span_s, 3), "requests": len(entries),
            "tokens": num_tokens, "tokens_per_s": round(num_tokens / span_s, 2),
            "requests_per_s": round(len(entries) / span_s, 3), "finish_reasons": reasons,
            "ttft_ms": percentiles(ttft), "tbt_ms": percentiles(tbt), "e2e_ms": percentiles(e2e),
            "truncated": len(entries) >= DONE_SCAN_LIMIT}


def collect(r: redis.Redis, keys: Keys, window_s: float = 60.0) -> dict:
    """One snapshot of the cluster (see the module docstring). Raises redis errors."""
    now_ms = _server_ms(r)
    workers = [_worker_row(w, now_ms) for w in list_workers(r, keys)]
    # the classes' streams in class order, then the workers' own streams (routing)
    names = [*request_streams_of(r, keys), *handoff_streams_found(r, keys)]
    streams = {n[len(keys.prefix):]: _stream_info(r, keys, n) for n in names}
    return {"cluster": keys.cluster, "time_ms": now_ms, "workers": workers, "streams": streams,
            "done_length": int(r.xlen(keys.done)), "dead_length": int(r.xlen(keys.dead)),
            "recent": _recent(r, keys, now_ms, window_s), "plan": commands.read_plan(r, keys),
            "switches": _switches(r, keys)}


def _switches(r: redis.Redis, keys: Keys, count: int = 3) -> list[dict]:
    """The last ``count`` final switch events (done, refused, failed), newest last."""
    out = []
    for _eid, fields in r.xrevrange(keys.events, count=50):
        f = {as_str(k, "replace"): as_str(v, "replace") for k, v in fields.items()}
        if f.get("type") == commands.SWITCH and f.get("status") in ("done", "refused", "failed"):
            out.append(f)
            if len(out) == count:
                break
    return out[::-1]


def queued(snapshot: dict) -> int:
    """Entries waiting in the request streams, not yet taken by a prefill worker."""
    total = 0
    for name, s in snapshot["streams"].items():
        if name.startswith("requests"):
            lags = [g["lag"] for g in s["groups"] if g["name"] == PREFILL_GROUP]
            total += lags[0] if lags else s["length"]
    return total


# ---- rendering ---------------------------------------------------------------------------

def _kinds(workers: list[dict]) -> list:
    """Lines on the kinds of KV and wire among the workers (their compatibility records,
    workers/compat.py) when there is more than one, and on each prefill worker that no live
    decode worker is compatible with (its handoffs wait)."""
    from rich.text import Text

    kinds: dict[str, list[str]] = {}
    for w in workers:
        c = w.get("compat") or {}
        if c.get("kv"):
            kinds.setdefault(f"{c.get('format') or c['kv']}, model {w.get('model') or '?'}, KV identity {c['kv']}, "
                             f"handoff v{c.get('handoff')}, transfer v{c.get('transfer')}", []).append(w["worker_id"])
    lines = []
    if len(kinds) > 1:
        lines += [Text(""), Text("mixed versions: workers of different kinds exchange no KV", style="yellow")]
        lines += [Text(f"  {kind}: {', '.join(ids)}", style="yellow") for kind, ids in kinds.items()]
    for w in workers:
        if (w.get("load") or {}).get("no_compatible_decode"):
            lines.append(Text(f"{w['worker_id']}: no live decode worker is compatible with it; its handoffs wait",
                              style="red"))
    return lines


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _prompts(load: dict) -> str:
    """Prompt placement (workers/placement.py): a decode worker taking prompts shows the
    share of its time its decodes leave; a prefill worker, how many it placed."""
    if load.get("takes_prompts"):
        return f"takes, {load.get('spare', 0):.0%} spare"
    return f"{load['placed_out']} placed" if load.get("placed_out") else "-"


def render(snapshot: dict, title: str = "", processes: list[dict] | None = None, events: list[dict] | None = None):
    """A rich renderable of a snapshot; ``processes`` (from ``pdqueue up``) adds worker
    processes that are not running (``state``: e.g. "exited (-9); restart 1 in 1s"), and
    ``events`` the last lines of its supervisor (``LocalCluster.events``: exits, restarts,
    a crash loop with its log's last lines)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    workers = Table(title="workers", title_justify="left", expand=False, box=None, pad_edge=False)
    numbers = ("running", "waiting", "KV used", "cache hits", "leases", "beat")
    for col in ("worker", "role", "weights", "node", "running", "waiting", "KV used", "cache hits", "leases",
                "prompts", "beat", "metrics"):
        workers.add_column(col, justify="right" if col in numbers else "left")
    switchable = any(w["load"].get("switchable") or w.get("switchable") for w in snapshot["workers"])
    for w in snapshot["workers"]:
        load = w["load"]
        kv = "-" if w["kv_used_pct"] is None else \
            f"{load.get('kv_total', 0) - load.get('kv_free', 0)}/{load.get('kv_total', 0)} ({w['kv_used_pct']:.0f}%)"
        age = w["heartbeat_age_s"]
        role = w["role"]
        if load.get("switching_to") or w.get("switching_to"):
            role = f"{role} -> {load.get('switching_to') or w.get('switching_to')}"
        elif switchable and not (load.get("switchable") or w.get("switchable")):
            role = f"{role} (fixed)"
        workers.add_row(w["worker_id"], role, w.get("weights") or "-", (w["node"] or "")[:8],
                        str(load.get("running", "-")),
                        str(load.get("waiting", "-")), kv,
                        "-" if w.get("prefix_hit_pct") is None else f"{w['prefix_hit_pct']:.0f}%",
                        str(load.get("leases", "-")), _prompts(load),
                        Text(f"{age:.1f}s", style="yellow" if age > 5 else ""), w.get("metrics") or "-")
    registered = {w["worker_id"] for w in snapshot["workers"]}
    for p in processes or []:
        if p.get("starting") and p["worker_id"] in registered:
            continue   # (registered meanwhile: its row is above)
        workers.add_row(p["worker_id"], p["role"], "", "", "", "", "", "", "", "",
                        Text(p.get("state") or f"exited ({p['returncode']})",
                             style="yellow" if p.get("starting") else "red"), "")
    if not snapshot["workers"] and not processes:
        workers.add_row(Text("no worker registered", style="yellow"), *[""] * 10)

    streams = Table(title="streams", title_justify="left", box=None, pad_edge=False)
    for col in ("stream", "length", "group", "consumers", "pending", "lag", "oldest pending"):
        streams.add_column(col, justify="left" if col in ("stream", "group") else "right")
    for name, s in snapshot["streams"].items():
        groups = s["groups"] or [None]
        for i, g in enumerate(groups):
            label = name if i == 0 else ""
            length = str(s["length"]) if i == 0 else ""
            if g is None:
                streams.add_row(label, length, "-", "", "", "", "")
                continue
            idle = g["oldest_pending_idle_ms"]
            streams.add_row(label, length, g["name"], str(g["consumers"]), str(g["pending"]), str(g["lag"]),
                            "-" if idle is None else f"{idle / 1000:.1f}s")
    streams.add_row("done", str(snapshot["done_length"]), "", "", "", "", "")
    streams.add_row("dead", Text(str(snapshot["dead_length"]), style="red" if snapshot["dead_length"] else ""),
                    "", "", "", "", "")

    rec = snapshot["recent"]
    t, b, e = rec["ttft_ms"], rec["tbt_ms"], rec["e2e_ms"]
    recent = Text.assemble(
        (f"last {rec['window_s']:.0f}s: ", "bold"),
        f"{rec['requests']} requests, {rec['tokens']} tokens, {rec['tokens_per_s']:.1f} tok/s   ",
        f"TTFT p50/p90/p99 {_ms(t['p50'])}/{_ms(t['p90'])}/{_ms(t['p99'])} ms   ",
        f"TBT p50/p90 {_ms(b['p50'])}/{_ms(b['p90'])} ms   ",
        f"e2e p50/p99 {_ms(e['p50'])}/{_ms(e['p99'])} ms")
    parts = [Text(title, style="bold cyan")] if title else []
    tail = _kinds(snapshot["workers"])
    plan = snapshot.get("plan")
    if plan:
        counts = ", ".join(f"{plan[role]} {role}" for role in commands.ROLES if plan.get(role))
        tail += [Text(""), Text.assemble(("plan: ", "bold"), f"{counts or 'no workers'} ({plan.get('action', '')}, "
                                         f"{plan.get('mode', '')})  ", (plan.get("reason", ""), "dim"))]
    for sw in snapshot.get("switches") or []:
        style = "" if sw.get("status") == "done" else "yellow"
        took = f", {float(sw['switch_ms']):.0f} ms" if sw.get("switch_ms") else ""
        why = f": {sw['reason']}" if sw.get("reason") else ""
        tail.append(Text(f"switch {sw.get('worker', '')} {sw.get('from', '')} -> {sw.get('to', '')} "
                         f"{sw.get('status', '')}{took}{why}", style=style))
    if events:
        tail.append(Text(""))
        styles = {"error": "red", "warning": "yellow", "info": "green"}
        for e in events:
            tail.append(Text(f"{time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['text']}",
                             style=styles.get(e.get("level"), "")))
            if e.get("tail"):
                tail.append(Text("\n".join("    " + line for line in e["tail"].splitlines()[-5:]), style="dim"))
    return Group(*parts, workers, Text(""), streams, Text(""), recent, *tail)


__all__ = ["collect", "percentiles", "queued", "render"]
