"""Third-party OpenAI benchmark clients against pdqueue's gateway (issue 23).

The same load (``Load``: so many requests of so many prompt and output tokens, at most so
many in flight) goes through each client from PyPI, each run as a subprocess from its own
virtual environment (``scripts/bench-clients install`` makes them under
``.venv-benchclients/<name>``: their pinned dependencies conflict with pdqueue's and with
each other's), and through pdqueue's own ``bench serve`` client (``serve_client.OpenAIClient``,
what ``pdqueue bench serve --openai-url`` runs), with at most ``concurrency`` requests in
flight. Each client's own report is read back (requests, successes, TTFT and ITL p50/p99)
into a ``ClientResult``; ``format_table`` prints them side by side.

Clients (``CLIENTS``; versions pinned in ``scripts/bench-clients``):
- ``vllm``: ``vllm bench serve`` 0.32.0, the last release whose SSE reader strips each
  network read before splitting events, so an SSE comment (``: keep-alive``) glues itself
  to what follows: the stream's events are lost until one read happens to hold two of
  them, and a request that gets none fails ("Never received a valid chunk").
- ``sglang``: ``python -m sglang.bench_serving`` 0.5.9, the last release whose bench imports
  nothing of sglang's server (``sglang.srt``); it ``json.loads`` every non-empty line, a
  comment too, and fails the request.
- ``aiperf`` 0.13.0 (NVIDIA), ``guidellm`` 0.8.1 (vLLM project), ``inference-perf`` 0.7.0
  (Kubernetes SIG; Python >= 3.12): they skip comments.

No model hub is reachable here, so each client gets a local Hugging Face tokenizer
directory (``write_tokenizer``: the tiny model's byte-level one, or SmolLM2's rebuilt from
its GGUF) and runs with ``HF_HUB_OFFLINE=1`` (aiperf excepted: ``client_env`` says why).

``client_stack.PrefillStall`` holds the prefill worker (SIGSTOP) until the load is queued and
a while longer: a TTFT over a second whatever the model and machine (the tests'
deterministic load). ``main`` (``scripts/bench-clients run``) starts Redis, the workers and a
gateway (``client_stack.Stack``; or drives ``--url``) and prints the table.

Imports the standard library at the top; in the functions that need them, tokenizers and
pdqueue.models (the tokenizers), redis and pdqueue.keys/queue (the stall, the stack),
pdqueue.bench.serve_*; never torch for ``tiny``, never workers (they are subprocesses).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from pdqueue.bench.client_stack import ROOT, PrefillStall, Stack

CLIENTS = ("vllm", "sglang", "aiperf", "guidellm", "inference-perf")
# The distribution whose version a client's venv reports.
_DIST = {"vllm": "vllm", "sglang": "sglang", "aiperf": "aiperf", "guidellm": "guidellm",
         "inference-perf": "inference_perf"}


def clients_dir() -> Path:
    """Where ``scripts/bench-clients install`` puts the clients' venvs
    ($PDQ_BENCH_CLIENTS_DIR, default ``.venv-benchclients`` in the repository)."""
    return Path(os.environ.get("PDQ_BENCH_CLIENTS_DIR") or ROOT / ".venv-benchclients")


def client_venv(name: str) -> Path | None:
    """The client's venv, or None when it is not installed (no ``.ok`` marker: the install
    writes it last, after its own check)."""
    venv = clients_dir() / name
    return venv if (venv / ".ok").exists() and (venv / "bin" / "python").exists() else None


def client_version(name: str) -> str | None:
    venv = client_venv(name)
    if venv is None:
        return None
    found = glob.glob(str(venv / "lib" / "python3*" / "site-packages" / f"{_DIST[name]}-*.dist-info"))
    return Path(found[0]).name.removesuffix(".dist-info").split("-", 1)[1] if found else "?"


@dataclass(frozen=True, slots=True)
class Load:
    requests: int = 8
    concurrency: int = 8          # at most this many in flight (== requests: all at once)
    prompt_tokens: int = 64
    output_tokens: int = 8
    seed: int = 0


@dataclass(slots=True)
class ClientResult:
    client: str
    version: str
    requests: int | None = None        # what the client counted as sent
    succeeded: int | None = None
    failed: int | None = None
    ttft_ms: dict = field(default_factory=dict)   # {"p50": .., "p99": ..}
    itl_ms: dict = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int | None = None
    error: str | None = None            # why no figures (the client's last lines)
    log: str | None = None              # its stdout + stderr

    @property
    def all_ok(self) -> bool:
        return self.error is None and self.failed == 0 and self.succeeded == self.requests


# -- tokenizers --------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer(model: str, directory: str | os.PathLike) -> Path:
    """A Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``)
    for ``model`` that encodes as pdqueue's workers do: ``tiny``'s bytes (ids 0..255, bos
    256, eos 257) as a byte-level BPE without merges; SmolLM2 (or a ``.gguf`` path) rebuilt
    from the GGUF's vocabulary, merges and chat template. Returns the directory."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if model == "tiny":
        from pdqueue.models.tokenizer import ByteTokenizer

        chars = _bytes_to_unicode()
        backend = HFTokenizer(models.BPE({chars[b]: b for b in range(256)}, [], fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<bos>", "<eos>")])
        config = {"bos_token": "<bos>", "eos_token": "<eos>", "model_max_length": 4096,
                  "chat_template": ByteTokenizer.CHAT_TEMPLATE}
    else:
        from pdqueue.models.gguf_file import field as _field
        from pdqueue.models.loader import _gguf_reader
        from pdqueue.models.source import resolve_model_path
        from pdqueue.models.tokenizer import hf_tokenizer_from_gguf_vocab

        path = resolve_model_path(model)
        if path is None or path.suffix != ".gguf":
            raise ValueError(f"{model!r}: a tokenizer is written for tiny, smollm2 or a .gguf file")
        reader = _gguf_reader(path)
        tokens = _field(reader, "tokenizer.ggml.tokens")
        backend = hf_tokenizer_from_gguf_vocab(tokens, _field(reader, "tokenizer.ggml.merges"),
                                               _field(reader, "tokenizer.ggml.token_type"),
                                               _field(reader, "tokenizer.ggml.pre", "gpt2"))
        bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
        config = {"bos_token": None if bos is None else tokens[int(bos)],
                  "eos_token": None if eos is None else tokens[int(eos)],
                  "model_max_length": int(_field(reader, "llama.context_length", 2048)),
                  "chat_template": _field(reader, "tokenizer.chat_template")}
    (directory / "tokenizer.json").write_text(backend.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **config}))
    return directory


# -- the clients ------------------------------------------------------------------------------

def client_env(name: str, api_key: str | None) -> dict:
    """The client's environment: Hugging Face's offline mode (no hub is reachable: a
    client that looks one up waits out its retries), except for aiperf, whose offline mode
    skips loading a local tokenizer directory into its cache and then fails to find it
    (0.13.0: "Repo id must be in the form ..."); it reads the local directory without it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDQ_", "VIRTUAL_ENV", "PYTHONPATH", "HF_"))}
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", NO_COLOR="1", TERM="dumb", COLUMNS="200",
               OPENAI_API_KEY=api_key or "unused", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("TRANSFORMERS_OFFLINE", None)
    if name != "aiperf":
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def client_command(name: str, venv: Path, url: str, model: str, load: Load, tokenizer: Path, workdir: Path,
                   api_key: str | None) -> list[str]:
    """The client's command line for ``load`` against ``url``; its report goes to ``workdir``."""
    bin_ = venv / "bin"
    n, c, p, o = (str(x) for x in (load.requests, load.concurrency, load.prompt_tokens, load.output_tokens))
    if name == "vllm":
        return [str(bin_ / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url, "--model", model,
                "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", p,
                "--random-output-len", o, "--random-range-ratio", "0", "--num-prompts", n, "--max-concurrency", c,
                "--request-rate", "inf", "--ignore-eos", "--disable-tqdm", "--seed", str(load.seed),
                "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99", "--save-result",
                "--result-dir", str(workdir), "--result-filename", "vllm.json"]
    if name == "sglang":
        return [str(bin_ / "python"), "-m", "sglang.bench_serving", "--backend", "vllm", "--base-url", url,
                "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random-ids",
                "--random-input-len", p, "--random-output-len", o, "--random-range-ratio", "1", "--num-prompts", n,
                "--max-concurrency", c, "--request-rate", "inf", "--warmup-requests", "0", "--disable-tqdm",
                "--seed", str(load.seed), "--output-file", str(workdir / "sglang.jsonl")]
    if name == "aiperf":
        return [str(bin_ / "aiperf"), "profile", "--model-names", model, "--url", url, "--endpoint-type",
                "completions", "--streaming", "--tokenizer", str(tokenizer), "--concurrency", c, "--request-count", n,
                "--prompt-input-tokens-mean", p, "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", o,
                "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--random-seed",
                str(load.seed), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
                "--output-artifact-dir", str(workdir / "aiperf"), *(["--api-key", api_key] if api_key else [])]
    if name == "guidellm":
        backend = f"kind=openai_http,target={url},model={model},request_format=/v1/completions"
        return [str(bin_ / "guidellm"), "run", "--backend", backend + (f",api_key={api_key}" if api_key else ""),
                "--profile", f"kind=concurrent,streams={c}", "--constraint", f"kind=max_requests,count={n}",
                "--data", f"kind=synthetic_text,prompt_tokens={p},output_tokens={o}",
                "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--seed", f"kind=static,value={load.seed}",
                "--output", f"kind=json,path={workdir / 'guidellm.json'}", "--disable-console-interactive"]
    if name == "inference-perf":
        config = {
            "api": {"type": "completion", "streaming": True},
            "data": {"type": "synthetic",
                     "input_distribution": {"min": load.prompt_tokens, "max": load.prompt_tokens,
                                            "mean": load.prompt_tokens, "std_dev": 0, "total_count": load.requests},
                     "output_distribution": {"min": load.output_tokens, "max": load.output_tokens,
                                             "mean": load.output_tokens, "std_dev": 0, "total_count": load.requests}},
            "load": {"type": "concurrent", "num_workers": 1,
                     "stages": [{"num_requests": load.requests, "concurrency_level": load.concurrency}]},
            "server": {"type": "vllm", "model_name": model, "base_url": url, "ignore_eos": True,
                       **({"api_key": api_key} if api_key else {})},
            "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
            "storage": {"local_storage": {"path": str(workdir / "inference-perf")}},
            "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False}},
        }
        (workdir / "inference-perf.json").write_text(json.dumps(config))   # YAML is a superset of JSON
        return [str(bin_ / "inference-perf"), "-c", str(workdir / "inference-perf.json")]
    raise ValueError(f"unknown client {name!r}; expected one of {CLIENTS}")


def _ms(summary: dict, scale: float = 1.0, p50: str = "p50", p99: str = "p99") -> dict:
    return {"p50": summary[p50] * scale, "p99": summary[p99] * scale}


def read_report(name: str, workdir: Path, result: ClientResult, load: Load, output: str) -> None:
    """Fill ``result`` from the client's own report in ``workdir``."""
    if name == "vllm":
        d = json.loads((workdir / "vllm.json").read_text())
        result.succeeded, result.failed = d["completed"], d["failed"]
        result.requests = d["completed"] + d["failed"]
        result.ttft_ms = {"p50": d["p50_ttft_ms"], "p99": d["p99_ttft_ms"]}
        result.itl_ms = {"p50": d["p50_itl_ms"], "p99": d["p99_itl_ms"]}
    elif name == "sglang":
        path = workdir / "sglang.jsonl"
        if not path.exists() and "All requests failed" in output:
            # 0.5.9 prints this warning, then dies computing percentiles of nothing
            result.requests, result.succeeded, result.failed = load.requests, 0, load.requests
            return
        d = json.loads(path.read_text().splitlines()[-1])
        result.requests, result.succeeded = d["num_prompts"] if "num_prompts" in d else load.requests, d["completed"]
        result.failed = result.requests - result.succeeded
        result.ttft_ms = _ms(d, p50="median_ttft_ms", p99="p99_ttft_ms")
        result.itl_ms = _ms(d, p50="median_itl_ms", p99="p99_itl_ms")
    elif name == "aiperf":
        d = json.loads((workdir / "aiperf" / "profile_export_aiperf.json").read_text())
        ok = int((d.get("request_count") or {}).get("avg") or 0)
        errors = int((d.get("error_request_count") or {}).get("avg") or 0)
        result.requests, result.succeeded, result.failed = ok + errors, ok, errors
        result.ttft_ms = _ms(d["time_to_first_token"])
        result.itl_ms = _ms(d["inter_token_latency"])
    elif name == "guidellm":
        d = json.loads((workdir / "guidellm.json").read_text())
        m = d["benchmarks"][0]["metrics"]
        totals = m["request_totals"]
        result.requests, result.succeeded = totals["total"], totals["successful"]
        result.failed = totals["errored"] + totals["incomplete"]
        result.ttft_ms = _ms(m["time_to_first_token_ms"]["successful"]["percentiles"])
        result.itl_ms = _ms(m["inter_token_latency_ms"]["successful"]["percentiles"])
    elif name == "inference-perf":
        d = json.loads((workdir / "inference-perf" / "stage_0_lifecycle_metrics.json").read_text())
        result.requests = d["load_summary"]["count"]
        result.succeeded = d["successes"]["count"]
        result.failed = (d.get("failures") or {}).get("count", 0)
        lat = d["successes"]["latency"]
        result.ttft_ms = _ms(lat["time_to_first_token"], 1e3, p50="median")
        result.itl_ms = _ms(lat["inter_token_latency"], 1e3, p50="median")


def run_client(name: str, url: str, model: str, load: Load, tokenizer: Path, workdir: str | os.PathLike,
               api_key: str | None = None, timeout_s: float = 600.0,
               before: Callable[[], None] | None = None) -> ClientResult:
    """Run one installed client on ``load`` against ``url`` and read its report (an error
    is recorded, never raised; a client that is not installed says so in ``error``)."""
    result = ClientResult(name, client_version(name) or "not installed")
    venv = client_venv(name)
    if venv is None:
        result.error = f"not installed (bash scripts/bench-clients install {name})"
        return result
    workdir = Path(workdir) / name
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = client_command(name, venv, url, model, load, tokenizer, workdir, api_key)
    log_path = workdir / "client.log"
    start = time.monotonic()
    with open(log_path, "wb") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir,
                                env=client_env(name, api_key), start_new_session=True)
        if before is not None:
            before()
        try:
            result.returncode = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            result.returncode = proc.wait()
            result.error = f"timed out after {timeout_s:.0f} s"
    result.seconds = time.monotonic() - start
    result.log = log_path.read_text(errors="replace")
    if result.error is None:
        try:
            read_report(name, workdir, result, load, result.log)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            tail = "\n".join(result.log.strip().splitlines()[-8:])
            result.error = f"no report ({type(exc).__name__}: {exc}); exit {result.returncode}; last lines:\n{tail}"
    return result


def run_pdqueue(url: str, model: str, load: Load, api_key: str | None = None, timeout_s: float = 600.0,
                vocab_size: int | None = None) -> ClientResult:
    """The load through pdqueue's ``bench serve`` client (``serve_client.OpenAIClient``: token
    ids as the prompt, greedy, ``ignore_eos``, streamed), ``load.concurrency`` in flight;
    TTFT and ITL (``tbt_ms``: the gaps between SSE chunks) as ``bench serve`` computes them."""
    from pdqueue.bench.serve_client import OpenAIClient, Record, send_one
    from pdqueue.bench.serve_load import VOCAB, Planned, Settings
    from pdqueue.bench.serve_report import metrics

    vocab = vocab_size or VOCAB.get(model, 256)
    rng = random.Random(f"client-bench/{load.seed}")
    plan = [Planned(0.0, "long", tuple(rng.randrange(3, vocab) for _ in range(load.prompt_tokens)),
                       load.output_tokens) for _ in range(load.requests)]
    settings = Settings.for_model(model, openai_url=url, api_key=api_key, num_requests=load.requests)

    async def drive() -> list:
        async with OpenAIClient(url, model, api_key) as client:
            gate = asyncio.Semaphore(load.concurrency)

            async def one(i: int, planned):
                async with gate:
                    return await send_one(client, planned, load.seed + i, Record(planned), timeout_s)

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(plan)))

    result = ClientResult("pdqueue bench serve", _pdqueue_version())
    start = time.monotonic()
    try:
        records = asyncio.run(drive())
    except Exception as exc:   # the server is not there, or answered /v1/models badly
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.seconds = time.monotonic() - start
    figures, _ = metrics(records, float(load.requests), settings)
    result.requests, result.succeeded, result.failed = figures["requests"], figures["completed"], figures["failed"]
    result.ttft_ms = _ms(figures["ttft_ms"])
    result.itl_ms = _ms(figures["tbt_ms"])
    if figures["errors"]:
        result.log = "\n".join(figures["errors"])
    return result


def _pdqueue_version() -> str:
    try:
        from importlib.metadata import version

        return version("pdqueue")
    except Exception:
        return "?"


# -- the table ----------------------------------------------------------------------------------

def format_table(results: list[ClientResult], load: Load, title: str = "") -> str:
    def fmt(v) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.0f}" if v >= 10 else f"{v:.1f}"

    lines = [title] if title else []
    lines.append(f"load: {load.requests} requests, {load.concurrency} in flight, {load.prompt_tokens} prompt tokens, "
                 f"{load.output_tokens} output tokens (ignore_eos), streamed /v1/completions")
    lines.append(f"{'client':<22}{'version':<12}{'ok/sent':>9}  {'TTFT p50':>9}{'TTFT p99':>9}  {'ITL p50':>8}"
                 f"{'ITL p99':>8}  {'wall s':>7}")
    for r in results:
        ok = f"{r.succeeded}/{r.requests}" if r.requests is not None else "-"
        lines.append(f"{r.client:<22}{r.version:<12}{ok:>9}"
                     f"  {fmt(r.ttft_ms.get('p50')):>9}{fmt(r.ttft_ms.get('p99')):>9}"
                     f"  {fmt(r.itl_ms.get('p50')):>8}{fmt(r.itl_ms.get('p99')):>8}  {r.seconds:>7.1f}"
                     + (f"  {r.error.splitlines()[0]}" if r.error else ""))
    lines.append("ms; each client's own definitions: ITL is the gap between SSE chunks (vllm, sglang, inference-perf, "
                 "pdqueue) or a request's (latency - TTFT) / (tokens - 1) (aiperf, guidellm); the gateway may put "
                 "several tokens in one chunk.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench-clients run", description=(
        "The same load through third-party OpenAI benchmark clients (each from its venv under "
        ".venv-benchclients, `scripts/bench-clients install`) and through pdqueue's bench serve client, against "
        "pdqueue's gateway; prints TTFT and ITL p50/p99 per client. Without --url it starts Redis, one prefill and "
        "one decode worker (one torch thread each) and a gateway here, and stops them after."))
    ap.add_argument("--url", help="An OpenAI server already running (e.g. http://127.0.0.1:8000) instead.")
    ap.add_argument("--model", default="smollm2", help="The workers' model, and the tokenizer given to the clients "
                                                       "(tiny, smollm2 or a .gguf file) [default: smollm2].")
    ap.add_argument("--clients", default=",".join(CLIENTS) + ",pdqueue",
                    help="Comma-separated, of: " + ", ".join(CLIENTS) + ", pdqueue [default: all].")
    ap.add_argument("--requests", type=int, default=24, help="[default: 24]")
    ap.add_argument("--concurrency", type=int, default=8, help="At most this many in flight [default: 8].")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="[default: 512]")
    ap.add_argument("--output-tokens", type=int, default=32, help="[default: 32]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--timeout", type=float, default=900.0, help="Seconds one client may take [default: 900].")
    ap.add_argument("--gateway-arg", action="append", default=[],
                    help="An extra `pdqueue serve` argument (repeatable; e.g. --gateway-arg=--sse-keepalive-s "
                         "--gateway-arg=1: an SSE comment after each second without a token, as before issue 23).")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="Keep the workers' prefix caching on. Off by default here: each client makes prompts of its "
                         "own, and some repeat text across requests, so cache hits would make TTFT differ by dataset.")
    ap.add_argument("--stall-prefill", type=float, default=None, metavar="S",
                    help="Hold the prefill worker (SIGSTOP) until the load is queued, then S s more: a TTFT of at "
                         "least S s whatever the model (the tests' load). Needs --concurrency = --requests.")
    ap.add_argument("--out", help="Directory for the clients' reports and logs, and results.json [default: a new "
                                  "temporary one].")
    ap.add_argument("--json", action="store_true", help="Print the results as JSON.")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = [c for c in names if c not in CLIENTS and c != "pdqueue"]
    if unknown:
        ap.error(f"unknown client(s) {unknown}; expected some of {list(CLIENTS)} and pdqueue")
    if args.stall_prefill is not None and (args.url or args.concurrency != args.requests):
        ap.error("--stall-prefill needs the cluster started here (no --url) and --concurrency equal to --requests")
    load = Load(args.requests, args.concurrency, args.prompt_tokens, args.output_tokens, args.seed)
    out = Path(args.out or tempfile.mkdtemp(prefix="pdq-bench-clients-"))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(args.model, out / "tokenizer")
    stack = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        print(f"starting Redis, 1 prefill + 1 decode worker ({args.model}) and a gateway (logs in {out / 'cluster'})",
              file=sys.stderr, flush=True)
        stack = Stack(args.model, out / "cluster", args.gateway_arg,
                      [] if args.prefix_caching else ["--no-prefix-caching"])
        url = stack.url
    results = []
    try:
        for name in [n for n in names if n != "pdqueue"] + (["pdqueue"] if "pdqueue" in names else []):
            print(f"{name}: running", file=sys.stderr, flush=True)
            stall = None
            if args.stall_prefill is not None:
                stall = PrefillStall(stack.prefill_pgid, stack.redis_url, stack.cluster, load.requests,
                                     hold_s=args.stall_prefill, max_wait_s=args.timeout).__enter__()
            try:
                if name == "pdqueue":
                    results.append(run_pdqueue(url, args.model, load, args.api_key, args.timeout))
                else:
                    results.append(run_client(name, url, args.model, load, tokenizer, out, args.api_key, args.timeout))
            finally:
                if stall is not None:
                    stall.__exit__(None, None, None)
            r = results[-1]
            print(f"{name}: {r.succeeded}/{r.requests} ok in {r.seconds:.1f} s" + (f" ({r.error})" if r.error else ""),
                  file=sys.stderr, flush=True)
    finally:
        if stack is not None:
            stack.stop()
    (out / "results.json").write_text(json.dumps(
        {"load": asdict(load), "url": url, "model": args.model, "gateway_args": args.gateway_arg,
         "prefix_caching": bool(args.prefix_caching or args.url),
         "stall_prefill_s": args.stall_prefill,
         "results": [{k: v for k, v in asdict(r).items() if k != "log"} for r in results]}, indent=2))
    if args.json:
        print((out / "results.json").read_text())
    else:
        extra = (f"; gateway {' '.join(args.gateway_arg)}" if args.gateway_arg else "") + (
            f"; prefill stalled until queued + {args.stall_prefill:g} s" if args.stall_prefill is not None else "")
        print(format_table(results, load, f"model {args.model}{extra}; reports in {out}"))
    return 0 if all(r.all_ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
