"""Shared fixtures: one real redis-server per test session, flushed before each test.

No fakeredis and no mocks: tests talk to a real server started by ``RedisServer`` on a
free loopback port. The server is stopped at session end whatever happens (fixture
finalizer, atexit, and PDEATHSIG if the pytest process is killed outright).
"""

from __future__ import annotations

import atexit

import pytest
import redis

from pdqueue.queue.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    atexit.register(server.stop)  # stop() is idempotent; this covers an aborted session
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session's server, emptied (FLUSHALL) before the test."""
    if not redis_server.running:  # a test that restarted or killed it
        redis_server.restart()
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def r(redis_url):
    """A redis-py client (bytes replies) on an empty database."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()
