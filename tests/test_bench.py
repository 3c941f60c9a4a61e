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


def pdqueue(*args: str, timeout: float = 150) -> dict:
    proc = subprocess.run([sys.executable, "-m", "workers.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_transfer_quick_json_has_the_ratios():
    result = pdqueue("bench", "transfer", "--quick", "--json", "--repeats", "2")
    assert {"shm_vs_memcpy", "zmq_vs_raw_socket", "zmq_vs_grpc", "tcp_vs_raw_socket"} <= set(result["ratios"])
    assert result["ratios_at"] == {"layout": "smollm2", "tokens": 512, "bytes": 512 // 16 * 60 * 16 * 3 * 64 * 4}
    for row in result["sizes"]:
        assert {"memcpy", "shm", "tcp", "zmq", "raw_socket"} <= set(row["paths"])
        assert all(p["gb_s"] > 0 for p in row["paths"].values())
    assert all(result["ratios"][name] > 0 for name in ("shm_vs_memcpy", "zmq_vs_raw_socket", "tcp_vs_raw_socket"))
    from pdqueue.transfer.nixl import nixl_missing

    if nixl_missing() is None:   # pdqueue[rdma]: the nixl path runs too, and names UCX's transports
        assert all("nixl" in row["paths"] for row in result["sizes"]) and result["ratios"]["nixl_vs_raw_socket"] > 0
        assert result["nixl_transports"] and all("(" in lanes for lanes in result["nixl_transports"])


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


def test_serve_stopped_with_sigterm_leaves_no_worker_behind(tmp_path):
    """The bench's workers run in their own sessions: a SIGTERM to the bench must stop them
    (and its Redis server) as Ctrl-C does."""
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
        time.sleep(0.5)
    assert len(ours()) == 2, "the bench's two workers never started"
    time.sleep(3)   # the bench is sending its requests
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=90)
    deadline = time.monotonic() + 30
    while ours() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ours() == [], "workers left running after the bench got SIGTERM"


def _log_in(pid: str, marker: str) -> bool:
    """Whether the process writes into a file under ``marker`` (its log)."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(marker) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False
