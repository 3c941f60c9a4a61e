"""Riding out zero capacity (issue 42 item 2; pdqueue/frontends/capacity.py): a request that
arrives while no worker can take it waits in the durable queue and is answered once capacity
returns, through the gateway (streaming or not) and the Python client, with no error; only a
gap longer than the gateway's ``--capacity-wait-s`` is a 503 with Retry-After, and that request
is cancelled: a worker that comes later never runs it.

Real parts: the session's Redis, `pdqueue serve` processes, tiny-model prefill and decode
workers (stopped warm and started again), the ``openai`` package and http.client."""

from __future__ import annotations

import json
import threading
import time
import uuid

import openai
import pytest

from pdqueue.client import Client
from tests.cluster import Cluster
from tests.helpers import FAST, wait_for
from tests.test_gateway import Gateway

pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("test_capacity")]

CLUSTER = "capacity"
PROMPTS = ["The capital of France is", "Once upon a time", "x", "Zero capacity"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(redis_server, tmp_path_factory):
    if not redis_server.running:
        redis_server.restart()
    logs = tmp_path_factory.mktemp("capacity")
    cluster = Cluster(redis_server.url, logs, cluster=CLUSTER)
    waiting = Gateway(redis_server.url, CLUSTER, logs, "--capacity-wait-s", "60", name="waiting")
    brief = Gateway(redis_server.url, CLUSTER, logs, "--capacity-wait-s", "1", name="brief")
    try:
        yield cluster, waiting, brief
    finally:
        for gw in (waiting, brief):
            gw.proc.terminate()
            gw.proc.wait(30)
        cluster.kill_all()


def ask(gw: Gateway, prompt: str, stream: bool) -> tuple[int, str]:
    """(status, text) of one greedy completion through the openai package."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices)
        else:
            text = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0).choices[0].text
        return 200, text
    except openai.APIStatusError as exc:
        return exc.status_code, str(exc)


def in_threads(calls) -> list:
    results = [None] * len(calls)

    def run(i, call):
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, results


def test_requests_sent_to_a_cluster_with_no_worker_are_answered_once_workers_start(setup, redis_server):
    cluster, waiting, _ = setup
    calls = [lambda p=p, s=s: ask(waiting, p, s) for p in PROMPTS for s in (False, True)]
    threads, results = in_threads(calls)
    client = Client(redis_server.url, cluster=CLUSTER)
    handles = [client.submit(p, max_tokens=MAX_TOKENS, temperature=0) for p in PROMPTS]
    time.sleep(3)   # everything waits: no worker has ever served this cluster
    assert all(r is None for r in results), results
    cluster.start_together(("prefill", *FAST), ("decode", *FAST))
    for t in threads:
        t.join(120)
    by_client = [h.result(timeout=60).text for h in handles]
    assert [r[0] for r in results] == [200] * len(calls), results
    # The same answers as requests sent while the workers run (greedy).
    again = [ask(waiting, p, False) for p in PROMPTS]
    assert [r[1] for r in results] == [a[1] for a in again for _ in (0, 1)]
    assert by_client == [a[1] for a in again]


def test_an_outage_of_every_prefill_capable_worker_under_load_fails_no_request(setup, redis_server):
    cluster, waiting, _ = setup
    expected = {p: ask(waiting, p, False)[1] for p in PROMPTS}   # the workers of the test above run
    prefills = [name for name, proc in cluster.procs.items() if name.startswith("prefill")]
    sent: list = []
    threads: list[threading.Thread] = []
    stop = threading.Event()

    def one(p: str, s: bool) -> None:
        began = time.monotonic()
        sent.append((p, began, *ask(waiting, p, s)))

    def load():   # about 4 requests a second, streaming and not, through the outage
        i = 0
        while not stop.is_set():
            threads.append(threading.Thread(target=one, args=(PROMPTS[i % len(PROMPTS)], bool(i % 2))))
            threads[-1].start()
            i += 1
            time.sleep(0.25)

    driver = threading.Thread(target=load)
    driver.start()
    time.sleep(1)
    outage_began = time.monotonic()
    for name in prefills:
        cluster.stop(name)   # a warm stop: what it holds is answered
    time.sleep(4)   # no prefill-capable worker for ~4 s, then the new one's start
    cluster.start("prefill", *FAST)
    outage_ended = time.monotonic()
    time.sleep(1)
    stop.set()
    driver.join()
    for t in threads:
        t.join(120)
    statuses = [s[2] for s in sent]
    assert statuses and all(s == 200 for s in statuses), [s for s in sent if s[2] != 200]
    assert all(text == expected[p] for p, _, _, text in sent), sent
    during = [s for s in sent if outage_began <= s[1] <= outage_ended]
    assert len(during) >= 8, (len(during), outage_ended - outage_began)


def test_a_gap_longer_than_the_wait_is_a_503_with_retry_after_and_the_request_never_runs(setup, redis_server):
    cluster, waiting, brief = setup
    # This gateway has seen the model served (what makes it wait rather than 404), whichever
    # tests ran before this one (alone, none has started the workers yet).
    if not any(n.startswith(("prefill", "decode")) and p.poll() is None for n, p in cluster.procs.items()):
        cluster.start_together(("prefill", *FAST), ("decode", *FAST))
    wait_for(lambda: ask(brief, "x", False)[0] == 200, 60, what="the gateway answering through the cluster")
    for name in [n for n in cluster.procs if n.startswith("prefill")]:
        if cluster.procs[name].poll() is None:
            cluster.stop(name)
    wait_for(lambda: not any(w.get("role") == "prefill" for w in cluster.workers().values()), 10,
             what="no prefill worker registered")
    began = time.monotonic()
    status, headers, raw = brief.post("/v1/completions", {"model": "tiny", "prompt": "never run",
                                                          "max_tokens": MAX_TOKENS},
                                      headers={"x-request-id": uuid.uuid4().hex})
    waited = time.monotonic() - began
    assert status == 503, raw
    assert headers.get("retry-after") == "5", headers
    assert json.loads(raw)["error"]["code"] == "service_unavailable"
    assert 0.9 <= waited < 10, waited
    request_id = headers["x-request-id"]
    # A streamed request gets the same 503, before any event.
    status, headers, raw = brief.post("/v1/completions", {"model": "tiny", "prompt": "never run", "stream": True,
                                                          "max_tokens": MAX_TOKENS})
    assert status == 503 and headers["content-type"].startswith("application/json"), (status, headers, raw)
    # Without any wait configured the model would be unknown to it; with one, an unknown name is still a 404.
    status, _, raw = brief.post("/v1/completions", {"model": "no-such-model", "prompt": "x", "max_tokens": 2})
    assert status == 404, raw
    cluster.start("prefill", *FAST)
    assert ask(brief, "x", False)[0] == 200   # capacity is back
    out = cluster.r.xrange(cluster.keys.out(request_id))
    assert not [f for _, f in out if f.get(b"type") == b"token"], out   # cancelled: never ran
