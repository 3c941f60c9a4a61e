"""Smoke tests of the benches: they run end to end and print the JSON that later runs compare
against. They check shape, not speed (benchmarks are commands, not timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys

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
