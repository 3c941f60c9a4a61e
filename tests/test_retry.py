"""pdqueue.retry (capped exponential backoff) and pdqueue.procs (pid liveness): no Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from pdqueue.procs import pid_alive
from pdqueue.retry import Backoff, backoff_delay


def test_delays_double_then_stay_at_the_cap():
    assert [backoff_delay(n, 0.05, 0.5) for n in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]


def test_a_long_outage_does_not_overflow():
    # 0.05 * 2**1024 would raise OverflowError: the delay must stay at the cap instead
    assert backoff_delay(5000, 0.05, 2.0) == 2.0
    assert backoff_delay(5000, 0.05, 2.0, jitter=True) <= 2.0


def test_jitter_stays_within_half_to_full_delay():
    for attempt in (0, 3, 10):
        full = backoff_delay(attempt, 0.05, 2.0)
        delays = [backoff_delay(attempt, 0.05, 2.0, jitter=True) for _ in range(200)]
        assert all(0.5 * full <= d < full for d in delays)
        assert len(set(delays)) > 1


def test_backoff_counts_attempts_and_resets():
    backoff = Backoff(0.05, 0.3)
    assert [backoff.next_delay() for _ in range(4)] == [0.05, 0.1, 0.2, 0.3]
    assert backoff.attempt == 4
    backoff.reset()
    assert backoff.next_delay() == 0.05


def test_a_set_stop_event_ends_the_sleep_at_once():
    backoff = Backoff(10.0, 10.0)
    stop = threading.Event()
    stop.set()
    started = time.monotonic()
    backoff.sleep(stop)
    assert time.monotonic() - started < 0.5
    assert backoff.attempt == 1


def test_setting_the_stop_event_wakes_a_sleeper():
    backoff = Backoff(10.0, 10.0)
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    backoff.sleep(stop)
    assert time.monotonic() - started < 2.0


@pytest.mark.processes
def test_pid_alive():
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is free
    assert not pid_alive(child.pid)


@pytest.mark.processes
def test_neither_module_nor_the_up_supervisor_imports_torch():
    code = ("import sys, pdqueue.retry, pdqueue.procs, workers.cli.local_cluster; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
