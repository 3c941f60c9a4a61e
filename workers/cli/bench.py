"""`pdqueue bench engine|transfer|serve|gateway`: parse options, call pdqueue.bench, print a table
(or one JSON object with --json), write JSON and plots under --out."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from workers.cli.common import (Group, UserError, check_device, check_engine_config, check_kv_pool, check_model,
                                engine_options, load, model_errors, model_option)


def _progress(message: str) -> None:
    click.secho(message, fg="cyan", err=True)


def _write_out(out: str | None, name: str, result: dict, plot) -> None:
    """``<out>/<name>.json`` and the plots; a note on stderr when matplotlib is missing."""
    if not out:
        return
    from pdqueue.bench import plots

    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if plot is None:
        _progress(f"wrote {directory / name}.json")
        return
    if not plots.available():
        _progress(f"wrote {directory / name}.json; matplotlib is not installed, so no plots "
                  "(pip install 'pdqueue[bench]')")
        return
    written = plot(result, directory)
    _progress(f"wrote {directory / name}.json and " + ", ".join(str(p) for p in written))


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

    def restarts_of(self, worker_id: str) -> int:
        return next((w.restarts for w in self.cluster.workers if w.worker_id == worker_id), 0)

    def stop(self, grace_s: float = 30) -> None:
        import signal
        import time

        _TERM.stopping += 1
        try:
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


def _csv(text: str, cast, option: str) -> list:

    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} takes a comma-separated list, got {text!r}") from None
    if not values:
        raise UserError(f"{option} is empty")
    return values


@click.group(cls=Group)
def bench():
    """Benchmarks: they compare against baselines measured in the same run."""


@bench.command("engine")
@model_option
@engine_options
@click.option("--prompt-lens", default="128,512,2048", show_default=True)
@click.option("--batch-sizes", default="1,8,32", show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="With quantized --weights: prefill runs per format (best shown) and 8 x ROUNDS decode steps "
                   "(median), alternating with float32.")
@click.option("--formats", default=None,
              help="Weights formats to measure alternately, the first the baseline (e.g. fp32,int4,q4_1); "
                   "instead of --weights.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_engine(model, device, dtype, threads, kv_cache_mb, prefix_caching, weights, prompt_lens, batch_sizes,
                 rounds, formats, as_json):
    """Prefill tokens/s and decode ms/step beside the memory-bandwidth bound; with quantized
    --weights (int8, int4, q4_1), beside float32 weights in the same run (decode_b1_vs_fp32)."""
    check_model(model)
    lens, sizes = positive_ints("--prompt-lens", prompt_lens), positive_ints("--batch-sizes", batch_sizes)
    config = check_engine_config(model=model, device=device, dtype=dtype, num_threads=threads,
                                 kv_cache_mb=kv_cache_mb, prefix_caching=prefix_caching, weights=weights)
    check_device(device)
    check_kv_pool(model, config)
    from pdqueue.bench import engine_bench

    progress = lambda m: click.secho(m, fg="cyan", err=True)  # noqa: E731
    names = _csv(formats, str, "--formats") if formats else ["fp32", weights] if weights != "fp32" else []
    if names:
        from pdqueue.engine.config import WEIGHT_FORMATS

        unknown = [f for f in names if f not in WEIGHT_FORMATS]
        if unknown or len(set(names)) != len(names) or len(names) < 2:
            raise UserError(f"--formats: two or more of {list(WEIGHT_FORMATS)}, each once; got {formats!r}")
        started = {}
        models = {}
        for name in names:
            t = time.monotonic()
            models[name] = load(model, device, dtype, name)
            started[name] = time.monotonic() - t
        result = engine_bench.run_compare(models, config, lens, sizes, rounds, progress=progress)
        for name in names:
            result["results"][name]["load_s"] = started[name]
        if "q4_1" in names:
            from pdqueue.models import q4

            result["q4_1_kernel"] = dict(q4.KERNEL_INFO)
        if weights != "fp32" and weights in names and names[0] == "fp32":
            result[f"decode_b{sizes[0]}_vs_fp32"] = result["results"][weights]["ratios"][f"decode_b{sizes[0]}_vs_fp32"]
        click.echo(json.dumps(result, indent=2) if as_json else _compare_table(result))
        return
    loaded = load(model, device, dtype)
    result = engine_bench.run(loaded, config, lens, sizes, progress=progress)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"model {result['model']}  {result['device']} {result['dtype']}  threads {result['threads']}")
    click.echo(f"weights {result['weight_bytes'] / 2**20:.0f} MiB; copy {result['copy_gb_s']:.2f} GB/s, "
               f"read {result['read_gb_s']:.2f} GB/s")
    click.echo(f"bandwidth bound per decode step: {result['bound_ms_copy']:.1f} ms (copy), "
               f"{result['bound_ms_read']:.1f} ms (read)")
    for n, v in result["prefill_tok_s"].items():
        click.echo(f"prefill {n:>5} tokens: {v:8.0f} tok/s")
    for b, v in result["decode_ms"].items():
        click.echo(f"decode batch {b:>3}: {v:8.1f} ms/step  ({b / v * 1e3:.0f} tok/s)")
    for k, v in result["ratios"].items():
        click.echo(f"{k}: {v:.2f}x")


@bench.command("quality")
@model_option
@click.option("--formats", default="fp32,int8,int4,q4_1", show_default=True,
              help="Weights formats to compare with float32 (pdqueue.models.quant).")
@click.option("--window", type=click.IntRange(min=2), default=512, show_default=True,
              help="Perplexity: tokens per disjoint window.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Greedy agreement: tokens per prompt.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch threads [default: torch's choice].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_quality(model, formats, window, max_tokens, threads, as_json):
    """Perplexity of a fixed public-domain text and greedy agreement with float32, per
    weights format."""
    from pdqueue.engine.config import WEIGHT_FORMATS

    check_model(model)
    names = _csv(formats, str, "--formats")
    unknown = [f for f in names if f not in WEIGHT_FORMATS]
    if unknown:
        raise UserError(f"--formats: unknown {unknown}; expected some of {list(WEIGHT_FORMATS)}")
    import torch

    from pdqueue.bench import quality

    if threads:
        torch.set_num_threads(threads)
    with model_errors():
        result = quality.run(model, names, window, max_tokens, progress=_progress)
    click.echo(json.dumps(result, indent=2) if as_json else quality.format_table(result))


def _compare_table(result: dict) -> str:
    names, res = result["weights"], result["results"]
    first = res[names[0]]
    lines = [f"model {result['model']}  threads {result['threads']}  formats measured alternately",
             f"{'':<24}" + "".join(f"{n:>12}" for n in names)]

    def row(label, values, fmt):
        lines.append(f"{label:<24}" + "".join(f"{v:>12{fmt}}" for v in values))

    row("weights MiB / step", [res[n]["weight_bytes"] / 2**20 for n in names], ".0f")
    if all("load_s" in res[n] for n in names):
        row("model load s", [res[n]["load_s"] for n in names], ".1f")
    for b in first["decode_ms"]:
        row(f"decode b{b} ms/step", [res[n]["decode_ms"][b] for n in names], ".1f")
    for n_tok in first["prefill_tok_s"]:
        row(f"prefill {n_tok} tok/s", [res[n]["prefill_tok_s"][n_tok] for n in names], ".0f")
    keys = [k for k in res[names[-1]]["ratios"]]
    for k in keys:
        row(k, [res[n]["ratios"].get(k, float("nan")) for n in names], ".2f")
    if "q4_1_kernel" in result:
        info = result["q4_1_kernel"]
        lines.append(f"q4_1 kernel: {info.get('isa')}, {'built' if info.get('built') else 'loaded from the cache'} "
                     f"in {info.get('seconds', 0):.2f} s")
    return "\n".join(lines)


def positive_ints(option: str, text: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers, got {text!r}") from None
    if not all(v >= 1 for v in values):
        raise UserError(f"{option}: every value must be >= 1, got {text!r}")
    return values


@bench.command("transfer")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--quick", is_flag=True, help="Two small SmolLM2 sizes, few repeats (a smoke run).")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="Timed runs per path and size.")
@click.option("--out", default=None, help="Directory for transfer.json and transfer.png.")
@click.option("--check", is_flag=True, help="Exit with status 3 when a ratio misses its target.")
def bench_transfer(as_json, quick, repeats, out, check):
    """Move real KV caches prefill -> decode process through shm, the TCP data wire and
    zmq (and NIXL where pdqueue[rdma] is installed, with the UCX transports it used),
    beside memcpy, a raw TCP socket, gRPC and pickle-through-Redis measured in the same run.

    Exit status: 0 when the benchmark ran (targets are reported, "met" or "NOT met", but
    not enforced: these machines are shared and noisy); with --check, 3 when any ratio
    missed its target."""
    from pdqueue.bench import plots, transfer_bench
    from pdqueue.bench.stats import round_floats

    result = round_floats(transfer_bench.run(quick=quick, repeats=repeats, progress=_progress))
    _write_out(out, "transfer", result, plots.plot_transfer)
    click.echo(json.dumps(result, indent=2) if as_json else transfer_bench.format_table(result))
    missed = transfer_bench.missed_targets(result)
    if check and missed:
        click.secho(f"targets not met: {', '.join(missed)}", fg="red", err=True)
        sys.exit(3)

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
    it makes it cold."""
    import signal

    def on_signal(signum, _frame):
        # (nothing printed here: a write to stderr that interrupts another one raises)
        if _TERM.raised or _TERM.stopping:
            _TERM.hurry.set()
            return
        _TERM.raised = True
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


def _write_partial(out: str, partial: dict) -> None:
    """The modes measured so far, in OUT/serve.partial.json (replaced after each mode)."""
    from pdqueue.bench.stats import round_floats

    path = Path(out) / "serve.partial.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(round_floats({k: v for k, v in partial.items() if k != "raw"}), indent=2, default=str))


@bench.command("serve")
@click.option("--model", envvar="PDQ_MODEL", default="smollm2", show_default=True,
              help="smollm2, tiny, or a path.")
@click.option("--modes", default="disagg,colocated-prefill-first,colocated-chunked", show_default=True,
              help="Any of disagg, colocated-prefill-first, colocated-chunked, adaptive (1 prefill + 1 decode "
                   "worker that a planner switches between roles as the load changes), colocated-slo (chunked "
                   "under the TBT budget of --slo-tbt-ms), disagg-int8, disagg-int4, disagg-q4_1, "
                   "colocated-chunked-int4, colocated-chunked-q4_1, colocated-slo-int4, placement-int4, "
                   "placement-q4_1 (1 prefill worker placing prompts by cost + 1 decode worker taking them), "
                   "elastic, elastic-q4_1, elastic-fp32 (the same with a planner over roles, budgets and "
                   "migrations), elastic-colocated, prefix-off, prefix-blind, prefix-aware "
                   "(pdqueue/bench/serve_modes.py says what each starts).")
@click.option("--plan-mode", type=click.Choice(["reactive", "predictive"]), default="reactive", show_default=True,
              help="The adaptive mode's planner.")
@click.option("--rates", default="0.5,1,2", show_default=True, help="Request arrival rates (req/s).")
@click.option("--duration", type=click.FloatRange(min=1), default=None,
              help="Seconds of arrivals per rate (instead of --num-requests).")
@click.option("--num-requests", type=click.IntRange(min=1), default=None,
              help="Requests per rate (default 24, or what --duration gives).")
@click.option("--long-fraction", type=click.FloatRange(0, 1), default=0.25, show_default=True,
              help="Share of long-document prompts in the mix.")
@click.option("--slo-ttft-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="TTFT SLO (default: per model).")
@click.option("--slo-tbt-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="SLO on each request's p90 time between tokens (default: per model).")
@click.option("--phases", default=None,
              help="A load that changes, instead of --rates: phases sent back to back, each a kind "
                   "(chat: 10%% documents at 2 req/s; docs: 50%% at 1 req/s) or name:long_fraction:rate:seconds; "
                   "e.g. chat,docs,chat.")
@click.option("--phase-s", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="Seconds of each phase given by kind.")
@click.option("--workload", type=click.Choice(["mixed", "prefix"]), default="mixed", show_default=True,
              help="mixed: short chat and long documents (--long-fraction); prefix: 8 shared system prompts of "
                   "400-600 tokens and multi-turn conversations that resend their history (default modes then: "
                   "prefix-off, prefix-blind, prefix-aware: 2 prefill + 1 decode workers with caching off, caching "
                   "with cache-blind routing, caching with cache-aware routing).")
@click.option("--kv-cache-mb", type=click.IntRange(min=1), default=None,
              help="Each worker's KV pool [default: 256; 512 with --workload prefix].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Requests sent (and not counted) before each mode's first rate.")
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="colocated-chunked: token budget of one step (--max-batched-tokens).")
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
                   "kill-worker,restart-redis. The report adds what each did; the batch lines must still be "
                   "answered exactly once (pdqueue/bench/serve_chaos.py).")
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
                phases, phase_s, workload, kv_cache_mb, seed, warmup, chunk_tokens, batch_lines, batch_max_tokens,
                chaos, tenants_path, tenant_rates, openai_url, openai_model, api_key, as_json, out):
    """Poisson load from the Python client against 1 prefill + 1 decode worker and 2
    colocated workers (prefill-first and chunked), one thread each, on the same cores; or,
    with --openai-url, the same load against any OpenAI-compatible server.

    With --batch-lines, exits with status 1 (after the report) when a batch line was not
    answered exactly once."""
    from pdqueue.bench import plots, serve_bench
    from pdqueue.bench.serve_load import Settings, parse_phases
    from pdqueue.bench.serve_modes import MODES, PREFIX_MODES, BenchError
    from pdqueue.bench.serve_report import batch_failures, format_table
    from pdqueue.bench.stats import round_floats

    _end_on_term()
    if workload == "prefix" and click.get_current_context().get_parameter_source("modes").name == "DEFAULT":
        modes = ",".join(PREFIX_MODES)
    mode_list = _csv(modes, str, "--modes")
    unknown = [m for m in mode_list if m not in MODES]
    if unknown:
        raise UserError(f"unknown mode(s) {unknown}; expected some of {list(MODES)}")
    try:
        phase_list = parse_phases(phases, phase_s) if phases else ()
    except ValueError as exc:
        raise UserError(f"--phases: {exc}") from None
    chaos_events = _chaos_option(chaos, batch_lines, phases, tenants_path, openai_url)
    rates_by_tenant = _tenant_options(tenants_path, tenant_rates, duration, num_requests, phases, batch_lines,
                                      openai_url)
    settings = Settings.for_model(
        model, modes=mode_list, phases=phase_list, plan_mode=plan_mode, rates=_csv(rates, float, "--rates"), duration_s=duration,
        num_requests=num_requests, long_fraction=long_fraction, slo_ttft_ms=slo_ttft_ms,
        slo_tbt_ms=slo_tbt_ms, seed=seed, warmup=warmup, chunk_tokens=chunk_tokens, openai_url=openai_url,
        openai_model=openai_model, api_key=api_key, workload_kind=workload, batch_lines=batch_lines,
        batch_max_tokens=batch_max_tokens, chaos=chaos_events, tenants_path=tenants_path, tenant_rates=rates_by_tenant,
        kv_cache_mb=kv_cache_mb or (512 if workload == "prefix" else 256))
    try:
        result = serve_bench.run(settings, launch_workers, progress=_progress,
                                 log_dir=Path(out) / "logs" if out else None,
                                 on_mode=(lambda partial: _write_partial(out, partial)) if out else None)
    except BenchError as exc:
        raise UserError(str(exc)) from None
    result = round_floats(result)
    if result.get("kind") == "tenants":
        from pdqueue.bench.serve_tenants import format_tenants_table

        _write_out(out, "serve", result, None)
        click.echo(json.dumps(result, indent=2) if as_json else format_tenants_table(result))
        return
    _write_out(out, "serve", result, plots.plot_serve)
    click.echo(json.dumps(result, indent=2) if as_json else format_table(result))
    failed = batch_failures(result)
    if failed:   # the exactly-once check: loud, and the exit status
        click.secho(f"FAILED: batch lines not answered exactly once in {', '.join(failed)} "
                    f"(missing, duplicated, or not ending in one done on out:<id>; see the batch figures)",
                    fg="red", bold=True, err=True)
        sys.exit(1)


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


@bench.command("gateway")
@click.option("--model", envvar="PDQ_MODEL", default="tiny", show_default=True,
              help="The workers' model (tiny: the gateway's share of the time is largest).")
@click.option("--pairs", type=click.IntRange(min=1), default=40, show_default=True,
              help="Latency: requests per path (gateway, client), alternating.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=16, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=32, show_default=True,
              help="Throughput: closed-loop clients.")
@click.option("--duration", type=click.FloatRange(min=0.5), default=5.0, show_default=True,
              help="Throughput: seconds per path.")
@click.option("--variants", default=None,
              help="Compare gateway configurations in one run: comma-separated LOOP-HTTP[-REDISPARSER] (loop auto, "
                   "asyncio, uvloop; HTTP parser auto, h11, httptools; Redis parser auto, hiredis, python), e.g. "
                   "asyncio-h11-python,uvloop-httptools-hiredis. One gateway each on the same workers, measured in "
                   "--rounds alternating rounds [default: one gateway, as `pdqueue serve` would run].")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="With --variants: rounds (each reported, then the median and spread).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_gateway(model, pairs, max_tokens, concurrency, duration, variants, rounds, as_json):
    """The OpenAI gateway against pdqueue.Client on the same 1 prefill + 1 decode workers:
    added TTFT and ITL (the same requests, alternating) and the requests/s one gateway serves.

    \b
    --variants: one gateway per configuration, all against the client in the same rounds."""
    import dataclasses

    from pdqueue.bench import gateway_bench
    from pdqueue.bench.stats import round_floats
    from pdqueue.client import Client
    from pdqueue.frontends.gateway import runtime
    from pdqueue.queue.redis_server import free_port
    from workers.cli.local_cluster import LocalCluster, LocalClusterConfig, WorkerFailed

    check_model(model)
    try:
        chosen = gateway_bench.parse_variants(variants) if variants is not None else None
        runtimes = {v.name: _variant_runtime(v) for v in chosen or ()}
        default_runtime = runtime().describe()
    except ValueError as exc:
        raise UserError(f"--variants: {exc}" if variants is not None else str(exc)) from None
    settings = gateway_bench.Settings(pairs=pairs, max_tokens=max_tokens, concurrency=concurrency,
                                      duration_s=duration)
    lc = LocalCluster(LocalClusterConfig(model=model, cluster="bench-gateway", redis_port=free_port(), threads=1,
                                         kv_cache_mb=64, gateway_port=0))
    gateways: dict = {}
    try:
        lc.start_server()
        lc.start_workers()
        if chosen is None:
            lc.start_gateway()
            _progress(f"loading {model} in 1 prefill + 1 decode worker; gateway {lc.gateway_url}")
        else:
            for v in chosen:
                gateways[v.name] = _start_variant_gateway(lc, v)
            _progress(f"loading {model} in 1 prefill + 1 decode worker; gateways "
                      + ", ".join(f"{name} {url}" for name, (_, url) in gateways.items()))
        lc.wait_ready(600)
        with Client(lc.url, lc.config.cluster) as client:
            if chosen is None:
                lat = gateway_bench.latency(client, lc.gateway_url, settings, _progress)
            else:
                cmp = gateway_bench.compare(client, lc.url, lc.config.cluster,
                                            {name: (url, proc.pid) for name, (proc, url) in gateways.items()},
                                            settings, rounds, _progress)
        if chosen is None:
            thr = gateway_bench.throughput(lc.url, lc.config.cluster, lc.gateway_url, lc.gateway.proc.pid, settings,
                                           _progress)
    except (WorkerFailed, TimeoutError, RuntimeError) as exc:
        raise UserError(str(exc)) from None
    finally:
        for proc, _ in gateways.values():
            _stop_process(proc)
        lc.stop(grace_s=30)
    if chosen is None:
        result = round_floats({"model": model, "settings": dataclasses.asdict(settings), "runtime": default_runtime,
                               "latency": lat, "throughput": thr})
        click.echo(json.dumps(result, indent=2) if as_json else gateway_bench.format_table(result))
        return
    result = round_floats({"model": model, "settings": dataclasses.asdict(settings), "variants": list(runtimes),
                           "runtimes": runtimes, "compare": cmp})
    click.echo(json.dumps(result, indent=2) if as_json else gateway_bench.format_compare(result))


def _variant_runtime(variant) -> str:
    """What a gateway of ``variant`` runs on (ValueError if something it names is not installed)."""
    import os

    from pdqueue.frontends.gateway import runtime
    from pdqueue.queue.connection import PARSER_ENV

    before = os.environ.get(PARSER_ENV)
    os.environ[PARSER_ENV] = variant.redis_parser
    try:
        return runtime(variant.loop, variant.http).describe()
    finally:
        if before is None:
            os.environ.pop(PARSER_ENV, None)
        else:
            os.environ[PARSER_ENV] = before


def _start_variant_gateway(lc, variant, timeout_s: float = 30.0):
    """`pdqueue serve` with ``variant``'s options on a free port for ``lc``'s cluster:
    (process, URL) once it printed its URL (RuntimeError if it exits or prints none)."""
    import re
    import subprocess
    import time

    from pdqueue.procs import die_with_parent

    out_path, log_path = lc.log_dir / f"gateway-{variant.name}.out", lc.log_dir / f"gateway-{variant.name}.log"
    cmd = [sys.executable, "-m", "workers", "serve", "--cluster", lc.config.cluster, "--port", "0",
           "--log-level", "WARNING", *variant.serve_args()]
    with open(out_path, "wb") as out, open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=log, env=lc.child_env(),
                                start_new_session=True, preexec_fn=die_with_parent)
    deadline = time.monotonic() + timeout_s
    while True:
        match = re.search(r"(http://\S+)/v1", out_path.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_process(proc)
            why = (f"exited with status {proc.returncode}" if proc.returncode is not None and proc.returncode != -9
                   else f"printed no URL within {timeout_s:g} s")
            tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
            raise RuntimeError(f"the {variant.name} gateway (pdqueue serve {' '.join(variant.serve_args())}) {why}: "
                               f"{tail}")
        time.sleep(0.05)


def _stop_process(proc, grace_s: float = 20.0) -> None:
    """SIGTERM (a gateway drains: nothing is open by now), SIGKILL after ``grace_s``."""
    import os
    import signal
    import subprocess

    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
