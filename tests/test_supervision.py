"""Nothing outlives what it was for: a child started with ``pdqueue.procs.die_with_parent``
ends with its parent, and a worker whose Redis is gone for good stops by itself and frees
its KV pool (``--redis-gone-exit-s``), while an outage shorter than that is ridden out.
Real processes, real Redis servers (killed with SIGKILL, as a crash), nothing mocked.
(``pdqueue bench serve`` stopped with SIGTERM: tests/test_bench.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdqueue.queue.redis_server import RedisServer
from tests.cluster import ROOT, Cluster
from tests.helpers import wait_for
from workers.shell import EXIT_REDIS_GONE

pytestmark = pytest.mark.timeout(180)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_die_with_parent_ends_with_its_parent():
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
                               "from pdqueue.procs import die_with_parent\n"
                               "child = subprocess.Popen(['sleep', '300'], preexec_fn=die_with_parent)\n"
                               "print(child.pid, flush=True)\n"
                               "time.sleep(300)\n"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    try:
        assert _running(child)
        time.sleep(0.5)
        assert _running(child), "the child died while its parent lived"
        parent.kill()   # SIGKILL: the parent runs no cleanup of its own
        parent.wait()
        wait_for(lambda: not _running(child), 10, what="the child to end with its parent")
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def server():
    s = RedisServer().start()
    yield s
    s.stop()


def test_a_worker_rides_out_a_short_outage_and_exits_once_redis_stays_gone(server, tmp_path):
    limit = 6.0
    cluster = Cluster(server.url, tmp_path, cluster="gone")
    cluster.start("prefill", "--redis-gone-exit-s", str(limit))
    proc = cluster.procs["prefill-0"]
    assert cluster.segments(["prefill-0"]), "a prefill worker on CPU keeps its KV pool in /dev/shm"
    try:
        # An outage shorter than the limit, then as long again with Redis back: still serving.
        server.kill()
        time.sleep(limit / 3)
        server.start()   # same port, empty (no persistence): the worker registers again
        back = time.monotonic()
        cluster.wait_registered("prefill-0", timeout=30)
        time.sleep(max(0.0, limit + 2 - (time.monotonic() - back)))
        assert proc.poll() is None, f"the worker exited over a {limit / 3:g} s outage:\n{cluster.log('prefill-0')}"
        assert "prefill-0" in cluster.workers()

        # Redis gone for good: the worker stops within the limit (plus a backoff and its teardown).
        server.kill()
        gone = time.monotonic()
        code = proc.wait(timeout=limit + 30)
        took = time.monotonic() - gone
        log = cluster.log("prefill-0")
        assert code == EXIT_REDIS_GONE, (code, log)
        assert took >= limit - 0.5, f"exited after {took:.1f} s, before the {limit:g} s limit:\n{log}"
        assert "--redis-gone-exit-s" in log and "stopping this worker" in log, log
        assert cluster.segments(["prefill-0"]) == [], "its KV segment is left in /dev/shm"
    finally:
        cluster.kill_all()


def test_a_stop_while_the_worker_waits_for_redis_at_start_ends_it(server, tmp_path):
    """A SIGTERM (a warm stop: also what PDEATHSIG sends when a supervisor dies) that comes
    while a starting worker waits for a Redis that went away ends it, with nothing in hand;
    the warm stop used to be ignored there and the worker retried for ever."""
    cluster = Cluster(server.url, tmp_path, cluster="gone2")
    cluster.start("prefill", "--redis-gone-exit-s", "0", wait=False)   # 0: it would wait for ever
    proc = cluster.procs["prefill-0"]
    try:
        # Redis answers the worker's checks before the model loads (the KV secret is read then);
        # once that is logged, Redis goes, so the role starts without it.
        wait_for(lambda: "KV channels authenticated" in cluster.log("prefill-0") or proc.poll() is not None, 60,
                 what="the worker's checks")
        server.kill()
        wait_for(lambda: "redis unavailable" in cluster.log("prefill-0") or proc.poll() is not None, 60,
                 what="the worker retrying Redis")
        assert proc.poll() is None, cluster.log("prefill-0")
        cluster.signal("prefill-0", signal.SIGTERM)
        code = proc.wait(timeout=20)
        log = cluster.log("prefill-0")
        assert code == 0, (code, log)
        assert "stopped while waiting for Redis" in log, log
        assert cluster.segments(["prefill-0"]) == [], "its KV segment is left in /dev/shm"
    finally:
        cluster.kill_all()
