"""`pdqueue up` as a supervisor, as a user meets it: real `up`, worker and gateway processes,
a real embedded Redis, real signals (SIGKILL of a worker, SIGINT/SIGTERM of `up`), a real
broken pipe.

- A worker killed mid-answer is started again under its worker id: it takes back what it
  held (``Recovery.own_pending``), and the answer completes once, token for token as
  without the kill. `up` says so, and keeps the dead process's log.
- A worker that keeps dying ends in a crash loop: given up on; `up` goes on while another
  worker has its role, and stops (exit 1, the log's tail and path) when none is left.
- Ctrl-C right after a kill does not wait for the dead worker.
- The gateway is the first to get SIGTERM and the last to exit, before the server.
- `up | head -5` does not kill `up`; `up --print-env`/`--print-url` give its password.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from pdqueue.client import Client, RequestFailed
from pdqueue.config import RedisConfig
from pdqueue.discovery import state_url
from pdqueue.keys import Keys
from pdqueue.queue.redis_server import free_port
from tests.test_cli import LONG_PROMPT, ROOT, TINY, Up, gone, pdq
from workers.cli.local_cluster import CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW_S


def wait_for(predicate, timeout: float, what: str, up: Up | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if up is not None:
            assert up.proc.poll() is None, f"up exited with {up.proc.returncode} waiting for {what}:\n{up.output}"
        assert time.monotonic() < deadline, f"no {what} within {timeout}s" + (f":\n{up.output}" if up else "")
        time.sleep(0.05)


def worker_of(state: dict, role: str, index: int = 0) -> dict:
    return [w for w in state["workers"] if w["role"] == role][index]


def listed_role(up: Up, worker_id: str) -> str:
    """The role the state file of `up` lists for ``worker_id``."""
    return {w["worker_id"]: w["role"] for w in json.loads(up.state_path.read_text())["workers"]}[worker_id]


def heartbeat_pid(state: dict, worker_id: str) -> int | None:
    with redis.Redis.from_url(state_url(state)) as r:
        pid = r.hget(Keys(state["cluster"]).worker(worker_id), "pid")
    return int(pid) if pid is not None else None


def test_a_decode_worker_killed_mid_answer_is_restarted_and_the_answer_completes_as_without_the_kill(tmp_path, env):
    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--no-gateway", *TINY)
    try:
        state = up.wait_ready()
        decode = worker_of(state, "decode")
        wid, old_pid = decode["worker_id"], decode["pid"]
        with Client(state_url(state), config=RedisConfig(unavailable_after_s=30)) as client:
            reference = client.submit(LONG_PROMPT, max_tokens=1200, temperature=0, ignore_eos=True).result(timeout=120)
            handle = client.submit(LONG_PROMPT, max_tokens=1200, temperature=0, ignore_eos=True)
            events = handle.stream(timeout=120)
            streamed = [next(events) for _ in range(40)]   # decoding is under way
            os.kill(old_pid, signal.SIGKILL)
            streamed += list(events)
            completion = handle.completion
            # Answered once, by the restarted worker under the same id, token for token.
            ids = [t for e in streamed for t in e.token_ids]
            assert ids == list(completion.token_ids) == list(reference.token_ids), "tokens differ from the reference"
            assert [e.index for e in streamed] == sorted({e.index for e in streamed})
            assert completion.decode_worker == wid and completion.transfer_path == "recompute"
            raw = client.redis.xrange(client.keys.out(handle.request_id))
            kinds = [f[b"type"] for _, f in raw]
            assert kinds.count(b"done") == 1 and b"error" not in kinds
            token_entries = sorted((int(f[b"index"]), len(json.loads(f[b"token_ids"]))) for _, f in raw
                                   if f[b"type"] == b"token")
            covered = [i for start, n in token_entries for i in range(start, start + n)]
            assert covered == list(range(1200)), "a token position published twice or never"
        # Back: a heartbeat under the same worker id from a new process, in the state file too.
        new_pid = wait_for(lambda: (heartbeat_pid(state, wid) or old_pid) != old_pid and heartbeat_pid(state, wid),
                           30, "the restarted worker's heartbeat", up)
        assert gone(old_pid)
        assert worker_of(json.loads(up.state_path.read_text()), "decode")["pid"] == new_pid
        err = up.err_path.read_text()
        assert re.search(rf"^{wid} exited \(-9\) after [\d.]+ s; restarting in 1 s \(restart 1\)$", err, re.M), err
        assert f"{wid} restarted (restart 1, pid {new_pid}, as decode)" in err, err
        assert f"{wid} is back (restart 1, pid {new_pid}, decode;" in err, err
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.output
    finally:
        up.ensure_stopped()
    err = up.err_path.read_text()
    assert "Traceback" not in up.output, up.output
    assert f"processes that died while up ran: {wid} (exited -9)" in err, err
    # The dead process's log is kept (not removed with the temporary directory), and `up` says where.
    kept = Path(re.search(r"\(logs kept in (\S+)\)$", err, re.M).group(1))
    assert kept == Path(state["log_dir"]) and kept.is_dir()
    log = (kept / f"{wid}.log").read_text()
    assert f"---- pdqueue up: restart 1 of {wid} " in log and f"resuming {handle.request_id} after " in log
    assert "restarting in 1 s (restart 1)" in (kept / "up.log").read_text()
    shutil.rmtree(kept)
    assert not up.state_path.exists() and gone(new_pid)


def test_ctrl_c_right_after_a_kill_does_not_wait_for_the_dead_worker(tmp_path, env):
    """The decode worker dies with a request in hand and `up` is stopped at once: no restart,
    no 30 s of waiting for progress that nobody can make; the request gets an error now."""
    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--no-gateway", *TINY)
    try:
        state = up.wait_ready()
        decode = worker_of(state, "decode")
        with Client(state_url(state), config=RedisConfig(unavailable_after_s=60)) as client:
            handle = client.submit(LONG_PROMPT, max_tokens=2000, temperature=0, ignore_eos=True)
            events = handle.stream(timeout=120)
            next(events)
            os.kill(decode["pid"], signal.SIGKILL)
            up.proc.send_signal(signal.SIGINT)
            stopped_at = time.monotonic()
            with pytest.raises(RequestFailed) as failed:
                list(events)
            assert failed.value.code == "unavailable"
        assert up.proc.wait(60) == 0, up.output
        took = time.monotonic() - stopped_at
    finally:
        up.ensure_stopped()
    err = up.err_path.read_text()
    assert took < 15, f"the stop took {took:.1f}s:\n{err}"
    assert "1 request for a decode worker, and none is running: stopping with 1 left" in err, err
    assert "stopping 1 prefill worker (cold: no decode worker is left to take its KV)" in err, err
    assert f"{decode['worker_id']} restarted" not in err and "SIGKILL" not in err and "no progress" not in err, err
    assert "Traceback" not in up.output
    kept = re.search(r"\(logs kept in (\S+)\)$", err, re.M)
    assert kept, err
    kept = Path(kept.group(1))
    assert (kept / f"{decode['worker_id']}.log").exists()
    shutil.rmtree(kept)


def test_a_worker_that_keeps_dying_is_given_up_on_and_up_stops_when_its_role_has_nobody(tmp_path, env):
    """A sitecustomize on the workers' PYTHONPATH ends, at its start, every worker process
    whose id is listed in a file the test writes: the first processes start well, their
    restarts die. decode-1 is given up on while decode-0 still has the role (up goes on);
    then decode-0 too, and with no decode worker left `up` stops, with the log's tail. The
    first restart's delay is 0.1 s (--restart-backoff-s; the default 1 s is the first test's),
    doubling per restart as it does from 1 s: 3 s of delays per crash loop instead of 31."""
    site, crash = tmp_path / "site", tmp_path / "crash-ids"
    site.mkdir()
    crash.write_text("")
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if sys.argv[1:2] == ['worker'] and '--worker-id' in sys.argv:\n"
        f"    ids = open({str(crash)!r}).read().split()\n"
        "    if sys.argv[sys.argv.index('--worker-id') + 1] in ids:\n"
        "        print('simulated crash at start', file=sys.stderr)\n"
        "        os._exit(3)\n")
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))}
    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--no-gateway", "--decode", "2",
            "--restart-backoff-s", "0.1", *TINY)
    try:
        state = up.wait_ready()
        d0, d1 = worker_of(state, "decode", 0), worker_of(state, "decode", 1)
        crash.write_text(f"{d1['worker_id']}\n")
        os.kill(d1["pid"], signal.SIGKILL)
        goes_on = f"up goes on without {d1['worker_id']}: 1 prefill + 1 decode workers left"
        wait_for(lambda: goes_on in up.err_path.read_text(), CRASH_LOOP_WINDOW_S + 30, "the first crash loop", up)
        # The other decode worker still answers.
        with Client(state_url(state)) as client:
            answer = client.submit("hello", max_tokens=4, temperature=0).result(timeout=60)
            assert answer.decode_worker == d0["worker_id"]
        crash.write_text(f"{d1['worker_id']}\n{d0['worker_id']}\n")
        os.kill(d0["pid"], signal.SIGKILL)
        assert up.proc.wait(CRASH_LOOP_WINDOW_S + 60) == 1, up.output
    finally:
        up.ensure_stopped()
    err = up.err_path.read_text()
    assert "Traceback" not in up.output, up.output
    for d in (d0, d1):
        delays = re.findall(rf"^{d['worker_id']} exited \(\S+\) after [\d.]+ s; "
                            rf"restarting in ([\d.]+) s \(restart \d\)$", err, re.M)
        assert delays == ["0.1", "0.2", "0.4", "0.8", "1.6"][:CRASH_LOOP_RESTARTS], (d["worker_id"], delays, err)
        assert re.search(rf"^{d['worker_id']} exited \(3\) after [\d.]+ s: a crash loop \({CRASH_LOOP_RESTARTS} "
                         rf"restarts within {CRASH_LOOP_WINDOW_S:g} s\), not restarted again; its log: \S+\.log$",
                         err, re.M), err
    assert "simulated crash at start" in err   # the log's tail, under the message
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {d0['worker_id']} is in a crash loop ({CRASH_LOOP_RESTARTS} restarts within "
                           f"{CRASH_LOOP_WINDOW_S:g} s) and no decode worker is left: stopping (its log: "), last
    log = Path(re.search(r"\(its log: (\S+)\)$", last).group(1))
    assert log.read_text().count("---- pdqueue up: restart ") == CRASH_LOOP_RESTARTS
    shutil.rmtree(log.parent)
    assert not up.state_path.exists() and gone(state["server_pid"])


def _stream_completion(url: str, max_tokens: int, lines: list, ended: threading.Event) -> None:
    """POST a streamed completion; every SSE line into ``lines``; ``ended`` when it closes."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
             "ignore_eos": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        lines.append(f"status {response.status}")
        for raw in response:
            if raw.strip():
                lines.append(raw.decode().strip())
    except (OSError, http.client.HTTPException) as exc:
        lines.append(f"connection: {exc!r}")
    finally:
        conn.close()
        ended.set()


def test_the_gateway_takes_sigterm_first_and_exits_last_with_its_open_answer_complete(tmp_path, env):
    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--gateway-port", "0", *TINY)
    try:
        state = up.wait_ready()
        lines, ended = [], threading.Event()
        threading.Thread(target=_stream_completion, args=(state["gateway_url"], 800, lines, ended), daemon=True).start()
        wait_for(lambda: len(lines) > 20, 60, "streamed chunks", up)
        up.proc.send_signal(signal.SIGINT)
        assert ended.wait(90), lines[-3:]
        assert up.proc.wait(60) == 0, up.output
    finally:
        up.ensure_stopped()
    assert lines[0] == "status 200" and lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line[6:]) for line in lines[1:-1] if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    err = up.err_path.read_text().splitlines()
    order = ["the gateway takes no new requests; its open answers run to their end",
             "stopping 1 prefill worker (warm: work in hand finishes)",
             "stopping 1 decode worker (warm: work in hand finishes)",
             "stopping the Redis server"]
    assert [err.index(line) for line in order] == sorted(err.index(line) for line in order), err
    stopped = next(i for i, line in enumerate(err) if line.startswith("the gateway stopped (status "))
    assert stopped < err.index("stopping the Redis server"), err
    assert "Traceback" not in up.output and "SIGKILL" not in "".join(err)


def test_a_second_ctrl_c_is_the_gateways_second_sigterm(tmp_path, env):
    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--gateway-port", "0", *TINY)
    try:
        state = up.wait_ready()
        lines, ended = [], threading.Event()
        threading.Thread(target=_stream_completion, args=(state["gateway_url"], 4000, lines, ended),
                         daemon=True).start()
        wait_for(lambda: len(lines) > 20, 60, "streamed chunks", up)
        up.proc.send_signal(signal.SIGINT)
        wait_for(lambda: "answering what is left first" in up.err_path.read_text(), 30, "the drain", up)
        up.proc.send_signal(signal.SIGINT)
        hurried = time.monotonic()
        assert ended.wait(30), lines[-3:]
        took = time.monotonic() - hurried
        assert up.proc.wait(60) == 0, up.output
    finally:
        up.ensure_stopped()
    assert took < 10, f"the open answer ended {took:.1f}s after the second Ctrl-C"
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert not any(c.get("choices") and c["choices"][0].get("finish_reason") == "length" for c in chunks)
    err = up.err_path.read_text()
    assert "the gateway fails its open answers and exits (second SIGTERM)" in err, err
    assert "Traceback" not in up.output and "SIGKILL" not in err, err


def test_up_piped_into_head_outlives_the_pipe_and_stops_in_order(tmp_path, env):
    """`pdqueue up 2>&1 | head -5`: once head has gone, writes meet a broken pipe; `up` goes
    on without a console (here it restarts a killed worker, and says so in up.log), and
    SIGTERM stops it in order (the server after the workers, the state file removed)."""
    log_dir, rc_file, head_file = tmp_path / "logs", tmp_path / "rc", tmp_path / "head"
    command = " ".join([sys.executable, "-m", "workers", "up", "--redis-port", str(free_port()), "--no-gateway",
                        "--log-dir", str(log_dir), *TINY])
    pipeline = subprocess.Popen(["bash", "-c", f"{command} 2>&1 | head -5 > {head_file}; "
                                               f"echo ${{PIPESTATUS[0]}} > {rc_file}"],
                                stdout=subprocess.DEVNULL, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    state_path = Path(env["XDG_RUNTIME_DIR"]) / "pdqueue" / "up-default.json"
    try:
        state = json.loads(wait_for(lambda: state_path.exists() and state_path.read_text(), 60, "the state file"))
        wait_for(lambda: all(heartbeat_pid(state, w["worker_id"]) for w in state["workers"]), 120, "registration")
        wait_for(lambda: head_file.exists() and len(head_file.read_text().splitlines()) == 5, 30, "head's 5 lines")
        head = head_file.read_text().splitlines()
        assert head[0].startswith("pdqueue up: "), head
        wait_for(lambda: subprocess.run(["pgrep", "-g", str(pipeline.pid), "-x", "head"]).returncode == 1, 30,
                 "head's exit")
        # The console is gone; the supervisor is not: the line about this restart meets the broken pipe.
        decode = worker_of(state, "decode")
        os.kill(decode["pid"], signal.SIGKILL)
        events = log_dir / "up.log"
        wait_for(lambda: events.exists() and f"{decode['worker_id']} is back" in events.read_text(), 60,
                 "the restarted decode worker")
        assert heartbeat_pid(state, decode["worker_id"]) not in (None, decode["pid"])
        result = pdq("submit", "hello", "--max-tokens", "4", "--temperature", "0", "--json", env=env)
        assert result.returncode == 0 and json.loads(result.stdout)["num_tokens"] == 4, result.stderr
        assert pipeline.poll() is None and not rc_file.exists()
        os.kill(state["pid"], signal.SIGTERM)
        assert pipeline.wait(90) == 0
    finally:
        if pipeline.poll() is None:
            os.killpg(pipeline.pid, signal.SIGKILL)
    assert rc_file.read_text().strip() == "0"   # up's own exit status
    for pid in [state["pid"], state["server_pid"], *(w["pid"] for w in state["workers"])]:
        assert gone(pid), f"process {pid} is still running"
    assert not state_path.exists()
    assert f"{decode['worker_id']} exited (-9) after " in events.read_text()
    logs = "".join(p.read_text(errors="replace") for p in log_dir.glob("*.log"))
    assert "redis unavailable" not in logs.lower(), logs[-3000:]   # the server went after the workers
    assert logs.count(" stopped") >= 2   # each worker's warm stop ran to its end


def test_print_env_and_print_url_give_redis_cli_the_running_ups_password(tmp_path, env):
    password_file = tmp_path / "redis.pw"
    password_file.write_text("s3cret-for-the-test\n")
    password_file.chmod(0o600)
    env = {**env, "PDQ_API_KEY": "k-for-the-test"}
    port = free_port()
    assert_no_cluster = pdq("up", "--print-env", env=env)
    assert assert_no_cluster.returncode == 1 and "no local cluster 'default' is up" in assert_no_cluster.stderr
    up = Up(tmp_path, env, "--redis-port", str(port), "--gateway-port", "0", "--redis-password-file",
            str(password_file), *TINY)
    try:
        state = up.wait_ready()
        out = up.out_path.read_text()
        assert f"the password of {password_file}, kept in the state file" in up.first_line, up.first_line
        assert f"redis-cli: eval \"$(pdqueue up --print-env)\"; redis-cli -p {port} PING" in out, out
        assert "API key required: PDQ_API_KEY" in out, out
        printed = pdq("up", "--print-url", env=env)
        assert printed.returncode == 0 and printed.stdout.strip() == f"redis://127.0.0.1:{port}/0", printed
        with_password = pdq("up", "--print-url", "--show-password", env=env).stdout.strip()
        assert with_password == f"redis://:s3cret-for-the-test@127.0.0.1:{port}/0"
        with redis.Redis.from_url(with_password) as r:
            assert r.ping()
        shell = pdq("up", "--print-env", env=env)
        assert shell.returncode == 0 and "export REDISCLI_AUTH=s3cret-for-the-test" in shell.stdout, shell.stdout
        if shutil.which("redis-cli"):
            ping = subprocess.run(["bash", "-c", f'eval "$({sys.executable} -m workers up --print-env)"; '
                                                 f"redis-cli -p {port} PING"],
                                  capture_output=True, text=True, env=env, cwd=ROOT, timeout=30)
            assert ping.stdout.strip() == "PONG", (ping.stdout, ping.stderr)
        host, gw_port = state["gateway_url"].split("//", 1)[1].rsplit(":", 1)
        for headers, status in (({}, 401), ({"Authorization": "Bearer k-for-the-test"}, 200)):
            conn = http.client.HTTPConnection(host, int(gw_port), timeout=10)
            conn.request("GET", "/v1/models", headers=headers)
            assert conn.getresponse().status == status
            conn.close()
        assert pdq("up", "--show-password", env=env).returncode == 1
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.output
    finally:
        up.ensure_stopped()
    assert "s3cret-for-the-test" not in up.output


def test_under_adapt_a_restarted_worker_comes_back_in_the_role_it_was_switched_to(tmp_path, env):
    """`--adapt` moves workers between roles; one that dies comes back in the role it ran
    (its heartbeat's), where the entries it held are, not in the role it started in."""
    from pdqueue.control import commands

    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--no-gateway", "--decode", "2", "--adapt",
            "--dwell-s", "600", *TINY)
    try:
        state = up.wait_ready()
        keys, d1 = Keys(state["cluster"]), worker_of(state, "decode", 1)
        with redis.Redis.from_url(state_url(state), decode_responses=True) as r:
            epoch = int(r.hget(keys.worker(d1["worker_id"]), "role_epoch"))
            command = commands.send_switch(r, keys, d1["worker_id"], "colocated", epoch, by="test")
            assert commands.wait_switch(r, keys, command, timeout_s=60)["status"] == "done"
            # The supervisor has seen the new role (it reads the heartbeats every second) once
            # the state file lists it.
            wait_for(lambda: listed_role(up, d1["worker_id"]) == "colocated", 30, "the new role in the state file", up)
            os.kill(d1["pid"], signal.SIGKILL)
            wait_for(lambda: f"{d1['worker_id']} is back" in up.err_path.read_text(), 60, "the restart", up)
            assert r.hget(keys.worker(d1["worker_id"]), "role") == "colocated"
        assert re.search(rf"^{d1['worker_id']} restarted \(restart 1, pid \d+, as colocated\)$",
                         up.err_path.read_text(), re.M), up.output
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.output
    finally:
        up.ensure_stopped()
    assert "Traceback" not in up.output
    kept = re.search(r"\(logs kept in (\S+)\)$", up.err_path.read_text(), re.M)
    assert kept, up.output
    shutil.rmtree(kept.group(1))


def test_a_killed_gateway_comes_back_on_the_url_up_printed(tmp_path, env):
    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--gateway-port", "0", *TINY)
    try:
        state = up.wait_ready()
        url = state["gateway_url"]
        assert f"OpenAI API: {url}/v1 " in up.out_path.read_text()
        os.kill(state["gateway_pid"], signal.SIGKILL)
        wait_for(lambda: "gateway is back (restart 1" in up.err_path.read_text(), 60, "the gateway's restart", up)
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200
        conn.close()
        assert re.search(r"^gateway exited \(-9\) after [\d.]+ s; restarting in 1 s \(restart 1\)$",
                         up.err_path.read_text(), re.M), up.output
        assert json.loads(up.state_path.read_text())["gateway_pid"] not in (None, state["gateway_pid"])
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.output
    finally:
        up.ensure_stopped()
    kept = re.search(r"\(logs kept in (\S+)\)$", up.err_path.read_text(), re.M)
    assert kept and "gateway (exited -9)" in up.err_path.read_text(), up.output
    shutil.rmtree(kept.group(1))
