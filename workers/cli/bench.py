"""`pdqueue bench engine|transfer|serve|gateway`: parse options, call pdqueue.bench, print a table
(or one JSON object with --json), write JSON and plots under --out."""

from __future__ import annotations

import json
import sys
import time

import click

from workers.cli.bench_common import csv_values, positive_ints, progress, write_out
from workers.cli.bench_serve import bench_serve
from workers.cli.common import (
    Group,
    UserError,
    check_device,
    check_engine_config,
    check_kv_pool,
    check_model,
    engine_options,
    load,
    model_errors,
    model_option,
)


@click.group(cls=Group)
def bench():
    """Benchmarks: they compare against baselines measured in the same run."""


bench.add_command(bench_serve)


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
def bench_engine(model, device, dtype, threads, kv_cache_mb, prefix_caching, weights, cuda_graphs, prompt_lens,
                 batch_sizes,
                 rounds, formats, as_json):
    """Prefill tokens/s and decode ms/step beside the memory-bandwidth bound; with quantized
    --weights (int8, int4, q4_1), beside float32 weights in the same run (decode_b1_vs_fp32)."""
    check_model(model)
    lens, sizes = positive_ints("--prompt-lens", prompt_lens), positive_ints("--batch-sizes", batch_sizes)
    config = check_engine_config(model=model, device=device, dtype=dtype, num_threads=threads,
                                 kv_cache_mb=kv_cache_mb, prefix_caching=prefix_caching, cuda_graphs=cuda_graphs,
                                 weights=weights)
    check_device(device)
    check_kv_pool(model, config)
    from pdqueue.bench import engine_bench

    progress = lambda m: click.secho(m, fg="cyan", err=True)  # noqa: E731
    names = csv_values(formats, str, "--formats") if formats else ["fp32", weights] if weights != "fp32" else []
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
              help="Weights formats to compare with float32 (pdqueue.models.quant); none: no weights formats.")
@click.option("--kv-formats", default="native,fp16,int8", show_default=True,
              help="KV formats to compare with native (--kv-wire-format, --kv-tier-format: the prompt's KV "
                   "round-tripped after a full-precision prefill, float32 weights); none: no KV formats.")
@click.option("--kv-contexts", type=click.IntRange(min=0), default=4, show_default=True,
              help="KV formats: long prompts (windows of the text, besides the short prompts).")
@click.option("--kv-context-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="KV formats: tokens of each long prompt.")
@click.option("--window", type=click.IntRange(min=2), default=512, show_default=True,
              help="Perplexity: tokens per disjoint window.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Greedy agreement: tokens per prompt.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch threads [default: torch's choice].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_quality(model, formats, kv_formats, kv_contexts, kv_context_tokens, window, max_tokens, threads, as_json):
    """Perplexity of a fixed public-domain text and greedy agreement with float32, per
    weights format; greedy agreement and KL to native, per KV format."""
    from pdqueue.engine.config import WEIGHT_FORMATS
    from workers.common import KV_FORMATS

    check_model(model)
    names = [] if formats == "none" else csv_values(formats, str, "--formats")
    unknown = [f for f in names if f not in WEIGHT_FORMATS]
    if unknown:
        raise UserError(f"--formats: unknown {unknown}; expected some of {list(WEIGHT_FORMATS)} or none")
    kv_names = [] if kv_formats == "none" else csv_values(kv_formats, str, "--kv-formats")
    unknown = [f for f in kv_names if f not in KV_FORMATS]
    if unknown:
        raise UserError(f"--kv-formats: unknown {unknown}; expected some of {list(KV_FORMATS)} or none")
    import torch

    from pdqueue.bench import quality
    from pdqueue.models.loader import model_config_for

    with model_errors():
        moe = model_config_for(model).moe is not None
    if moe and any(n != "fp32" for n in names):   # (models.quant refuses experts)
        click.secho(f"--formats: {', '.join(n for n in names if n != 'fp32')} do not apply to a mixture of "
                    "experts: fp32 only", fg="yellow", err=True)
        names = ["fp32"]
    if threads:
        torch.set_num_threads(threads)
    result, tables = {}, []
    with model_errors():
        if names:
            result = quality.run(model, names, window, max_tokens, progress=progress)
            tables.append(quality.format_table(result))
        if kv_names:
            from pdqueue.bench import kv_quality

            result["kv"] = kv_quality.run(model, kv_names, max_tokens, kv_contexts, kv_context_tokens,
                                          progress=progress)
            tables.append(kv_quality.format_table(result["kv"]))
    click.echo(json.dumps(result, indent=2) if as_json else "\n\n".join(tables))


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
    if all("first_step_ms" in res[n] for n in names):
        row("first prefill step ms", [res[n]["first_step_ms"]["prefill"] for n in names], ".1f")
        row("first decode step ms", [res[n]["first_step_ms"]["decode"] for n in names], ".1f")
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

    result = round_floats(transfer_bench.run(quick=quick, repeats=repeats, progress=progress))
    write_out(out, "transfer", result, plots.plot_transfer)
    click.echo(json.dumps(result, indent=2) if as_json else transfer_bench.format_table(result))
    missed = transfer_bench.missed_targets(result)
    if check and missed:
        click.secho(f"targets not met: {', '.join(missed)}", fg="red", err=True)
        sys.exit(3)

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
            progress(f"loading {model} in 1 prefill + 1 decode worker; gateway {lc.gateway_url}")
        else:
            for v in chosen:
                gateways[v.name] = _start_variant_gateway(lc, v)
            progress(f"loading {model} in 1 prefill + 1 decode worker; gateways "
                      + ", ".join(f"{name} {url}" for name, (_, url) in gateways.items()))
        lc.wait_ready(600)
        with Client(lc.url, lc.config.cluster) as client:
            if chosen is None:
                lat = gateway_bench.latency(client, lc.gateway_url, settings, progress)
            else:
                cmp = gateway_bench.compare(client, lc.url, lc.config.cluster,
                                            {name: (url, proc.pid) for name, (proc, url) in gateways.items()},
                                            settings, rounds, progress)
        if chosen is None:
            thr = gateway_bench.throughput(lc.url, lc.config.cluster, lc.gateway_url, lc.gateway.proc.pid, settings,
                                           progress)
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
