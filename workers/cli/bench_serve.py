"""`pdqueue bench serve`: the serving benchmark's options, the worker processes of each mode
(``launch_workers``, the Launcher pdqueue.bench.serve_modes calls) and how the bench stops
them on Ctrl-C, SIGTERM or SIGHUP."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from workers.cli.bench_common import csv_values, progress, write_out
from workers.cli.common import UserError


def launch_workers(workers, *, model: str, redis_url: str, cluster: str, kv_cache_mb: int, log_dir: Path,
                   tenants: str | None = None, supervise: bool = False):
    """serve_modes' Launcher: the processes of one mode under a LocalCluster (one torch
    thread each), returned once all have registered; ``tenants``: and a gateway with that
    tenants file on a free port (``gateway_url``), the first process stopped; ``supervise``:
    with the LocalCluster's supervisor (``pdqueue up``'s restarts) from then on."""
    from pdqueue.bench.serve_modes import BenchError
    from workers.cli.local_cluster import LocalCluster, LocalClusterConfig, WorkerFailed

    # Options by side, as LocalCluster takes them: the prefill workers', and the decode and
    # colocated workers' (--weights apart: LocalCluster's own option).
    weights = {"prefill": "fp32", "decode": "fp32"}
    args: dict[str, set] = {"prefill": set(), "decode": set()}
    for role, extra in workers:
        side, extra = "prefill" if role == "prefill" else "decode", list(extra)
        if "--weights" in extra:
            at = extra.index("--weights")
            weights[side] = extra[at + 1]
            del extra[at:at + 2]
        args[side].add(tuple(extra))
    if any(len(a) > 1 for a in args.values()):
        raise ValueError("the workers of one side (prefill; decode and colocated) must share their options")
    roles = [role for role, _ in workers]
    cluster_ = LocalCluster(LocalClusterConfig(
        num_prefill=roles.count("prefill"), num_decode=roles.count("decode"), model=model, cluster=cluster,
        redis_url=redis_url, threads=1, kv_cache_mb=kv_cache_mb, log_dir=log_dir,
        prefill_args=next(iter(args["prefill"]), ()), decode_args=next(iter(args["decode"]), ()),
        prefill_weights=weights["prefill"], decode_weights=weights["decode"],
        gateway_port=0, gateway_tenants=tenants))
    stopper = _Stopper(cluster_)
    try:   # from the first spawn on, whatever ends this (a failed worker, SIGTERM: SystemExit) stops them
        cluster_.start_server()
        cluster_.start_workers()
        for i in range(roles.count("colocated")):   # LocalCluster starts prefill and decode roles only
            cluster_.spawn("colocated", f"colocated-{i}-{cluster_.run_id}")
        cluster_.wait_ready(timeout_s=600)
        if tenants is not None:
            stopper.gateway_url = cluster_.start_gateway()
        if supervise:
            cluster_.supervise()
    except (WorkerFailed, TimeoutError, RuntimeError) as exc:
        stopper.stop(grace_s=5)
        tail = getattr(exc, "log_tail", "")
        raise BenchError(f"{exc}\n{tail}".strip()) from None
    except BaseException:
        stopper.stop(grace_s=5)
        raise
    return stopper


class _Stopper:
    """Stops one mode's workers, in order: colocated ones, then LocalCluster.stop (prefill
    warm, then decode, SIGKILL past the grace). A SIGTERM or SIGHUP to the bench meanwhile
    makes it a cold stop (``_TERM.hurry``) instead of cutting it short."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.gateway_url: str | None = None

    def kill_worker(self, role: str | None) -> dict:
        """SIGKILL (its process group) one running worker of ``role``, or of the first role
        of decode, colocated, prefill that has one (``serve_chaos``)."""
        import signal
        import time

        from pdqueue.bench.serve_chaos import ROLES

        alive = [w for w in self.cluster.workers if w.alive]
        for want in ((role,) if role else ROLES):
            chosen = next((w for w in alive if w.role == want), None)
            if chosen is not None:
                break
        else:
            raise RuntimeError(f"no running {role or 'worker'} to kill")
        record = {"worker_id": chosen.worker_id, "role": chosen.role, "pid": chosen.proc.pid,
                  "killed_at": time.time()}
        chosen.signal(signal.SIGKILL)
        return record

    def worker_back(self, worker_id: str, old_pid: int) -> float | None:
        w = next((w for w in self.cluster.workers if w.worker_id == worker_id), None)
        if w is None or w.proc.pid == old_pid or not w.back:
            return None
        times = [e["time"] for e in self.cluster.events if e["worker_id"] == worker_id and " is back " in e["text"]]
        if times:
            return times[-1]
        import time

        return time.time()

    def rolling_restart(self, timeout_s: float) -> dict:
        """``--chaos rolling-restart``: the supervisor's rolling restart of every worker
        (``supervisor.rolling``: the command `pdqueue restart` sends, taken by this cluster's
        supervisor thread, which forks the replacements), followed to its end. Blocking (the
        chaos runs it in a thread). The bench runs no gateway in these modes: workers only."""
        import time

        from workers.cli.supervisor.rolling import FINAL, follow, send_restart

        c = self.cluster
        before = {w.worker_id: w.role for w in c.workers if w.alive}
        t0 = time.time()
        command_id, since = send_restart(c.redis, c.keys, by="bench serve --chaos rolling-restart")
        lines, status = [], None
        deadline = time.monotonic() + timeout_s
        while status is None and time.monotonic() < deadline:
            try:
                got, since = follow(c.redis, c.keys, command_id, since, block_ms=500)
            except Exception:   # noqa: BLE001 (a Redis restart meanwhile: read again)
                time.sleep(0.5)
                continue
            for event in got:
                lines.append(event.get("text", ""))
                if event.get("status") in FINAL:
                    status = event["status"]
        after = {w.worker_id: w.role for w in c.workers if w.alive}
        record = {"status": status or "timeout", "took_s": round(time.time() - t0, 3),
                  "gateway": "none (the bench's modes run no gateway: workers only)",
                  "replaced": [{"old": old, "role": role} for old, role in before.items() if old not in after],
                  "new_workers": [w for w in after if w not in before], "lines": lines}
        if status != "done":
            record["failure"] = lines[-1] if lines else f"no answer within {timeout_s:g} s"
        return record

    def stop_prefill_capable(self) -> list[dict]:
        """``--chaos zero-capacity``: every running prefill and colocated worker told to stop
        warm (SIGTERM) at once. They leave the supervisor's care first (moved to ``retired``,
        as a rolling restart's old processes are, within one of its rounds), so it does not
        start them again; the cluster's stop still waits for them."""
        import signal

        c = self.cluster
        with c.restarts.round:
            chosen = [w for w in c.workers if w.role in ("prefill", "colocated") and w.alive and not w.gave_up]
            for w in chosen:
                c.workers.remove(w)
                c.retired.append(w)
                w.restart_at, w.handled_pid = None, w.proc.pid
                w.signal(signal.SIGTERM)
        return [{"worker_id": w.worker_id, "role": w.role, "pid": w.proc.pid} for w in chosen]

    def start_again(self, stopped: list[dict]) -> list[str]:
        """As many workers as ``stopped``, in their roles, under new worker ids (a rolling
        restart's ``replacement_id``), supervised from then on; their ids. Called from a thread
        that outlives them (their PDEATHSIG: ``serve_chaos.Owner``)."""
        from workers.cli.supervisor.rolling import replacement_id

        c, new = self.cluster, []
        with c.restarts.round:
            for old in stopped:
                taken = {w.worker_id for w in c.workers + c.retired}
                new.append(c.spawn(old["role"], replacement_id(old["worker_id"], taken)).worker_id)
        return new

    def registered(self, worker_ids: list[str]) -> bool:
        """Whether any of ``worker_ids`` has registered (its heartbeat)."""
        try:
            return bool(self.cluster.registered() & set(worker_ids))
        except Exception:   # noqa: BLE001 (Redis away: not yet)
            return False

    def restarts_of(self, worker_id: str) -> int:
        return next((w.restarts for w in self.cluster.workers if w.worker_id == worker_id), 0)

    def stop(self, grace_s: float = 30) -> None:
        import signal
        import time

        _TERM.stopping += 1
        try:
            # (under --chaos a supervisor runs: no restart of what this stop ends first)
            self.cluster.restarts.halt()
            gateway = self.cluster.gateway
            if gateway is not None and gateway.alive:   # first: nothing is open on it any more
                gateway.signal(signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while gateway.alive and time.monotonic() < deadline and not _TERM.hurry.is_set():
                    time.sleep(0.05)
            colocated = [w for w in self.cluster.workers if w.role == "colocated" and w.alive]
            for w in colocated:
                w.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while any(w.alive for w in colocated) and time.monotonic() < deadline and not _TERM.hurry.is_set():
                time.sleep(0.05)
            self.cluster.stop(grace_s=grace_s, keep_logs=True, hurry=_TERM.hurry)
        finally:
            _TERM.stopping -= 1


class _Term:
    """What SIGTERM/SIGHUP did to the bench: ``hurry`` once a stop should go cold."""

    def __init__(self):
        import threading

        self.hurry = threading.Event()
        self.raised = False
        self.stopping = 0   # _Stopper.stop calls in progress


_TERM = _Term()


def _end_on_term() -> None:
    """SIGTERM and SIGHUP end the bench as Ctrl-C does: its ``finally`` blocks stop the
    workers (in order: ``_Stopper``) and the Redis server it started (they run in their own
    sessions, so a plain SIGTERM does not reach them; they also get PDEATHSIG, should the
    bench be killed outright). The first signal raises SystemExit, unless the workers are
    being stopped already; a later one (or one during a stop) does not interrupt that stop,
    it makes it cold.

    While the load runs (an asyncio loop), SystemExit is raised by a callback of that loop,
    not by the handler: a handler raises in whatever Python code the signal interrupted, and
    where that is a weakref callback or a ``__del__`` (the loop's tasks make garbage all the
    time) Python prints "Exception ignored" and drops it; the bench then ran its whole load
    (seen under CI's load: test_serve_stopped_with_sigterm_leaves_no_worker_behind)."""
    import asyncio
    import signal

    def exit_now(signum: int) -> None:
        raise SystemExit(128 + signum)

    def on_signal(signum, _frame):
        # (nothing printed here: a write to stderr that interrupts another one raises)
        if _TERM.raised or _TERM.stopping:
            _TERM.hurry.set()
            return
        _TERM.raised = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            exit_now(signum)
        loop.call_soon_threadsafe(exit_now, signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


def _write_partial(out: str, partial: dict) -> None:
    """The modes measured so far, in OUT/serve.partial.json (replaced after each mode)."""
    from pdqueue.bench.stats import round_floats

    path = Path(out) / "serve.partial.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(round_floats({k: v for k, v in partial.items() if k != "raw"}), indent=2, default=str))


@click.command("serve")
@click.option("--model", envvar="PDQ_MODEL", default="smollm2", show_default=True,
              help="smollm2, tiny, or a path.")
@click.option("--modes", default="disagg,colocated-prefill-first,colocated-chunked", show_default=True,
              help="Any of disagg, colocated-prefill-first, colocated-chunked, adaptive (1 prefill + 1 decode "
                   "worker that a planner switches between roles as the load changes), colocated-slo (chunked "
                   "under the TBT budget of --slo-tbt-ms), disagg-int8, disagg-int4, disagg-q4_1, "
                   "colocated-chunked-int4, colocated-chunked-q4_1, colocated-slo-int4, placement-int4, "
                   "placement-fp32, placement-q4_1 (1 prefill worker placing prompts by cost + 1 decode worker "
                   "taking them), "
                   "elastic, elastic-q4_1, elastic-fp32 (the same with a planner over roles, budgets and "
                   "migrations), elastic-colocated, disagg-q4_1-4slots, disagg-q4_1-4slots-here, -here-slo (a decode "
                   "worker of 4 slots; -here: the prefill worker decodes when it is full; -slo: under the TBT "
                   "budget), prefix-off, prefix-blind, "
                   "prefix-aware, disagg-recompute, disagg-tiers, disagg-pull, colocated-chunked-recompute, -tiers, "
                   "-pull (a conversation's last turn kept: only by the pools, --kv-pull never; with the KV tiers, a "
                   "host tier per worker, --kv-host-tier-mb, and a disk tier they share; or pulled, --kv-pull "
                   "always) "
                   "(pdqueue/bench/serve_modes.py says what each starts).")
@click.option("--plan-mode", type=click.Choice(["reactive", "predictive"]), default="reactive", show_default=True,
              help="The adaptive mode's planner.")
@click.option("--rates", default="0.5,1,2", show_default=True,
              help="Request arrival rates (req/s; sessions/s with --workload multiturn).")
@click.option("--duration", type=click.FloatRange(min=1), default=None,
              help="Seconds of arrivals per rate (instead of --num-requests).")
@click.option("--num-requests", type=click.IntRange(min=1), default=None,
              help="Requests per rate (sessions with --workload multiturn; default 24, or what --duration gives).")
@click.option("--long-fraction", type=click.FloatRange(0, 1), default=0.25, show_default=True,
              help="Share of long-document prompts in the mix.")
@click.option("--slo-ttft-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="TTFT SLO (default: per model).")
@click.option("--slo-tbt-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="SLO on each request's p90 time between tokens (default: per model).")
@click.option("--phases", default=None,
              help="A load that changes, instead of --rates: phases sent back to back, each a kind "
                   "(chat: 10% documents at 2 req/s; docs: 50% at 1 req/s) or name:long_fraction:rate:seconds; "
                   "e.g. chat,docs,chat.")
@click.option("--phase-s", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="Seconds of each phase given by kind.")
@click.option("--workload", type=click.Choice(["mixed", "prefix", "multiturn"]), default="mixed", show_default=True,
              help="mixed: short chat and long documents (--long-fraction); prefix: 8 shared system prompts of "
                   "400-600 tokens and multi-turn conversations that resend their history (default modes then: "
                   "prefix-off, prefix-blind, prefix-aware: 2 prefill + 1 decode workers with caching off, caching "
                   "with cache-blind routing, caching with cache-aware routing); multiturn: sessions of 3-6 turns "
                   "arriving at --rates sessions/s, each turn 32-256 new tokens after the whole history (the "
                   "earlier prompts and the answers as the workers gave them), sent when the last answer arrived "
                   "(and --think-s); figures for every turn and for turns 2 and later (default modes then: "
                   "disagg-recompute, disagg-tiers, disagg-pull: the last turn's KV kept by the pools only, with "
                   "the KV tiers, or pulled from the worker holding it).")
@click.option("--think-s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="--workload multiturn: seconds from an answer to its session's next turn.")
@click.option("--runs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Measure each mode this many times, the modes by turns (each time on fresh workers); the "
                   "figures pool the runs, and the report gives each run and the spread (min, median, max).")
@click.option("--kv-host-tier-mb", type=click.IntRange(min=1), default=256, show_default=True,
              help="The -tiers modes: each worker's host-memory KV tier (pdqueue worker --kv-host-tier-mb).")
@click.option("--kv-disk-gb", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="The -tiers modes: the bound of the disk tier the workers share (in a fresh temporary "
                   "directory per start of the mode, removed after).")
@click.option("--kv-cache-mb", type=click.IntRange(min=1), default=None,
              help="Each worker's KV pool [default: 256; 512 with --workload prefix].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Requests sent (and not counted) before each mode's first rate.")
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="colocated-chunked: token budget of one step (--max-batched-tokens).")
@click.option("--placed-chunk-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="placement and elastic modes: the decode worker's token budget of one step, placed prompt "
                   "chunks and decodes together (--max-batched-tokens; up --take-prompts uses 512); within it "
                   "the TBT budget sizes the chunks by --slo-tbt-ms.")
@click.option("--late-last/--no-late-last", default=True, show_default=True,
              help="Every worker gets --ttft-slo-ms (the bench's TTFT SLO): prompts that can no longer make it "
                   "wait behind those that still can. --no-late-last: arrival order (to compare with).")
@click.option("--batch-lines", type=click.IntRange(min=0), default=0, show_default=True,
              help="Batch-class requests queued at the start of each rate, beside the online load; the figures "
                   "say how many were answered during the online load and what share of the capacity it left "
                   "they used (pdqueue/bench/serve_batch.py).")
@click.option("--batch-max-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Output tokens of each --batch-lines request.")
@click.option("--chaos", default=None, metavar="EVENT[@S],...",
              help="With --batch-lines: faults at each rate, EVENT@SECONDS after its start (default: half way "
                   "through the online arrivals): kill-worker (SIGKILL a decode worker, else a colocated one, "
                   "else a prefill one; kill-worker:prefill picks the role; the bench's workers then run under "
                   "pdqueue up's supervisor, which starts it again) and restart-redis (stop the bench's Redis "
                   "server and start it on the same port; it then keeps an AOF, appendfsync everysec). E.g. "
                   "kill-worker,restart-redis. rolling-restart: every worker replaced one at a time by the "
                   "supervisor's rolling restart (pdqueue restart's); zero-capacity[:SECONDS]: every prefill and "
                   "colocated worker stopped warm, started again SECONDS (20) later; for these two the report adds "
                   "the TTFT of the requests that arrived meanwhile against the others. The report adds what each "
                   "did; the batch lines must still be answered exactly once (pdqueue/bench/serve_chaos.py).")
@click.option("--chaos-alternate", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="With --chaos: each rate runs N times without the faults and N times with them, by turns (without "
                   "first), on the same workers; the report shows each run and the medians side by side (0: one "
                   "run, with the faults).")
@click.option("--tenants", "tenants_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A tenants run: each mode's cluster gets a gateway (pdqueue serve --tenants FILE) in front, and "
                   "each tenant of --tenant-rates sends its own Poisson load through it with its first API key; "
                   "figures per tenant (sent, answered, 429s, TTFT/TBT, SLO attainment). Needs --duration.")
@click.option("--tenant-rates", default=None,
              help="With --tenants: TENANT=RATE,... (req/s each, for --duration seconds), e.g. chat=1,flood=10.")
@click.option("--openai-url", default=None,
              help="Send the load to this OpenAI-compatible server (e.g. http://127.0.0.1:8000, pdqueue's gateway "
                   "or another engine) instead of starting workers; --modes is then ignored.")
@click.option("--openai-model", default=None, help="Its model name (default: the first of GET /v1/models).")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer key for --openai-url.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--out", default=None, help="Directory for serve.json, the PNG plots and worker logs.")
def bench_serve(model, modes, plan_mode, rates, duration, num_requests, long_fraction, slo_ttft_ms, slo_tbt_ms,
                phases, phase_s, workload, think_s, runs, kv_host_tier_mb, kv_disk_gb, kv_cache_mb, seed, warmup,
                chunk_tokens, placed_chunk_tokens, late_last, batch_lines, batch_max_tokens,
                chaos, chaos_alternate, tenants_path, tenant_rates, openai_url, openai_model, api_key, as_json, out):
    """Poisson load from the Python client against 1 prefill + 1 decode worker and 2
    colocated workers (prefill-first and chunked), one thread each, on the same cores; or,
    with --openai-url, the same load against any OpenAI-compatible server.

    With --batch-lines, exits with status 1 (after the report) when a batch line was not
    answered exactly once."""
    from pdqueue.bench import plots, serve_bench
    from pdqueue.bench.serve_load import Settings, parse_phases
    from pdqueue.bench.serve_modes import MODES, PREFIX_MODES, TIERS_MODES, BenchError
    from pdqueue.bench.serve_report import batch_failures, format_table
    from pdqueue.bench.serve_runs import runs_lines
    from pdqueue.bench.serve_turns import turn_lines
    from pdqueue.bench.stats import round_floats

    _end_on_term()
    if workload in ("prefix", "multiturn") and \
            click.get_current_context().get_parameter_source("modes").name == "DEFAULT":
        modes = ",".join(PREFIX_MODES if workload == "prefix" else TIERS_MODES)
    mode_list = csv_values(modes, str, "--modes")
    unknown = [m for m in mode_list if m not in MODES]
    if unknown:
        raise UserError(f"unknown mode(s) {unknown}; expected some of {list(MODES)}")
    try:
        phase_list = parse_phases(phases, phase_s) if phases else ()
    except ValueError as exc:
        raise UserError(f"--phases: {exc}") from None
    chaos_events = _chaos_option(chaos, batch_lines, phases, tenants_path, openai_url)
    if chaos_alternate and not chaos_events:
        raise UserError("--chaos-alternate goes with --chaos (the runs alternate without and with its events)")
    rates_by_tenant = _tenant_options(tenants_path, tenant_rates, duration, num_requests, phases, batch_lines,
                                      openai_url)
    _alone_options(workload, runs, phases, chaos, batch_lines, tenants_path, openai_url)
    settings = Settings.for_model(
        model, modes=mode_list, phases=phase_list, plan_mode=plan_mode, rates=csv_values(rates, float, "--rates"),
        duration_s=duration,
        num_requests=num_requests, long_fraction=long_fraction, slo_ttft_ms=slo_ttft_ms,
        slo_tbt_ms=slo_tbt_ms, seed=seed, warmup=warmup, chunk_tokens=chunk_tokens,
        placed_chunk_tokens=placed_chunk_tokens, late_last=late_last, openai_url=openai_url,
        openai_model=openai_model, api_key=api_key, workload_kind=workload, batch_lines=batch_lines,
        batch_max_tokens=batch_max_tokens, chaos=chaos_events, chaos_alternate=chaos_alternate if chaos_events else 0,
        tenants_path=tenants_path, tenant_rates=rates_by_tenant, think_s=think_s, runs=runs,
        kv_host_tier_mb=kv_host_tier_mb, kv_disk_gb=kv_disk_gb,
        kv_cache_mb=kv_cache_mb or (512 if workload == "prefix" else 256))
    try:
        result = serve_bench.run(settings, launch_workers, progress=progress,
                                 log_dir=Path(out) / "logs" if out else None,
                                 on_mode=(lambda partial: _write_partial(out, partial)) if out else None)
    except BenchError as exc:
        raise UserError(str(exc)) from None
    result = round_floats(result)
    if result.get("kind") == "tenants":
        from pdqueue.bench.serve_tenants import format_tenants_table

        write_out(out, "serve", result, None)
        click.echo(json.dumps(result, indent=2) if as_json else format_tenants_table(result))
        return
    write_out(out, "serve", result, plots.plot_serve)
    click.echo(json.dumps(result, indent=2) if as_json
               else "\n".join([format_table(result), *turn_lines(result), *runs_lines(result)]))
    failed = batch_failures(result)
    if failed:   # the exactly-once check: loud, and the exit status
        click.secho(f"FAILED: batch lines not answered exactly once in {', '.join(failed)} "
                    f"(missing, duplicated, or not ending in one done on out:<id>; see the batch figures)",
                    fg="red", bold=True, err=True)
        sys.exit(1)


def _alone_options(workload, runs, phases, chaos, batch_lines, tenants_path, openai_url) -> None:
    """``--workload multiturn`` and ``--runs`` against what they do not combine with: the
    sessions are sent through pdqueue's client (they read each answer's token ids back) at
    rates; repeated runs pool the runs of one rate."""
    given = [name for name, value in (("--phases", phases), ("--chaos", chaos), ("--batch-lines", batch_lines),
                                      ("--tenants", tenants_path), ("--openai-url", openai_url)) if value]
    if workload == "multiturn" and given:
        raise UserError(f"--workload multiturn cannot be combined with {', '.join(given)}")
    if runs > 1 and given:
        raise UserError(f"--runs cannot be combined with {', '.join(given)}")


def _chaos_option(chaos, batch_lines, phases, tenants_path, openai_url) -> tuple:
    """``--chaos`` parsed (serve_chaos.parse_chaos) and checked against the other options."""
    from pdqueue.bench.serve_chaos import parse_chaos

    if chaos is None:
        return ()
    try:
        events = parse_chaos(chaos)
    except ValueError as exc:
        raise UserError(f"--chaos: {exc}") from None
    if not batch_lines:
        raise UserError("--chaos needs --batch-lines N (the check it makes: every batch line answered exactly once)")
    clashes = [name for name, given in (("--phases", phases), ("--tenants", tenants_path),
                                        ("--openai-url", openai_url)) if given]
    if clashes:
        raise UserError(f"--chaos cannot be combined with {', '.join(clashes)}")
    return events


def _tenant_options(tenants_path, tenant_rates, duration, num_requests, phases, batch_lines, openai_url):
    """``--tenants``/``--tenant-rates`` checked together: the (tenant, rate) pairs, () without."""
    from pdqueue.bench.serve_tenants import parse_tenant_rates, tenant_keys
    from pdqueue.frontends.tenants import TenantError

    if tenants_path is None and tenant_rates is None:
        return ()
    if tenants_path is None or tenant_rates is None:
        raise UserError("--tenants and --tenant-rates go together (the file, and each tenant's rate)")
    clashes = [name for name, given in (("--num-requests", num_requests), ("--phases", phases),
                                        ("--batch-lines", batch_lines), ("--openai-url", openai_url)) if given]
    if clashes:
        raise UserError(f"--tenants cannot be combined with {', '.join(clashes)} (each tenant sends its rate "
                        f"for --duration seconds through the bench's own gateway)")
    if duration is None:
        raise UserError("--tenants needs --duration (seconds of arrivals; each tenant sends rate x duration requests)")
    try:
        rates = parse_tenant_rates(tenant_rates)
        tenant_keys(tenants_path, rates)
    except TenantError as exc:
        raise UserError(str(exc)) from None
    except ValueError as exc:
        raise UserError(f"--tenant-rates: {exc}") from None
    return rates
