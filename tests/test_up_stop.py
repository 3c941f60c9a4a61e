"""What a stop of `pdqueue up` leaves its clients, as a user meets it: real `up`, workers and
embedded Redis, a real SIGINT to the terminal's process group.

- Answers computed before (or during) the stop but read after it are not lost: the embedded
  server stays until every answer it holds was read (read receipts, ``Keys.read``), at most
  ``--answer-grace-s``, and `up` says so; it stops as soon as they are read.
- A client whose `up` server is gone for good (here: ``--answer-grace-s 0``, answers left
  unread) fails at once with the reason, instead of retrying for ``unavailable_after_s``.
- A kept log directory's ``up.log`` tells the whole stop.
- README's and the gateway page's word on where `up` prints the gateway's URL holds.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from pdqueue.client import Client, RedisUnavailable
from pdqueue.config import RedisConfig
from pdqueue.discovery import state_url
from pdqueue.queue.redis_server import free_port
from tests.test_cli import ROOT, TINY, Up, gone, submit_long


def wait_for_line(up: Up, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in up.err_path.read_text():
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{up.output}"
        time.sleep(0.05)


def check_readme_gateway_line(out: str, state: dict) -> None:
    """README (its tour) and the gateway's page tell where `up` prints the gateway's URL by the
    line's label, not its number (a banner line more or less moved it: "its third line" was
    the fourth)."""
    for doc in ("README.md", "docs/api/gateway.md"):
        text = (ROOT / doc).read_text()
        assert "`up`'s line `OpenAI API: http://...` gives the URL" in text, doc
        assert not re.search(r"its (first|second|third|fourth|fifth) line prints the URL", text), doc
    match = re.search(r"^  OpenAI API: (http://\S+)/v1 ", out, re.M)
    assert match and match.group(1) == state["gateway_url"], out


def test_answers_read_after_a_ctrl_c_are_all_there(tmp_path, env):
    """The issue's case: requests submitted, `up` stopped with Ctrl-C meanwhile, the results
    read afterwards: all answered, and `up` then stops without waiting out its grace."""
    log_dir = tmp_path / "logs"
    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--log-dir", str(log_dir), *TINY, own_group=True)
    try:
        state = up.wait_ready()
        assert "unread answers are kept 60 s (--answer-grace-s)" in up.out_path.read_text(), up.output
        check_readme_gateway_line(up.out_path.read_text(), state)
        client = Client(state_url(state), config=RedisConfig(unavailable_after_s=10))
        handles = submit_long(client, 3, 150)
        os.killpg(up.proc.pid, signal.SIGINT)
        wait_for_line(up, "keeping the Redis server until 3 answers are read")
        time.sleep(3)   # a client that reads late
        started = time.monotonic()
        assert [h.result(timeout=30).num_tokens for h in handles] == [150] * 3   # nothing lost
        client.close()
        assert up.proc.wait(30) == 0, up.output
        assert time.monotonic() - started < 15, "up waited out its grace although every answer was read"
    finally:
        up.ensure_stopped()
    err = up.err_path.read_text()
    lines = err.splitlines()
    assert lines.index("every answer was read") < lines.index("stopping the Redis server"), err
    assert "Traceback" not in up.output
    assert gone(state["server_pid"])
    # The kept log directory's up.log has the stop sequence too.
    logged = (log_dir / "up.log").read_text()
    for step in ("stopping (Ctrl-C again", "stopping 1 decode worker", "keeping the Redis server until 3 answers",
                 "every answer was read", "stopping the Redis server", "stopped; nothing left running"):
        assert step in logged, (step, logged)


def test_a_client_of_a_stopped_up_fails_at_once_with_the_reason(tmp_path, env, monkeypatch):
    """Answers left unread past the grace (0 here) go with the server: their client, which
    knows the server as `up`'s (the state file), fails at once, not after 30 s per handle."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])   # the user's session: Client() finds `up`
    up = Up(tmp_path, env, "--redis-port", str(free_port()), "--answer-grace-s", "0", *TINY, own_group=True)
    try:
        state = up.wait_ready()
        client = Client()   # (unavailable_after_s: 30 s)
        handles = submit_long(client, 2, 50)
        os.killpg(up.proc.pid, signal.SIGINT)
        assert up.proc.wait(60) == 0, up.output
        assert "2 answers were not read (--answer-grace-s 0)" in up.err_path.read_text(), up.output
        started = time.monotonic()
        for h in handles:
            with pytest.raises(RedisUnavailable, match=r"the local cluster 'default' \(pdqueue up, pid \d+\) has "
                                                       r"stopped"):
                h.result(timeout=60)
        assert time.monotonic() - started < 5, "the client retried a server that is gone for good"
        with pytest.raises(RedisUnavailable, match="has stopped"):   # a submit too
            client.submit("Hello", max_tokens=4)
        assert time.monotonic() - started < 5
        client.close()
    finally:
        up.ensure_stopped()
    assert gone(state["server_pid"])
