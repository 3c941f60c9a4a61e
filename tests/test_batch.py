"""`pdqueue batch`: OpenAI Batch files through the queue, as a user runs it (a real
subprocess, a real Redis, real prefill and decode workers on the tiny model).

- Interrupted with SIGINT midway and run again with the command it printed: every input
  line answered once and written once, bad lines and repeated custom_ids answered with an
  error, no request computed twice, and greedy answers equal to the Python Client's.
- Without workers the window bounds what is queued; a rerun re-attaches to the queued
  requests instead of sending them again; an answer that expired unread is computed again.
- 100k lines in bounded memory (peak RSS against a 2k-line run).
- OUTPUT's safety: an incomplete last line is cut, another batch's OUTPUT is refused, two
  runs on one OUTPUT are refused; the progress bar only on a terminal.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from pdqueue.client import Client
from pdqueue.frontends import openai_compat
from pdqueue.frontends.batch import custom_id_hash, output_line, request_id
from pdqueue.keys import Keys
from pdqueue.protocol import ServiceClass, parse_result
from tests.cluster import Cluster
from tests.helpers import mixed_prompts, wait_for

ROOT = Path(__file__).resolve().parent.parent
KEYS = Keys("default")


def start_workers(cluster: Cluster) -> None:
    """One prefill and one decode worker, loading side by side."""
    cluster.start("prefill", wait=False)
    cluster.start("decode", wait=False)
    for name in list(cluster.procs):
        cluster.wait_registered(name)


def batch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "workers", "batch", *args]


def run_batch(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command to its end. The timeout is generous: on a shared 2-core box a niced run
    can be starved for a minute."""
    try:
        return subprocess.run(batch_cmd(*args), capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"pdqueue batch {' '.join(args)} still running after {timeout}s; "
                             f"stderr: {exc.stderr!r}") from None


def start_batch(*args: str, env: dict, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(batch_cmd(*args), stdout=open(tmp_path / "batch.out", "w"),
                            stderr=open(tmp_path / "batch.err", "w"), env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL, text=True)


def interrupt(proc: subprocess.Popen, tmp_path: Path) -> str:
    """SIGINT, as Ctrl-C sends it; the exit status must be 130. Returns stderr."""
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(60)
    err = (tmp_path / "batch.err").read_text()
    assert rc == 130, (rc, err)
    return err


def read_output(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, lines: list) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def completion_line(cid: str, prompt, max_tokens: int = 8) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}}


def chat_line(cid: str, messages: list[dict], max_tokens: int = 8) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}}


def batch_done_entries(r) -> list[dict]:
    """The done entries (copies on the done stream) of batch requests: one per computation."""
    out = []
    for _, fields in r.xrange(KEYS.done):
        fields = {k.decode(): v.decode() for k, v in fields.items()}
        if fields.get("id", "").startswith("batch:"):
            out.append(fields)
    return out


def computed(r, rid: str):
    """The completion pdqueue computed for request ``rid`` (from out:<rid>)."""
    for eid, fields in r.xrange(KEYS.out(rid)):
        event = parse_result(eid, fields)
        if event.type == "done":
            return event.completion
    raise AssertionError(f"no done entry on out:{rid}")


def prompt_ids_of(tiny, parsed) -> list[int]:
    tok = tiny.tokenizer
    if parsed.prompt_ids is not None:
        return list(parsed.prompt_ids)
    if parsed.chat:
        messages = list(parsed.messages) if parsed.messages else [{"role": "user", "content": parsed.prompt}]
        return tok.encode(tok.apply_chat_template([dict(m) for m in messages]))
    return tok.encode(parsed.prompt)


# ---- the whole story: interrupted, resumed, every line once ---------------------------------

def test_interrupted_batch_resumes_and_answers_every_line_once(cluster, redis_url, tmp_path, env, tiny):
    from tests.oracle import assert_same_tokens

    start_workers(cluster)
    prompts = mixed_prompts(21, seed=3)
    good = []
    for i, p in enumerate(prompts):
        if i % 3 == 0:
            good.append(completion_line(f"req-{i}", p))
        elif i % 3 == 1:
            good.append(chat_line(f"req-{i}", [{"role": "user", "content": p}]))
        else:
            good.append(chat_line(f"req-{i}", [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": p}]))
    good.append(completion_line("ids", [5, 17, 42, 99]))
    too_long = completion_line("too-long", [7] * 5000)             # longer than the tiny model's 4096 context
    lines = list(good[:4]) + [
        "this is not json",
        "[1, 2, 3]",
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},                # no custom_id
        {"custom_id": "no-body", "method": "POST", "url": "/v1/completions"},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
        {"custom_id": "n3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 3}},
        "",
        completion_line("req-3", "a repeat of req-3 with another prompt"),
        too_long,
        {"custom_id": "other-model", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-4o", "prompt": "x"}},
    ] + good[4:14] + [
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
        good[3],
    ] + good[14:]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    nonblank = sum(1 for x in lines if x != "")

    proc = start_batch(str(inp), "-o", str(out), "--redis-url", redis_url, "--concurrency", "4",
                       env=env, tmp_path=tmp_path)
    r = redis.Redis.from_url(redis_url)

    def queued_in_redis() -> int:
        """Requests waiting for or in a worker: entries on the request and handoff streams (an
        entry is deleted when its worker finishes it)."""
        return sum(r.xlen(key) for key in r.scan_iter(match=f"{KEYS.prefix}*", _type="stream")
                   if key.decode().startswith((KEYS.requests, KEYS.handoff)))

    # Four answers, then the decode worker paused (SIGSTOP) so that what the batch has sent
    # stays in Redis across the interrupt: on a fast machine the tiny model answered the
    # whole window between a check and the SIGINT, leaving nothing to re-attach.
    wait_for(lambda: proc.poll() is not None or
             sum(1 for o in read_output(out) if (o["response"] or {}).get("status_code") == 200) >= 4,
             timeout=180, what="four answers")
    cluster.signal("decode-1", signal.SIGSTOP)
    try:
        wait_for(lambda: proc.poll() is not None or queued_in_redis() > 0, timeout=60,
                 what="requests waiting in Redis behind the paused decode worker")
        assert proc.poll() is None, (tmp_path / "batch.err").read_text()
        err = interrupt(proc, tmp_path)
    finally:
        cluster.signal("decode-1", signal.SIGCONT)
    m = re.search(r"interrupted: (\d+) requests left running in Redis; resume with: (pdqueue batch .*)$", err.strip())
    assert m, err
    left = int(m.group(1))
    assert left >= 1, err
    assert "--batch-id" in m.group(2)
    first = out.read_text()
    assert 4 <= len(first.splitlines()) < nonblank

    # The command it printed, verbatim.
    args = shlex.split(m.group(2))[2:]
    result = run_batch(*args, env=env)
    assert result.returncode == 0, result.stderr
    assert f"{left} re-attached" in result.stderr, (left, result.stderr)
    final_text = out.read_text()
    assert final_text.startswith(first), "the first run's lines must stay as they were"

    final = read_output(out)
    ids = [o["id"] for o in final]
    assert len(final) == nonblank and len(set(ids)) == nonblank, (len(final), nonblank)
    by_cid: dict = {}
    for o in final:
        by_cid.setdefault(o["custom_id"], []).append(o)

    # Bad lines: one error line each, never a crash.
    nulls = sorted(o["error"]["code"] for o in by_cid.pop(None))
    assert nulls == ["invalid_json_line", "invalid_json_line", "missing_required_parameter"], nulls
    assert [o["error"]["code"] for o in by_cid.pop("no-body")] == ["missing_required_parameter"]
    assert [o["error"]["code"] for o in by_cid.pop("get")] == ["invalid_method"]
    assert sorted(o["error"]["code"] for o in by_cid.pop("bad-url")) == ["duplicate_custom_id", "invalid_url"]
    n3 = by_cid.pop("n3")
    assert len(n3) == 1 and n3[0]["error"] is None and n3[0]["response"]["status_code"] == 400
    assert n3[0]["response"]["body"]["error"]["param"] == "n"
    tl = by_cid.pop("too-long")
    assert len(tl) == 1 and tl[0]["response"]["status_code"] == 400, tl
    assert tl[0]["response"]["body"]["error"]["code"] == "too_long"
    (om,) = by_cid.pop("other-model")
    assert om["response"]["status_code"] == 404 and om["response"]["body"]["error"]["code"] == "model_not_found"
    # req-3: its first line answered, both repeats refused.
    rep = by_cid["req-3"]
    assert sorted(o["error"]["code"] if o["error"] else "ok" for o in rep) == \
        ["duplicate_custom_id", "duplicate_custom_id", "ok"], rep
    by_cid["req-3"] = [o for o in rep if o["error"] is None]

    # Good lines: one 200 each, the body as the gateway builds it.
    assert sorted(by_cid) == sorted(g["custom_id"] for g in good)
    r = redis.Redis.from_url(redis_url)
    answers = {}
    for g in good:
        (o,) = by_cid[g["custom_id"]]
        resp = o["response"]
        assert o["error"] is None and resp["status_code"] == 200, o
        rid = resp["request_id"]
        assert rid == request_id(m.group(2).split("--batch-id ")[1].split()[0], g["custom_id"])
        body = resp["body"]
        chat = g["url"] == "/v1/chat/completions"
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        choice = body["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        c = computed(r, rid)
        assert text == c.text and body["usage"]["completion_tokens"] == c.num_tokens == 8
        assert body["model"] == "tiny" and choice["finish_reason"] == "length"
        answers[g["custom_id"]] = c

    # No request computed twice: one done entry per good request, and no duplicate submit.
    done = batch_done_entries(r)
    assert len(done) == len(good) and len({d["id"] for d in done}) == len(good), [d["id"] for d in done]
    dead_codes = [f.get(b"code") for _, f in r.xrange(KEYS.dead)]
    assert b"duplicate" not in dead_codes, dead_codes

    # Greedy answers equal to the Python Client's for the same requests.
    parsed = [(openai_compat.parse_chat if g["url"].endswith("chat/completions") else openai_compat.parse_completion)(
        g["body"]) for g in good]
    with Client(redis_url, "default") as client:
        handles = client.submit_many([p.submit_kwargs() for p in parsed])
        expected = [h.result(timeout=300) for h in handles]
    for g, p, exp in zip(good, parsed, expected):
        got = answers[g["custom_id"]]
        assert_same_tokens(tiny, prompt_ids_of(tiny, p), list(exp.token_ids), list(got.token_ids),
                           label=g["custom_id"])


# ---- the window, queued requests re-attached, expired answers recomputed ---------------------

def test_window_bounds_the_queue_and_a_rerun_reattaches_instead_of_resending(cluster, redis_url, tmp_path, env):
    r = redis.Redis.from_url(redis_url)
    n, window = 24, 6
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [completion_line(f"q{i}", p, max_tokens=4) for i, p in enumerate(mixed_prompts(n, seed=5))])
    args = [str(inp), "-o", str(out), "--redis-url", redis_url, "--concurrency", str(window), "--batch-id", "w1"]

    # No workers: exactly `window` requests are queued, and no more while they wait.
    proc = start_batch(*args, env=env, tmp_path=tmp_path)
    batch_stream = KEYS.request_stream_for(ServiceClass.BATCH)
    wait_for(lambda: r.xlen(batch_stream) >= window, timeout=60, what="the window queued")
    # Its window full, it waits for answers (blocked in XREAD) and sends nothing more.
    wait_for(lambda: any(c.get("cmd") == "xread" for c in r.client_list()), timeout=60, what="the batch reading")
    assert r.xlen(KEYS.request_stream_for(ServiceClass.BATCH)) == window
    err = interrupt(proc, tmp_path)
    assert f"interrupted: {window} requests left running in Redis" in err, err
    assert read_output(out) == []
    assert len(r.keys(KEYS.seen("batch:w1:*"))) == window

    # Still no workers: a rerun re-attaches to the queued requests and sends nothing (its
    # window is full of them). It is reading answers once a client of it blocks in XREAD.
    proc = start_batch(*args, env=env, tmp_path=tmp_path)
    wait_for(lambda: any(c.get("cmd") == "xread" for c in r.client_list()), timeout=60, what="the rerun reading")
    time.sleep(0.5)
    assert r.xlen(KEYS.request_stream_for(ServiceClass.BATCH)) == window
    err = interrupt(proc, tmp_path)
    assert f"{window} re-attached" in err and f"interrupted: {window} requests left running in Redis" in err, err

    # Workers come; the rerun re-attaches to the queued ones: nothing is sent twice.
    start_workers(cluster)
    result = run_batch(*args, env=env)
    assert result.returncode == 0, result.stderr
    assert f"{n} answered, 0 errors, 0 skipped" in result.stderr and f"{window} re-attached" in result.stderr, \
        result.stderr
    final = read_output(out)
    assert len(final) == n and all(o["response"]["status_code"] == 200 for o in final)
    assert r.xlen(KEYS.dead) == 0, r.xrange(KEYS.dead)   # a duplicate submit would be dead-lettered
    assert len(batch_done_entries(r)) == n

    # Two lines lost from OUTPUT: one answer still in Redis (re-attached, not recomputed), one
    # whose answer expired unread (out:<id> gone): computed again under <id>.2.
    kept, expired = final[0], final[1]
    r.delete(KEYS.out(expired["response"]["request_id"]))
    out.write_text("".join(json.dumps(o) + "\n" for o in final[2:]))
    result = run_batch(*args, env=env)
    assert result.returncode == 0, result.stderr
    assert f"2 answered, 0 errors, {n - 2} skipped" in result.stderr and "1 re-attached" in result.stderr \
        and "1 sent again" in result.stderr, result.stderr
    again = {o["custom_id"]: o for o in read_output(out)}
    assert len(again) == n
    assert again[kept["custom_id"]]["response"]["request_id"] == kept["response"]["request_id"]
    assert again[expired["custom_id"]]["response"]["request_id"] == expired["response"]["request_id"] + ".2"
    assert again[expired["custom_id"]]["response"]["body"]["choices"][0]["text"] == \
        expired["response"]["body"]["choices"][0]["text"]   # greedy: the same answer
    assert len(batch_done_entries(r)) == n + 1


# ---- memory ----------------------------------------------------------------------------------

# The peak RSS of this process image (VmHWM: getrusage's ru_maxrss would also count the
# forking parent's size), written at exit.
_PEAK_RSS = ("import atexit, re, sys\n"
             "out = sys.argv.pop(1)\n"
             "def peak():\n"
             "    status = open('/proc/self/status').read()\n"
             "    open(out, 'w').write(re.search(r'VmHWM:\\s*(\\d+) kB', status).group(1))\n"
             "atexit.register(peak)\n"
             "from workers.cli import main\n"
             "sys.argv[0] = 'pdqueue'\n"
             "main()\n")


def _peak_rss_kib(tmp_path: Path, n: int, redis_url: str, env: dict) -> tuple[int, str]:
    """Run a batch of ``n`` lines of ~1 KB, the first half already in OUTPUT and the second
    half answered with a 400 (``n`` > 1: no workers needed), and return its peak RSS."""
    inp, out = tmp_path / f"in{n}.jsonl", tmp_path / f"out{n}.jsonl"
    pad = "lorem ipsum " * 50
    line = json.dumps({"custom_id": "m%d", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "%d " + pad, "max_tokens": 4, "n": 2}})
    with open(inp, "w") as f:
        f.writelines(line.replace("%d", str(i)) + "\n" for i in range(n))
    answer = json.dumps(output_line("mem", "HASH", "CID", {"status_code": 200, "request_id": "x",
                                                          "body": {"text": pad}}))
    with open(out, "w") as f:
        f.writelines(answer.replace("HASH", custom_id_hash(f"m{i}")).replace("CID", f"m{i}") + "\n"
                     for i in range(n // 2))
    rss = tmp_path / f"rss{n}"
    result = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(rss), "batch", str(inp), "-o", str(out),
                             "--redis-url", redis_url, "--batch-id", "mem"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert f"0 answered, {n - n // 2} errors, {n // 2} skipped" in result.stderr, result.stderr
    assert len(read_output(out)) == n if n <= 2000 else sum(1 for _ in open(out)) == n
    return int(rss.read_text()), result.stderr


def test_a_100k_line_file_runs_in_bounded_memory(redis_url, tmp_path, env):
    small, _ = _peak_rss_kib(tmp_path, 2_000, redis_url, env)
    big, _ = _peak_rss_kib(tmp_path, 100_000, redis_url, env)
    input_mib = os.path.getsize(tmp_path / "in100000.jsonl") / 2**20
    grew_mib = (big - small) / 1024
    # Holding INPUT or OUTPUT (~60 and ~35 MiB here) would add far more than the per-line keys
    # (~16 bytes of hash per custom_id and per line already answered, plus set overhead).
    assert input_mib > 55
    assert grew_mib < 40, f"peak RSS grew by {grew_mib:.0f} MiB from 2k to 100k lines ({input_mib:.0f} MiB input)"
    print(f"peak RSS {small / 1024:.0f} MiB (2k lines), {big / 1024:.0f} MiB (100k lines)")


# ---- OUTPUT's safety and the terminal ----------------------------------------------------------

def test_output_cut_refused_locked_and_progress_only_on_a_terminal(redis_url, tmp_path, env):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, ["{broken", {"custom_id": "u", "method": "POST", "url": "/v1/nope", "body": {}},
                      {"custom_id": "v", "method": "POST", "url": "/v1/completions", "body": {"prompt": ""}}])
    base = [str(inp), "-o", str(out), "--redis-url", redis_url]
    result = run_batch(*base, env=env)
    assert result.returncode == 0, result.stderr
    # Not a terminal: no progress bar, only the summary line (after the warning that no worker is up).
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("warning: ") and "no prefill worker" in lines[0], lines
    assert re.fullmatch(rf"batch [0-9a-f]{{16}}: 0 answered, 3 errors, 0 skipped \(already in {re.escape(str(out))}\)",
                        lines[1]), lines
    complete = out.read_text()
    assert len(complete.splitlines()) == 3

    # A crash while a line was written: the rerun cuts the incomplete line and answers nothing twice.
    out.write_text(complete + complete.splitlines()[1][:60])
    result = run_batch(*base, env=env)
    assert result.returncode == 0 and "0 answered, 0 errors, 3 skipped" in result.stderr, result.stderr
    assert "removed an incomplete last line" in result.stderr
    assert out.read_text() == complete

    # OUTPUT of another batch: refused in one line, naming the id that would resume it.
    result = run_batch(*base, "--batch-id", "other", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--batch-id " in lines[0], result.stderr
    assert out.read_text() == complete

    # A file that is not a batch output, even one line without its newline: refused, untouched.
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, no newline at the end")
    result = run_batch(str(inp), "-o", str(notes), "--redis-url", redis_url, env=env)
    assert result.returncode == 1 and "not a batch output line" in result.stderr, result.stderr
    assert notes.read_text() == "my notes, no newline at the end"

    # A second run on the same OUTPUT while one holds it: refused.
    import fcntl

    with open(out, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = run_batch(*base, env=env)
    assert result.returncode == 1 and "another `pdqueue batch`" in result.stderr, result.stderr

    # On a terminal: the progress bar (lines, rate, ETA).
    out.unlink()
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(batch_cmd(*base), stdout=subprocess.DEVNULL, stderr=slave, env={**env, "TERM": "xterm"},
                                cwd=ROOT, stdin=subprocess.DEVNULL)
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(60) == 0, seen
    finally:
        os.close(master)
    text = seen.decode(errors="replace")
    assert "lines/s" in text and "3/3" in text, text


def test_the_batch_command_imports_no_torch():
    code = ("import sys; from workers.cli import cli; import pdqueue.frontends.batch, workers.cli.batch; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
