"""`pdqueue bench serve`'s modes: the worker processes each mode starts (role and extra
``pdqueue worker`` options), and what runs beside the load (the adaptive mode's planner).

Adding a mode is one entry in ``MODES``: a ``Mode`` whose ``workers`` lists the processes
and their ``pdqueue worker`` options (a worker option that lands later is one more entry
with it), and, where the mode needs it, a ``beside`` that starts a loop in this process for
the length of the mode's measurement and returns the function that stops it. An option may
name ``SCRATCH``: each start of the mode replaces it with a fresh directory of its own (the
tiers modes' shared ``--kv-disk-dir``, so that no run starts with another's KV files),
removed after the mode's workers stopped. The workers are started
through a ``Launcher`` the CLI provides (so that pdqueue never imports workers), each with
one torch thread. Imports the standard library; the planner only when the adaptive mode runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from pdqueue.bench.serve_load import Settings

Workers = list[tuple[str, tuple[str, ...]]]   # (role, extra worker options) of each process
SCRATCH = "{scratch}"   # in a worker option: the directory of this start of the mode (mode_workers)


class BenchError(RuntimeError):
    """The bench cannot run (no Redis server, a worker did not start, no OpenAI server)."""



@dataclass(frozen=True, slots=True)
class Mode:
    workers: Callable[[Settings], Workers]
    # Started once the workers are up, with (settings, redis_url, cluster); returns its stop.
    beside: Callable[[Settings, str, str], Callable[[], None]] | None = None


def _fixed(*workers: tuple[str, tuple[str, ...]]) -> Callable[[Settings], Workers]:
    return lambda _settings: list(workers)


def _colocated_chunked(*, slo: bool = False, weights: str | None = None,
                       switchable: bool = False) -> Callable[[Settings], Workers]:
    """2 colocated workers, decodes first and prompt chunks of at most ``chunk_tokens`` per
    step; ``slo``: under the TBT budget of the bench's own TBT SLO (scheduler.py); ``weights``:
    quantized weights (a colocated worker takes the decode side's ``--weights``)."""
    def workers(settings: Settings) -> Workers:
        extra = ("--policy", "chunked", "--max-batched-tokens", str(settings.chunk_tokens))
        if slo:
            extra += ("--tbt-slo-ms", f"{settings.slo_tbt_ms:g}")
        if weights:
            extra += ("--weights", weights)
        if switchable:
            extra += ("--switchable",)
        return [("colocated", extra)] * 2
    return workers


def _elastic_split(weights: str | None, prefill_weights: str | None = None) -> Callable[[Settings], Workers]:
    """1 prefill worker (float32, or ``prefill_weights``) placing prompts by cost + 1 decode
    worker (``weights``) taking them within the TBT budget of the bench's TBT SLO; both
    switchable."""
    def workers(settings: Settings) -> Workers:
        # (``--placed-chunk-tokens``, 512 by default: a cap; the TBT budget sizes the chunks by the
        # TBT SLO: docs/performance-history.md, "chunks sized by the TBT target, and the TTFT order")
        decode = ("--take-prompts", "--policy", "chunked", "--max-batched-tokens", str(settings.placed_chunk_tokens),
                  "--tbt-slo-ms", f"{settings.slo_tbt_ms:g}", "--switchable")
        if weights:
            decode = ("--weights", weights, *decode)
        prefill = ("--placement", "auto", "--switchable")
        if prefill_weights:
            prefill = ("--weights", prefill_weights, *prefill)
        return [("prefill", prefill), ("decode", decode)]
    return workers


def _prefix(*extra: str) -> Callable[[Settings], Workers]:
    """2 prefill + 1 decode workers (decode workers take --routing and ignore it)."""
    return lambda _settings: [("prefill", extra)] * 2 + [("decode", extra)]


def _kept(workers: Callable[[Settings], Workers], *, tiers: bool, pull: str) -> Callable[[Settings], Workers]:
    """``workers`` keeping the last turn's KV one way (issue 41), for the multi-turn load:
    ``tiers``: each worker a host tier of the bench's ``kv_host_tier_mb`` and all of them
    one disk tier (the workers of a node share it: a decode worker's finished answer is
    there for the next turn's prefill worker) bounded by ``kv_disk_gb``, in the start's own
    directory; ``pull``: ``--kv-pull`` (workers/kv_pull.py: always, the next turn pulls the
    history from the worker holding it; never, no worker keeps a finished request's KV for
    another)."""
    def kept(settings: Settings) -> Workers:
        extra = ("--kv-pull", pull)
        if tiers:
            extra += ("--kv-host-tier-mb", str(settings.kv_host_tier_mb), "--kv-disk-dir", f"{SCRATCH}/kv",
                      "--kv-disk-gb", f"{settings.kv_disk_gb:g}")
        return [(role, (*other, *extra)) for role, other in workers(settings)]
    return kept


def _start_planner(settings: Settings, url: str, cluster: str, elastic: bool = False) -> Callable[[], None]:
    """The adaptive mode's planner, in a thread of this process, until the returned function
    is called; ``elastic``: also over the workers' TBT budgets and migrations."""
    import threading

    from pdqueue.control.adapter import Adapter
    from pdqueue.control.planner import PlannerConfig
    from pdqueue.keys import Keys
    from pdqueue.queue.connection import connect

    config = PlannerConfig(ttft_slo_ms=settings.slo_ttft_ms, tbt_slo_ms=settings.slo_tbt_ms, mode=settings.plan_mode,
                           min_dwell_s=settings.plan_dwell_s, cooldown_s=settings.plan_cooldown_s,
                           window_s=settings.plan_window_s, move_timeout_s=60.0, elastic=elastic)
    adapter = Adapter(connect(url, purpose="supervisor"), Keys(cluster), config, name="bench-serve")
    done = threading.Event()
    threading.Thread(target=adapter.run, args=(done, 1.0), name="pdq-planner", daemon=True).start()
    return done.set


MODES: dict[str, Mode] = {
    "disagg": Mode(_fixed(("prefill", ()), ("decode", ()))),
    "colocated-prefill-first": Mode(_fixed(*[("colocated", ("--policy", "prefill_first"))] * 2)),
    "colocated-chunked": Mode(_colocated_chunked()),
    # Starts as 1 + 1; the planner moves them (pdqueue.control.adapter).
    "adaptive": Mode(_fixed(("prefill", ("--switchable",)), ("decode", ("--switchable",))), beside=_start_planner),
    # The prefix-caching comparison (``--workload prefix``): caching off, caching on with
    # cache-blind routing, and caching with cache-aware routing.
    "prefix-off": Mode(_prefix("--no-prefix-caching")),
    "prefix-blind": Mode(_prefix("--routing", "off")),
    "prefix-aware": Mode(_prefix("--routing", "cache")),
    # Precision per role (issue 17): 1 prefill worker in float32 + 1 decode worker with
    # quantized weights, against ``disagg`` (both float32).
    "disagg-int8": Mode(_fixed(("prefill", ()), ("decode", ("--weights", "int8")))),
    "disagg-int4": Mode(_fixed(("prefill", ()), ("decode", ("--weights", "int4")))),
    "colocated-chunked-int4": Mode(_colocated_chunked(weights="int4")),
    "colocated-slo": Mode(_colocated_chunked(slo=True)),
    "colocated-slo-int4": Mode(_colocated_chunked(slo=True, weights="int4")),
    # Issue 25: the split of disagg-int4 whose decode worker also prefills the short prompts
    # the prefill worker places there when they would get their first token sooner
    # (workers/placement.py), under the TBT budget of the bench's TBT SLO; switchable, with
    # the planner over roles, budgets and migrations beside it.
    "elastic": Mode(_elastic_split("int4"), beside=lambda settings, url, cluster: _start_planner(settings, url, cluster,
                                                                                               elastic=True)),
    # The same split with placement and no planner (what the placement does on its own).
    "placement-int4": Mode(_elastic_split("int4")),
    "placement-fp32": Mode(_elastic_split(None)),   # beside disagg and colocated-slo in float32
    "elastic-fp32": Mode(_elastic_split(None),
                         beside=lambda settings, url, cluster: _start_planner(settings, url, cluster, elastic=True)),
    # q4_1 (pdqueue's 4-bit x 8-bit kernel, models/q4.py) in every role: it prefills faster than
    # float32 on a CPU with VNNI, and decodes faster than int4.
    "disagg-q4_1": Mode(_fixed(("prefill", ("--weights", "q4_1")), ("decode", ("--weights", "q4_1")))),
    "colocated-chunked-q4_1": Mode(_colocated_chunked(weights="q4_1")),
    "placement-q4_1": Mode(_elastic_split("q4_1", "q4_1")),
    "elastic-q4_1": Mode(_elastic_split("q4_1", "q4_1"),
                         beside=lambda settings, url, cluster: _start_planner(settings, url, cluster, elastic=True)),
    # ``--decode-here`` against a fixed split (issue 25): a q4_1 split whose decode worker has 4
    # slots, so it fills under load; the prefill worker hands every request over (waiting for a
    # slot), or decodes it itself when the decode worker is full.
    "disagg-q4_1-4slots": Mode(_fixed(("prefill", ("--weights", "q4_1")),
                                      ("decode", ("--weights", "q4_1", "--max-num-seqs", "4")))),
    "disagg-q4_1-4slots-here": Mode(_fixed(("prefill", ("--weights", "q4_1", "--decode-here", "auto")),
                                           ("decode", ("--weights", "q4_1", "--max-num-seqs", "4")))),
    # ... and its prefill worker steps under the TBT budget (chunked), so the decodes it keeps
    # are not stalled behind its whole prompts.
    "disagg-q4_1-4slots-here-slo": Mode(lambda settings: [
        ("prefill", ("--weights", "q4_1", "--decode-here", "auto", "--policy", "chunked",
                     "--tbt-slo-ms", f"{settings.slo_tbt_ms:g}")),
        ("decode", ("--weights", "q4_1", "--max-num-seqs", "4"))]),
    # An elastic cluster that starts all-colocated: 2 colocated int4 workers under the TBT
    # budget, switchable, with the same planner.
    "elastic-colocated": Mode(_colocated_chunked(slo=True, weights="int4", switchable=True),
                              beside=lambda settings, url, cluster: _start_planner(settings, url, cluster,
                                                                                   elastic=True)),
    # A conversation's last turn kept three ways (``--workload multiturn``), on the split and on
    # two chunked colocated workers. The next turn's history is the last turn's prompt, held by
    # the prefill worker's pool while it lasts, and its answer, held by the decode worker.
    # -recompute: nothing else kept (--kv-pull never: no pull, no holds): what the pools' prefix
    # caches keep, the rest computed again. -tiers: the same with the KV tiers: the blocks a
    # pool evicts go to its host tier, and the decode worker writes a finished answer's blocks
    # to the shared disk tier, where the next turn's prefill worker reads them. -pull: no tiers,
    # --kv-pull always: the next turn's prefill worker pulls the history from the worker that
    # holds it. (``disagg`` and ``colocated-chunked`` run the workers' default, --kv-pull auto.)
    "disagg-recompute": Mode(_kept(_fixed(("prefill", ()), ("decode", ())), tiers=False, pull="never")),
    "disagg-tiers": Mode(_kept(_fixed(("prefill", ()), ("decode", ())), tiers=True, pull="never")),
    "disagg-pull": Mode(_kept(_fixed(("prefill", ()), ("decode", ())), tiers=False, pull="always")),
    "colocated-chunked-recompute": Mode(_kept(_colocated_chunked(), tiers=False, pull="never")),
    "colocated-chunked-tiers": Mode(_kept(_colocated_chunked(), tiers=True, pull="never")),
    "colocated-chunked-pull": Mode(_kept(_colocated_chunked(), tiers=False, pull="always")),
}
PREFIX_MODES = ("prefix-off", "prefix-blind", "prefix-aware")
TIERS_MODES = ("disagg-recompute", "disagg-tiers", "disagg-pull")   # --workload multiturn's default


def mode_workers(mode: str, settings: Settings, scratch: Path | None = None) -> Workers:
    """(role, extra worker options) of each process of ``mode``; ``SCRATCH`` in an option
    becomes ``scratch`` (a mode that names it needs one to start)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    workers = MODES[mode].workers(settings)
    if scratch is not None:
        workers = [(role, tuple(x.replace(SCRATCH, str(scratch)) for x in extra)) for role, extra in workers]
    if settings.late_last:   # the same TTFT order in every mode (engine/scheduler.py, mark_late)
        workers = [(role, (*extra, "--ttft-slo-ms", f"{settings.slo_ttft_ms:g}")) for role, extra in workers]
    return workers


class Running(Protocol):
    gateway_url: str | None   # the gateway's base URL, when one was asked for (``tenants``)

    def stop(self) -> None: ...

    def kill_worker(self, role: str | None) -> dict:
        """SIGKILL one running worker of ``role`` (None: decode, else colocated, else
        prefill); returns ``worker_id``, ``role``, ``pid`` and ``killed_at`` (unix s)."""

    def worker_back(self, worker_id: str, old_pid: int) -> float | None:
        """When (unix s) the supervisor saw ``worker_id`` serving again in a process other
        than ``old_pid``; None until then."""

    def restarts_of(self, worker_id: str) -> int: ...


class Launcher(Protocol):
    def __call__(self, workers: Workers, *, model: str, redis_url: str, cluster: str,
                 kv_cache_mb: int, log_dir: Path, tenants: str | None = None,
                 supervise: bool = False) -> Running:
        """Start the worker processes (one torch thread each) and return once all have
        registered; raise ``BenchError`` if one fails. ``tenants``: also a gateway
        (`pdqueue serve --tenants FILE`) on a free port, its URL in ``gateway_url``.
        ``supervise``: a worker that exits is started again (``pdqueue up``'s supervisor;
        ``--chaos`` kills one)."""

