"""`pdqueue bench serve`: serving under Poisson load, disaggregated against colocated.

For each mode (``serve_modes.MODES``) it starts fresh worker processes on this machine's
cores (through a ``Launcher`` that the CLI provides, so that pdqueue never imports workers),
all against one Redis server started here, e.g. ``disagg`` (1 prefill + 1 decode worker),
``colocated-prefill-first`` and ``colocated-chunked`` (2 colocated workers each).
Every worker runs torch with one thread. A load generator on ``AsyncClient`` then sends, per
rate, the same seeded request list (Poisson arrivals; a mix of short chat prompts and long
documents, seeded prompt and output lengths, random token ids, greedy, ``ignore_eos``) and
records each token's arrival time on the client. After warm-up requests (not counted):
- TTFT: submit -> first token seen by the client; TBT: every gap between consecutive tokens
  seen by the client (``tbt_server_ms``: the same from the ``out:`` entry ids, i.e. when the
  worker's XADD ran, in whole ms); e2e: submit -> done;
- the handoff gap ``gap01_ms``: token 0 -> token 1 on the client (in disagg mode token 0
  comes from the prefill worker and token 1 from the decode worker, so this is the decode
  side taking the request over), ``ttst_ms``: submit -> second token, and
  ``tbt_after_first_ms``: the gaps after token 1 (the steady decode step, for comparison);
- throughput: output tokens / (first submit -> last completion);
- goodput: arrival rate x the fraction of requests with TTFT <= the TTFT SLO and the p90
  of their own gaps <= the TBT SLO (DistServe's attainment); unfinished requests fail both;
- queue overhead: client TTFT - the worker's prefill time (``Completion.prefill_ms``: from
  taking the request to its first token), i.e. the time spent in Redis and in queues. Under
  load it includes waiting for a busy worker; ``idle_overhead_ms`` measures it alone, with
  ``probes`` one-token requests sent one at a time to idle workers before the first rate.
With ``--workload multiturn`` the load is sessions instead (``serve_turns``: each turn sent
when the last answer arrived, its prompt the whole history), and the figures are per turn,
over every turn and over turns 2 and later. With ``--runs N`` every mode is measured N times,
the modes by turns, each time on fresh workers (``serve_runs``: the runs pooled, and their
spread).
The parts: ``serve_load`` (settings, workload, request lists), ``serve_modes`` (the mode
table), ``serve_client`` (sending and recording), ``serve_report`` (figures, claims, table),
``serve_turns`` (the multi-turn sessions), ``serve_runs`` (repeated runs),
``serve_batch`` and ``serve_chaos`` (``--batch-lines``; ``--chaos`` and its runs without and
with the faults by turns, ``--chaos-alternate``: ``_run_rate`` is one run of a rate); this
module runs them. Imports redis (asyncio), rich, pdqueue's client; never torch.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from pdqueue.bench.serve_batch import BatchBeside
from pdqueue.bench.serve_chaos import chaos_schedule
from pdqueue.bench.serve_client import OpenAIClient, Record, run_requests, send_one
from pdqueue.bench.serve_load import (
    Planned,
    Settings,
    plan_phases,
    plan_prefix_requests,
    plan_requests,
    plan_sessions,
    warmup_requests,
)
from pdqueue.bench.serve_modes import MODES, BenchError, Launcher, mode_workers
from pdqueue.bench.serve_report import (
    alternated,
    chaos_event_line,
    claim,
    metrics,
    phase_claim,
    phase_metrics,
    pool_rates,
    rate_key,
    window_figures,
    window_split,
    workload_dict,
)
from pdqueue.bench.serve_runs import combined
from pdqueue.bench.serve_turns import run_sessions, turn_metrics
from pdqueue.bench.stats import summary
from pdqueue.queue.connection import raise_dropped_cancellation
from pdqueue.queue.streams import request_streams


def run(settings: Settings, launcher: Launcher, progress: Callable[[str], None] = print,
        log_dir: Path | None = None, on_mode: Callable[[dict], None] | None = None) -> dict:
    """Every mode at every rate; returns the result object (see ``--json``). ``on_mode``
    gets the result so far after each mode (a later mode that fails loses nothing)."""
    if settings.openai_url:
        return _run_openai(settings, progress, on_mode)
    if settings.tenants_path:
        return _run_tenants(settings, launcher, progress, log_dir, on_mode)
    import redis

    from pdqueue.bench.serve_chaos import DURABLE_REDIS_ARGS, Chaos, Owner, chaos_text
    from pdqueue.queue.redis_server import RedisServer

    if settings.chaos and (not settings.batch_lines or settings.phases):
        raise BenchError("chaos needs batch lines (what it checks) and rates, not phases")
    try:   # --chaos restarts it: durable then (AOF, fsync every second; serve_chaos.py)
        server = RedisServer(appendonly=True, extra_args=DURABLE_REDIS_ARGS) if settings.chaos else RedisServer()
        server.start()
    except (FileNotFoundError, RuntimeError) as exc:
        raise BenchError(f"cannot start a Redis server: {exc}") from None
    owner = Owner() if settings.chaos else None   # the thread that starts the server again (its PDEATHSIG)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdq-bench-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {"bench": "serve", "model": settings.model, "rates": list(settings.rates),
              "slo": {"ttft_ms": settings.slo_ttft_ms, "tbt_ms": settings.slo_tbt_ms},
              "workload": workload_dict(settings), "log_dir": str(log_dir), "modes": {}, "raw": {}}
    if settings.chaos:
        result["chaos"] = {"events": chaos_text(settings.chaos),
                           "redis": "appendonly yes, " + " ".join(DURABLE_REDIS_ARGS).lstrip("-"),
                           "supervised": True}
    runs: dict[str, list] = {mode: [] for mode in settings.modes}   # with --runs: each mode's runs so far
    figures_of = turn_metrics if settings.workload_kind == "multiturn" else metrics
    try:
        for run_index, index, mode in ((n, i, m) for n in range(settings.runs) for i, m in enumerate(settings.modes)):
            with redis.Redis.from_url(server.url) as r:
                r.flushall()
            label = mode if settings.runs == 1 else f"{mode} (run {run_index + 1} of {settings.runs})"
            cluster = f"bench{index}" if run_index == 0 else f"bench{index}r{run_index + 1}"
            progress(f"{label}: starting {len(mode_workers(mode, settings))} workers ({settings.model})"
                     + (" under a supervisor (--chaos)" if settings.chaos else ""))
            with _scratch() as scratch:
                running = launcher(mode_workers(mode, settings, scratch), model=settings.model, redis_url=server.url,
                                   cluster=cluster, kv_cache_mb=settings.kv_cache_mb,
                                   log_dir=log_dir / mode / (f"run{run_index + 1}" if settings.runs > 1 else ""),
                                   **({"supervise": True} if settings.chaos else {}))
                chaos = Chaos(settings.chaos, server, running, owner) if settings.chaos else None
                try:
                    by_rate, raw = asyncio.run(_run_mode(settings, mode, server.url, cluster, progress, chaos))
                finally:
                    progress(f"{label}: stopping workers")
                    running.stop()
            if settings.runs > 1:   # every run so far pooled (the runs' own figures kept for the next time)
                runs[mode].append((by_rate, raw))
                by_rate, raw = combined(runs[mode], settings, figures_of)
            result["modes"][mode] = pool_rates(by_rate, raw, settings)
            result["raw"][mode] = raw
            if on_mode is not None:
                on_mode(result)
    finally:
        server.stop()
        if owner is not None:
            owner.close()
    if settings.phases:
        result["rates"] = []
        result["phases"] = [{"name": p.name, "long_fraction": p.long_fraction, "rate": p.rate,
                             "duration_s": p.duration_s} for p in settings.phases]
        result["claim"] = phase_claim(result)
    else:
        result["claim"] = claim(result)
    return result


@contextmanager
def _scratch():
    """A fresh directory for one start of a mode (``serve_modes.SCRATCH``), removed after."""
    path = Path(tempfile.mkdtemp(prefix="pdq-bench-scratch-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run_tenants(settings: Settings, launcher: Launcher, progress, log_dir: Path | None, on_mode) -> dict:
    """Each mode's workers with a gateway (``--tenants FILE``) in front; each tenant's own
    Poisson load through it with its key (serve_tenants.py); figures per tenant."""
    import redis

    from pdqueue.bench.serve_tenants import tenant_figures, tenant_keys
    from pdqueue.queue.redis_server import RedisServer

    try:
        keys = tenant_keys(settings.tenants_path, settings.tenant_rates)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    try:
        server = RedisServer().start()
    except (FileNotFoundError, RuntimeError) as exc:
        raise BenchError(f"cannot start a Redis server: {exc}") from None
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdq-bench-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {"bench": "serve", "kind": "tenants", "model": settings.model, "tenants_file": settings.tenants_path,
              "tenant_rates": dict(settings.tenant_rates), "duration_s": settings.duration_s,
              "slo": {"ttft_ms": settings.slo_ttft_ms, "tbt_ms": settings.slo_tbt_ms},
              "workload": workload_dict(settings), "log_dir": str(log_dir), "modes": {}}
    try:
        for index, mode in enumerate(settings.modes):
            with redis.Redis.from_url(server.url) as r:
                r.flushall()
            progress(f"{mode}: starting {len(mode_workers(mode, settings))} workers ({settings.model}) "
                     f"and a gateway with {settings.tenants_path}")
            with _scratch() as scratch:
                running = launcher(mode_workers(mode, settings, scratch), model=settings.model, redis_url=server.url,
                                   cluster=f"bench{index}", kv_cache_mb=settings.kv_cache_mb, log_dir=log_dir / mode,
                                   tenants=settings.tenants_path)
                try:
                    records = asyncio.run(_measure_tenants(settings, mode, server.url, f"bench{index}",
                                                           running.gateway_url, keys, progress))
                finally:
                    progress(f"{mode}: stopping the gateway and the workers")
                    running.stop()
            result["modes"][mode] = {"gateway": running.gateway_url, "tenants": tenant_figures(records, settings)}
            if on_mode is not None:
                on_mode(result)
    finally:
        server.stop()
    return result


async def _measure_tenants(settings: Settings, mode: str, url: str, cluster: str, gateway_url: str,
                           keys: dict[str, str], progress) -> list:
    from pdqueue.bench.serve_tenants import plan_tenant_requests
    from pdqueue.client import AsyncClient

    beside = MODES[mode].beside
    stop = beside(settings, url, cluster) if beside is not None else None
    try:
        if settings.warmup:   # straight to the cluster: the warm-up is no tenant's, and spends no bucket
            progress(f"{mode}: {settings.warmup} warm-up requests")
            async with AsyncClient(url, cluster) as direct:
                await run_requests(direct, warmup_requests(settings), settings.drain_timeout_s)
        plan = plan_tenant_requests(settings)
        first = next(iter(keys.values()))
        async with OpenAIClient(gateway_url, None, first, tenant_keys=keys) as client:
            progress(f"{mode}: {len(plan)} requests over {settings.duration_s:g} s through {gateway_url}, "
                     + ", ".join(f"{name} at {rate:g} req/s" for name, rate in settings.tenant_rates))
            return await run_requests(client, plan, settings.drain_timeout_s, log=progress)
    finally:
        if stop is not None:
            stop()


def _run_openai(settings: Settings, progress, on_mode) -> dict:
    """The same load against an OpenAI-compatible server that is already running: one mode,
    ``openai``, its figures from the client side only."""
    result = {"bench": "serve", "model": settings.model, "rates": list(settings.rates), "target": settings.openai_url,
              "slo": {"ttft_ms": settings.slo_ttft_ms, "tbt_ms": settings.slo_tbt_ms},
              "workload": workload_dict(settings), "modes": {}, "raw": {}}
    by_rate, raw = asyncio.run(_run_mode(settings, "openai", "", "", progress))
    result["modes"]["openai"] = pool_rates(by_rate, raw, settings)
    result["raw"]["openai"] = raw
    if on_mode is not None:
        on_mode(result)
    if settings.phases:
        result["rates"] = []
        result["phases"] = [{"name": p.name, "long_fraction": p.long_fraction, "rate": p.rate,
                             "duration_s": p.duration_s} for p in settings.phases]
    result["claim"] = {}
    return result


async def _run_mode(settings: Settings, mode: str, url: str, cluster: str, progress,
                    chaos=None) -> tuple[dict, dict]:
    by_rate, raw = {}, {}
    beside = MODES[mode].beside if mode in MODES else None
    stop = beside(settings, url, cluster) if beside is not None else None
    try:
        return await _measure_mode(settings, mode, url, cluster, progress, by_rate, raw, chaos)
    finally:
        if stop is not None:
            stop()



# The heartbeat load fields a timeline keeps per worker (the levers of the elastic cluster).
TIMELINE_LOAD = ("running", "waiting", "tbt_budget_ms", "spare", "prompt_tok_s", "prompt_backlog", "placed_out",
                 "migrated_out")


async def _measure_mode(settings: Settings, mode: str, url: str, cluster: str, progress, by_rate: dict,
                        raw: dict, chaos=None) -> tuple[dict, dict]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pdqueue.client import AsyncClient

    target = OpenAIClient(settings.openai_url, settings.openai_model, settings.api_key) if mode == "openai" \
        else AsyncClient(url, cluster)
    async with target as client:
        if settings.warmup:
            progress(f"{mode}: {settings.warmup} warm-up requests")
            await run_requests(client, warmup_requests(settings), settings.drain_timeout_s)
        idle = []
        for i in range(settings.probes):
            planned = Planned(0.0, "probe", tuple(3 + (i + j) % 200 for j in range(24)), 1)
            record = await send_one(client, planned, i, Record(planned), settings.drain_timeout_s)
            if record.finished is not None and record.token_times and not math.isnan(record.completion.prefill_ms):
                idle.append((record.token_times[0] - record.submitted) * 1e3 - record.completion.prefill_ms)
        by_rate["idle_overhead_ms"] = summary(idle)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True)) as bar:
            if settings.phases:
                plan = plan_phases(settings)
                task = bar.add_task(f"{mode}: {'/'.join(p.name for p in settings.phases)}", total=len(plan))
                records, timeline = await _run_sampled(client, plan, settings, url, cluster,
                                                       lambda: bar.advance(task), progress)
                by_rate["phases"], raw["phases"] = phase_metrics(records, settings), {"timeline": timeline}
                by_rate["phases"]["records"] = records
                return by_rate, raw
            for rate in settings.rates:
                if settings.workload_kind == "multiturn":
                    by_rate[rate_key(rate)], raw[rate_key(rate)] = await _run_sessions(client, rate, settings, url,
                                                                                       cluster, mode, bar, progress)
                    continue
                planner = plan_prefix_requests if settings.workload_kind == "prefix" else plan_requests
                plan = planner(settings, rate, settings.requests_at(rate))
                runs = []
                for with_chaos in chaos_schedule(chaos is not None, settings.chaos_alternate):
                    label = f"{mode} @ {rate:g} req/s" + (f" run {len(runs) + 1}, {'with' if with_chaos else 'without'}"
                                                          f" the chaos" if settings.chaos_alternate else "")
                    task = bar.add_task(label, total=len(plan))
                    runs.append(await _run_rate(client, plan, rate, settings, url, cluster, label, mode, progress,
                                                lambda t=task: bar.advance(t), chaos if with_chaos else None))
                if len(runs) == 1:
                    by_rate[rate_key(rate)], raw[rate_key(rate)] = runs[0]
                else:
                    by_rate[rate_key(rate)], raw[rate_key(rate)] = alternated(runs, rate, settings)
    return by_rate, raw



async def _run_rate(client, plan, rate: float, settings: Settings, url: str, cluster: str, label: str, mode: str,
                    progress, on_done, chaos=None) -> tuple[dict, dict]:
    """One run of ``plan`` at ``rate`` (with its batch lines and, given ``chaos``, its events):
    (figures, raw values)."""
    batch = None
    if settings.batch_lines and mode != "openai":
        batch = BatchBeside(url, cluster, settings, rate)
        await batch.start(client)
        progress(f"{label}: {settings.batch_lines} batch-class requests queued")
    started, started_perf = time.time(), time.perf_counter()
    faults = None
    if chaos is not None:   # half way through the arrivals, unless an event says when
        faults = asyncio.create_task(chaos.run(started, plan[-1].at_s / 2))
    records, timeline = await _run_sampled(client, plan, settings, url, cluster, on_done, progress)
    figures, raw = metrics(records, rate, settings)
    raw["timeline"] = timeline
    figures["records"] = records
    if batch is not None:
        ended = max([r.finished for r in records if r.finished is not None] or [time.perf_counter()])
        # Record times are perf_counter; the batch's are unix: the window's end in unix time.
        window_end = time.time() - (time.perf_counter() - ended)
        online_tok_s = sum(len(r.token_times) for r in records) / max(1e-3, window_end - started)
        if faults is not None:   # (an event due after the online load still happens)
            events = await faults
        figures["batch"] = b = await batch.finish(started, window_end, online_tok_s, settings.drain_timeout_s * 3)
        if faults is not None:
            await chaos.settle([e for e in events if "worker_id" in e], 60.0)
            figures["chaos"] = events
            if any(e.get("until_s") is not None for e in events):   # a roll, an outage: its window
                inside, rest, unanswered = window_split(records, started_perf, events)
                raw["window_ttft"] = (inside, rest)
                figures.update(window_figures(inside, rest, unanswered, [[e["at_s"], e["until_s"]] for e in events
                                                                         if e.get("until_s") is not None]))
            progress(f"{label}: chaos " + "; ".join(map(chaos_event_line, events)))
        once = "every line answered once" if b["exactly_once"] else "NOT every line answered once"
        progress(f"{label}: batch {b['answered']}/{b['lines']} answered, {b['duplicates']} duplicates, "
                 f"{b['missing']} missing, {b['out_not_once']} out:<id> not ending in one done, {b['short']} short: "
                 f"{once}")
    return figures, raw


async def _run_sessions(client, rate: float, settings: Settings, url: str, cluster: str, mode: str, bar,
                        progress) -> tuple[dict, dict]:
    """One run of the multi-turn sessions at ``rate`` (sessions/s): (figures, raw values)."""
    sessions = plan_sessions(settings, rate, settings.requests_at(rate))
    turns = sum(s.turns for s in sessions)
    task = bar.add_task(f"{mode} @ {rate:g} sessions/s ({len(sessions)} sessions, {turns} turns)", total=turns)
    sending = run_sessions(client, sessions, settings, on_done=lambda: bar.advance(task))
    records, timeline = await _run_sampled(client, None, settings, url, cluster, None, progress, sending)
    figures, raw = turn_metrics(records, rate, settings)
    raw["timeline"] = timeline
    figures["records"] = records
    return figures, raw


async def _run_sampled(client, plan, settings: Settings, url: str, cluster: str, on_done, progress,
                       sending=None):
    """Send ``plan`` (or await ``sending``, a coroutine that sends and returns the records)
    and wait for its answers while the timeline is sampled (none without a Redis URL: the
    openai mode); returns (records, timeline)."""
    timeline: list[dict] = []
    sampler = asyncio.create_task(_sample_timeline(url, cluster, timeline) if url else asyncio.sleep(0))
    try:
        records = await (sending if sending is not None else
                         run_requests(client, plan, settings.drain_timeout_s, on_done=on_done, log=progress))
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return records, timeline


async def _sample_timeline(url: str, cluster: str, timeline: list[dict], every_s: float = 0.5) -> None:
    """Every ``every_s``: each worker's role and what its heartbeat says of the levers
    (running, TBT budget, spare share, prompts placed out, prompt backlog, decodes migrated
    out), the request and handoff backlogs (acked entries are deleted, so a stream's length
    is what is still to be done), and the planner's decision (``plan``) whenever its reason
    changed. ``pdqueue bench serve --plot`` draws it (plots.plot_timelines)."""
    import json

    import redis.asyncio

    from pdqueue.keys import Keys

    keys = Keys(cluster)
    start = time.perf_counter()
    r = redis.asyncio.Redis.from_url(url, decode_responses=True)
    last_reason = None
    try:
        while True:
            try:
                worker_keys = [k async for k in r.scan_iter(match=keys.worker("*"), count=200)]
                roles, workers = {}, {}
                for k in worker_keys:
                    role, load = await r.hmget(k, "role", "load")
                    if not role:
                        continue
                    wid = k.rsplit(":", 1)[-1]
                    roles[wid] = role
                    try:
                        load = json.loads(load or "{}")
                    except ValueError:
                        load = {}
                    workers[wid] = {"role": role, **{f: load[f] for f in TIMELINE_LOAD if f in load}}
                requests = sum([await r.xlen(s) for s in request_streams(keys)])
                handoff_keys = [k async for k in r.scan_iter(match=keys.handoff + "*", count=200)]
                handoffs = sum([await r.xlen(k) for k in handoff_keys])
                sample = {"t": round(time.perf_counter() - start, 2), "roles": roles, "workers": workers,
                          "request_backlog": requests, "handoff_backlog": handoffs}
                plan = await r.hmget(keys.plan, "action", "reason")
                gist = plan[1] and plan[1].split(":")[0]   # e.g. "hold 1P+1D, healthy" (no figures)
                if gist and gist != last_reason:   # the adaptive mode's planner said something new
                    last_reason = gist
                    sample["plan"] = {"action": plan[0], "reason": plan[1]}
                timeline.append(sample)
            except redis.RedisError:
                pass
            # A cancellation redis.asyncio dropped (queue/connection.py) would keep this loop
            # sampling for ever, and the bench's exit waits for it (seen: a SIGTERM under load).
            raise_dropped_cancellation()
            await asyncio.sleep(every_s)
    finally:
        await r.aclose()

