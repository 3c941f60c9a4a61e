"""Smoke tests of the benches: they run end to end and print the JSON that later runs compare
against. They check shape, not speed (benchmarks are commands, not timed tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cluster import ROOT

pytestmark = pytest.mark.timeout(180)


def pdqueue(*args: str, timeout: float = 150, python: tuple[str, ...] = ("-m", "workers.cli"),
            stderr: list | None = None) -> dict:
    proc = subprocess.run([sys.executable, *python, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    return json.loads(proc.stdout)


# `pdqueue` in a process where `import nixl_cu12` fails, as on an install without pdqueue[rdma]
# (None in sys.modules makes the import raise ImportError; nothing else is changed).
WITHOUT_NIXL = ("-c", "import sys; sys.modules['nixl_cu12'] = None; sys.argv[0] = 'pdqueue'; "
                      "from workers.cli import main; main()")


@pytest.mark.parametrize("nixl", ["as-installed", "hidden"])
def test_transfer_quick_json_has_the_ratios(nixl):
    from pdqueue.transfer.nixl import nixl_missing

    if nixl == "hidden" and nixl_missing() is not None:
        pytest.skip(f"NIXL is not installed here, so the as-installed run is this case ({nixl_missing()})")
    stderr: list[str] = []
    result = pdqueue("bench", "transfer", "--quick", "--json", "--repeats", "2", stderr=stderr,
                     python=WITHOUT_NIXL if nixl == "hidden" else ("-m", "workers.cli"))
    assert {"shm_vs_memcpy", "zmq_vs_raw_socket", "zmq_vs_grpc", "tcp_vs_raw_socket"} <= set(result["ratios"])
    assert result["ratios_at"] == {"layout": "smollm2", "tokens": 512, "bytes": 512 // 16 * 60 * 16 * 3 * 64 * 4}
    assert [row["tokens"] for row in result["sizes"]] == [128, 512]   # every size ran, not only the first
    for row in result["sizes"]:
        assert {"memcpy", "shm", "tcp", "zmq", "raw_socket"} <= set(row["paths"])
        assert all(p["gb_s"] > 0 for p in row["paths"].values())
    assert all(result["ratios"][name] > 0 for name in ("shm_vs_memcpy", "zmq_vs_raw_socket", "tcp_vs_raw_socket"))
    if nixl == "as-installed" and nixl_missing() is None:   # pdqueue[rdma]: the nixl path runs, names UCX's transports
        assert all("nixl" in row["paths"] for row in result["sizes"]) and result["ratios"]["nixl_vs_raw_socket"] > 0
        assert result["nixl_transports"] and all("(" in lanes for lanes in result["nixl_transports"])
        assert "nixl" not in result["skipped"]
    else:   # skipped, saying why and how to get it, once on stderr and in the JSON
        assert all("nixl" not in row["paths"] for row in result["sizes"])
        assert result["ratios"]["nixl_vs_raw_socket"] is None
        assert "pip install 'pdqueue[rdma]'" in result["skipped"]["nixl"]
        lines = [line for line in stderr[0].splitlines() if "nixl" in line]
        assert len(lines) == 1 and "skipping the nixl path" in lines[0] and "pdqueue[rdma]" in lines[0], stderr[0]


def test_serve_tiny_json_has_the_figures_per_mode(tmp_path):
    result = pdqueue("bench", "serve", "--model", "tiny", "--rates", "4", "--num-requests", "4",
                     "--warmup", "1", "--json", "--out", str(tmp_path))
    assert set(result["modes"]) == {"disagg", "colocated-prefill-first", "colocated-chunked"}
    for mode, figures in result["modes"].items():
        for name in ("ttft_ms", "tbt_ms"):
            assert set(figures[name]) >= {"p50", "p90", "p99"}, (mode, name)
        assert figures["throughput_tok_s"] > 0 and figures["goodput_rps"] >= 0
        assert figures["completed"] == figures["requests"] == 4, figures["errors"]
        assert set(figures["queue_overhead_ms"]) >= {"p50", "p99"}
        assert figures["by_rate"]["4"]["tbt_ms"]["p50"] > 0
    assert (tmp_path / "serve.json").exists()


def test_serve_runs_the_elastic_split_with_options_by_side(tmp_path):
    """The elastic mode's workers differ by side (the decode worker takes prompts, int4):
    both start with their own options, and every request is answered."""
    result = pdqueue("bench", "serve", "--model", "tiny", "--modes", "elastic", "--rates", "4", "--num-requests", "4",
                     "--warmup", "1", "--json", "--out", str(tmp_path))
    assert result["modes"]["elastic"]["completed"] == 4, result["modes"]["elastic"]["errors"]
    # the timeline of the run (what --out plots): each worker's role and levers from its heartbeat
    timeline = result["raw"]["elastic"]["4"]["timeline"]
    assert timeline and all({"t", "workers", "request_backlog", "handoff_backlog"} <= set(p) for p in timeline)
    decode = [w for p in timeline for w in p["workers"].values() if w["role"] == "decode"]
    assert decode and all("spare" in w and "prompt_tok_s" in w for w in decode), decode
    (decode_log,) = (tmp_path / "logs" / "elastic").glob("decode-*.log")
    text = decode_log.read_text()
    assert "weights int4" in text and "takes prompts" in text, text


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_serve_stopped_with_sigterm_leaves_no_worker_behind(tmp_path, when):
    """The bench's workers run in their own sessions: a SIGTERM to the bench must stop them
    (and its Redis server) as Ctrl-C does, whether it comes while they start (before they
    registered: a fresh clone's first model load is slow) or while the load runs."""
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "bench", "serve", "--model", "tiny", "--modes",
                             "disagg", "--rates", "50", "--num-requests", "5000", "--warmup", "0",
                             "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = str(tmp_path / "logs")   # every worker of this bench has its log under it

    def ours() -> list[int]:
        out = subprocess.run(["pgrep", "-f", "--", "workers worker"], capture_output=True, text=True).stdout
        pids = []
        for pid in out.split():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if marker.encode() in env or marker.encode() in cmdline or _log_in(pid, marker):
                pids.append(int(pid))
        return pids

    deadline = time.monotonic() + 120
    while len(ours()) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert len(ours()) == 2, "the bench's two workers never started"
    workers = ours()
    if when == "serving":
        logs = tmp_path / "logs" / "disagg"
        wait_until(lambda: sum("ready" in p.read_text(errors="replace") for p in logs.glob("*.log")) == 2, 120,
                   "both workers ready")
        time.sleep(3)   # the bench is sending its requests
    else:
        ready = [p.name for p in (tmp_path / "logs").rglob("*.log") if " ready" in p.read_text(errors="replace")]
        assert not ready, f"{ready} were ready already: this is not the starting case"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=90)
    # The bench stops its workers itself before it exits (PDEATHSIG, which would also end
    # them once it is gone, is the net for a bench killed outright, not the way it stops).
    assert [pid for pid in workers if _alive(pid)] == [], "the bench exited before its workers had stopped"
    assert ours() == [], "workers left running after the bench got SIGTERM"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has no Task.cancelling(): a cancellation "
                    "that redis-py drops cannot be told from none there")
def test_the_timeline_sampler_stops_when_cancelled_mid_read(redis_url):
    """The bench's timeline sampler is cancelled when the load ends, or when a SIGTERM ends
    the bench; ``asyncio.run`` then waits for it. A cancellation landing in one of its Redis
    reads could be dropped by redis.asyncio (Python 3.11, redis-py 8.2: about one in twenty
    here), and the sampler then sampled for ever: the SIGTERM test's bench never exited."""
    import asyncio

    import redis as redis_sync

    from pdqueue.bench.serve_bench import _sample_timeline
    from pdqueue.keys import Keys

    keys = Keys("sampled")
    r = redis_sync.Redis.from_url(redis_url)
    for i in range(30):   # enough workers that a round's reads take a while
        r.hset(keys.worker(f"w{i}"), mapping={"role": "decode", "load": json.dumps({"running": i})})

    async def main():
        for i in range(120):
            timeline: list[dict] = []
            task = asyncio.ensure_future(_sample_timeline(redis_url, "sampled", timeline, every_s=0.5))
            await asyncio.sleep(0.0005 * (i % 11))
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=3.0)
            assert done and task.cancelled(), f"round {i}: the cancelled sampler kept sampling"

    try:
        asyncio.run(main())
    finally:
        r.delete(*[keys.worker(f"w{i}") for i in range(30)])


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _log_in(pid: str, marker: str) -> bool:
    """Whether the process writes into a file under ``marker`` (its log)."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(marker) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


TWO_TENANTS = """
[tenants.chat]
api_keys = ["sk-chat"]
requests_per_s = 50

[tenants.flood]
api_keys = ["sk-flood"]
requests_per_s = 2
burst_s = 1
"""


def test_serve_two_tenants_reports_each_tenants_figures_and_they_add_up(tmp_path):
    """A tenants run on the tiny model: a gateway with two tenants in front of 1 prefill + 1
    decode worker; chat sends 4 req/s within its limit, flood 20 req/s against its 2 req/s
    limit, for 2 s. Per tenant: sent = answered + 429s + failed, each tenant sent what its
    rate gives, flood's excess refused with 429 and none of chat's; TTFT figures for both."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TWO_TENANTS)
    result = pdqueue("bench", "serve", "--model", "tiny", "--modes", "disagg", "--tenants", str(tenants),
                     "--tenant-rates", "chat=4,flood=20", "--duration", "2", "--warmup", "1", "--json",
                     "--out", str(tmp_path / "out"))
    assert result["kind"] == "tenants" and result["tenant_rates"] == {"chat": 4, "flood": 20}
    figures = result["modes"]["disagg"]["tenants"]
    assert set(figures) == {"chat", "flood"}
    for name, f in figures.items():
        assert f["sent"] == f["answered"] + f["rate_limited"] + f["failed"], (name, f)
        assert f["admitted"] == f["sent"] - f["rate_limited"], (name, f)
        assert f["failed"] == 0, (name, f["errors"])
        assert f["ttft_ms"]["n"] == f["answered"] > 0 and 0 < f["ttft_ms"]["p50"] <= f["ttft_ms"]["p99"], (name, f)
        assert 0 <= f["slo_met"] <= f["admitted"] and f["slo_attainment"] == pytest.approx(f["slo_met"] / f["admitted"],
                                                                                           abs=1e-3)
        assert isinstance(f["ttft_p99_within_slo"], bool)
    assert figures["chat"]["sent"] == 8 and figures["flood"]["sent"] == 40     # rate x duration each
    assert figures["chat"]["rate_limited"] == 0 and figures["chat"]["answered"] == 8
    # flood: its bucket (2 at once, then 2 a second) lets in about 2 + 2 x 2 s of its 40
    assert figures["flood"]["rate_limited"] >= 25 and figures["flood"]["answered"] >= 2, figures["flood"]
    assert (tmp_path / "out" / "serve.json").exists()


def test_serve_tenant_options_are_checked(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TWO_TENANTS)
    for args, says in ((("--tenant-rates", "chat=1,flood=5"), "needs --duration"),
                       (("--tenant-rates", "chat=1,bob=5", "--duration", "2"), "'bob' is not a tenant of"),
                       (("--tenant-rates", "chat=0", "--duration", "2"), "expected TENANT=RATE with a rate > 0"),
                       (("--tenant-rates", "chat=1", "--duration", "2", "--num-requests", "4"),
                        "cannot be combined with --num-requests")):
        proc = subprocess.run([sys.executable, "-m", "workers.cli", "bench", "serve", "--model", "tiny",
                               "--tenants", str(tenants), *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode != 0 and says in proc.stderr, (args, proc.stderr[-500:])


def test_serve_batch_with_a_worker_killed_and_redis_restarted_answers_every_line_once(tmp_path):
    """``--chaos`` on the tiny model (issue 27): 48 batch lines beside a short chat load;
    0.3 s in, the decode worker is SIGKILLed (the bench's supervisor starts it again), 0.5 s
    in, the bench's Redis server is restarted on its port (AOF: the streams come back). Every
    batch line is still answered exactly once (on ``done`` and on its ``out:<id>``, with all
    its tokens), some of them after the kill (the backlog outlived both), and the report says
    what each event did beside the chat figures."""
    stderr: list[str] = []
    result = pdqueue("bench", "serve", "--model", "tiny", "--modes", "disagg", "--rates", "4", "--num-requests", "6",
                     "--warmup", "1", "--batch-lines", "48", "--batch-max-tokens", "128",
                     "--chaos", "kill-worker@0.3,restart-redis@0.5", "--json", "--out", str(tmp_path), stderr=stderr)
    assert result["chaos"] == {"events": "kill-worker@0.3,restart-redis@0.5",
                               "redis": "appendonly yes, appendfsync everysec", "supervised": True}
    figures = result["modes"]["disagg"]["by_rate"]["4"]
    kill, restart = figures["chaos"]
    assert kill["event"] == "kill-worker" and kill["role"] == "decode" and kill["at_s"] >= 0.3, kill
    assert kill["back_after_s"] is not None and kill["restarts"] == 1, kill
    assert restart["event"] == "restart-redis" and restart["pid"] != restart["old_pid"], restart
    assert restart["away_s"] < 10, restart
    batch = figures["batch"]
    assert batch["exactly_once"] and batch["answered"] == batch["lines"] == 48, batch
    assert batch["duplicates"] == batch["missing"] == batch["out_not_once"] == batch["short"] == 0, batch
    assert batch["all_answered_after_s"] > kill["at_s"], "the batch backlog should outlive the kill"
    assert figures["requests"] == 6 and set(figures["ttft_ms"]) >= {"p50", "p99"}   # the chat figures, with the chaos
    assert "chaos kill-worker at" in stderr[0] and "every line answered once" in stderr[0], stderr[0][-2000:]
    up_log = (tmp_path / "logs" / "disagg" / "up.log").read_text()
    assert f"{kill['worker_id']} exited (-9)" in up_log and f"{kill['worker_id']} is back" in up_log, up_log


def test_serve_chaos_rolling_restart_then_zero_capacity_fail_no_request_beside_a_baseline(tmp_path):
    """``--chaos rolling-restart@0.3,zero-capacity:1@0.3 --chaos-alternate 1`` (issue 42) on the
    disagg mode: a run without the events, then one where the bench's supervisor rolls both
    workers (pdqueue restart's own roll, supervisor/rolling.py: one at a time, under new ids)
    and, once the roll is done, every prefill-capable worker (the new prefill worker) is stopped
    warm for 1 s and started again under a new id (the requests wait in the queue). In neither
    run does an online request fail or a batch line go lost or doubled; the figures say what
    each event did, the TTFT of the requests that arrived during them, and set the runs side by
    side. (One invocation for both events: CI pays for one cluster.)"""
    stderr: list[str] = []
    result = pdqueue("bench", "serve", "--model", "tiny", "--modes", "disagg", "--rates", "4", "--num-requests", "6",
                     "--warmup", "1", "--batch-lines", "8", "--batch-max-tokens", "32",
                     "--chaos", "rolling-restart@0.3,zero-capacity:1@0.3", "--chaos-alternate", "1",
                     "--json", "--out", str(tmp_path), stderr=stderr)
    figures = result["modes"]["disagg"]["by_rate"]["4"]
    roll, outage = figures["chaos"]
    assert roll["event"] == "rolling-restart" and roll["run"] == 2 and roll["status"] == "done", roll
    assert "failure" not in roll and "no gateway" in roll["gateway"], roll
    assert sorted(r["role"] for r in roll["replaced"]) == ["decode", "prefill"], roll
    assert len(roll["new_workers"]) == 2 and not {r["old"] for r in roll["replaced"]} & set(roll["new_workers"])
    assert roll["at_s"] >= 0.3 and roll["until_s"] > roll["at_s"], roll
    # zero-capacity was due at 0.3 s too: it waited for the roll, then stopped the roll's new prefill worker
    assert outage["event"] == "zero-capacity:1" and outage["run"] == 2 and outage["at_s"] >= roll["until_s"], outage
    assert outage["roles"] == ["prefill"] and outage["stopped"][0] in roll["new_workers"], outage
    assert len(outage["started"]) == 1 and outage["started"][0] not in outage["stopped"], outage
    assert outage["outage_end_s"] >= outage["at_s"] + 1, outage
    assert outage["capacity_back_s"] is not None and outage["capacity_back_s"] >= outage["outage_end_s"], outage
    assert [(r["run"], r["chaos"]) for r in figures["runs"]] == [(1, False), (2, True)], figures["runs"]
    for run in figures["runs"]:
        assert run["errors"] == run["lost"] == run["doubled"] == run["out_not_once"] == 0, run
    assert figures["runs"][1]["ttft_p99_window_ms"] is not None and figures["runs"][0]["ttft_p99_window_ms"] is None
    assert figures["versus"]["with"]["runs"] == figures["versus"]["without"]["runs"] == 1, figures["versus"]
    assert figures["failed"] == 0 and figures["requests"] == 6, figures["errors"]   # the chaos run's own figures
    assert figures["batch"]["exactly_once"] and figures["batch"]["lines"] == 16, figures["batch"]
    window = figures["chaos_window"]
    assert window["windows_s"] == [[roll["at_s"], roll["until_s"]], [outage["at_s"], outage["until_s"]]], window
    assert window["requests"] >= 1 and window["unanswered"] == 0, window
    assert "chaos run 2: rolling-restart at" in stderr[0] or "chaos rolling-restart at" in stderr[0], stderr[0][-2000:]
    up_log = (tmp_path / "logs" / "disagg" / "up.log").read_text()
    assert "done: 2 processes replaced" in up_log, up_log
    assert f"{outage['stopped'][0]} exited" not in up_log, up_log   # the supervisor did not restart it meanwhile


def test_serve_chaos_options_are_checked():
    for args, says in ((("--chaos", "kill-worker"), "--chaos needs --batch-lines"),
                       (("--chaos", "kill-everything", "--batch-lines", "4"),
                        "expected one of kill-worker, restart-redis"),
                       (("--chaos", "restart-redis:decode", "--batch-lines", "4"), "a role goes with kill-worker only"),
                       (("--chaos", "kill-worker@soon", "--batch-lines", "4"), "@SECONDS must be a number"),
                       (("--chaos", "zero-capacity:soon", "--batch-lines", "4"),
                        "zero-capacity:SECONDS must be a number"),
                       (("--chaos-alternate", "3",), "--chaos-alternate goes with --chaos"),
                       (("--chaos", "kill-worker", "--batch-lines", "4", "--phases", "chat"),
                        "cannot be combined with --phases")):
        proc = subprocess.run([sys.executable, "-m", "workers.cli", "bench", "serve", "--model", "tiny", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and says in proc.stderr, (args, proc.stderr[-500:])
