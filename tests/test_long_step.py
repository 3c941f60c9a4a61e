"""A long engine step is not a hung worker; a stopped worker or a stuck loop still is.

Entries in hand are touched by the keeper thread (workers/recovery.py) while the worker's
loop makes progress (its current iteration began less than ``--max-step-s`` ago), so one
step longer than ``--reclaim-idle-ms`` keeps its entries; a SIGSTOPped process touches
nothing (its threads stop with it), and a loop stuck past ``--max-step-s`` is no longer kept.
Real worker processes and a real Redis; the keeper's rules also in this process."""

from __future__ import annotations

import collections
import random
import signal
import string
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pdqueue.client import Client, build_request
from pdqueue.keys import PREFILL_GROUP, Keys
from pdqueue.queue.publisher import Publisher
from pdqueue.queue.streams import ensure_group, read_group, request_streams
from tests.helpers import wait_for
from workers.recovery import Recovery

KEYS = Keys()
RECLAIM_IDLE_MS = 500
# 16 prompts of 4000 tokens prefilled in one step: about 2 s with the tiny model on one
# idle core, so the step outlasts RECLAIM_IDLE_MS several times over.
LONG = ("--reclaim-idle-ms", str(RECLAIM_IDLE_MS), "--max-batched-tokens", "65536", "--kv-cache-mb", "48",
        "--routing", "off")
N_LONG, PROMPT_CHARS = 16, 4000


def reclaimed(cluster, name: str, cause: str | None = None) -> float:
    """``pdqueue:entries_reclaimed_total`` of a worker (its metrics endpoint), by cause."""
    address = cluster.workers()[name]["metrics"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "pdqueue:entries_reclaimed_total" and cause in (None, s.labels.get("cause")))


def holding(cluster, name: str) -> int:
    """Request entries pending for a worker."""
    consumers = cluster.r.xpending(cluster.keys.requests, PREFILL_GROUP)["consumers"]
    return sum(c["pending"] for c in consumers if c["name"].decode() == cluster.id(name))


def whole_log(cluster, name: str) -> str:
    return (cluster.log_dir / f"{name}.log").read_text(errors="replace")


def answered_once(cluster, request_ids) -> None:
    """One ``done`` per request on the done stream and on its out:<id>, and no error."""
    counts = collections.Counter(f[b"id"].decode() for _, f in cluster.r.xrange(cluster.keys.done))
    assert all(counts[rid] == 1 for rid in request_ids), {rid: counts[rid] for rid in request_ids}
    for rid in request_ids:
        kinds = [f[b"type"] for _, f in cluster.r.xrange(cluster.keys.out(rid))]
        assert kinds.count(b"done") == 1 and b"error" not in kinds, (rid, kinds)


def one_long_step(cluster, *a_args: str) -> list:
    """Colocated workers a (with ``a_args``) and b; a takes 16 long prompts in one read and
    prefills them in one step (b idle meanwhile, scanning for hung entries every 0.5 s).
    The completions, once all are answered exactly once."""
    cluster.start("colocated", *LONG, *a_args, worker_id="a", wait=False)
    cluster.start("colocated", *LONG, worker_id="b", wait=False)
    for name in ("a", "b"):
        cluster.wait_registered(name)
    rng = random.Random(7)
    reqs = [build_request("".join(rng.choices(string.ascii_letters, k=PROMPT_CHARS)), max_tokens=1,
                          temperature=0.0, seed=i) for i in range(N_LONG)]
    # a takes all 16 in one read (a blocked read would take 5 per stream): both stopped
    # until their blocked reads (100 ms) have expired, the requests queued, a let go; b
    # goes on once a holds them all.
    cluster.signal("a", signal.SIGSTOP)
    cluster.signal("b", signal.SIGSTOP)
    try:
        time.sleep(0.5)
        client = Client(cluster.redis_url, cluster.cluster)
        client.submit_many([dict(prompt=req.prompt, max_tokens=1, temperature=0.0, seed=req.seed, id=req.id)
                            for req in reqs])
        cluster.signal("a", signal.SIGCONT)
        wait_for(lambda: holding(cluster, "a") == N_LONG, timeout=30, what="a to take all the requests")
    finally:
        cluster.signal("a", signal.SIGCONT)
        cluster.signal("b", signal.SIGCONT)
    results = [client.handle(req.id).result(timeout=120) for req in reqs]
    time.sleep(1.0)   # the idle worker's reclaim scans (every 0.5 s) had their chance
    answered_once(cluster, [req.id for req in reqs])
    return results


def test_a_step_longer_than_reclaim_idle_keeps_its_entries(cluster):
    """One step several times longer than --reclaim-idle-ms: the idle worker takes none of
    its entries; each request is answered once, by the one worker, and nothing is
    reclaimed or dropped."""
    results = one_long_step(cluster)
    workers = {c.prefill_worker for c in results}
    assert len(workers) == 1, [(c.prefill_worker, c.queue_ms, c.prefill_ms) for c in results]
    step_ms = min(c.prefill_ms for c in results)
    assert step_ms > 2 * RECLAIM_IDLE_MS, f"the step ({step_ms:.0f} ms) must outlast --reclaim-idle-ms"
    for name in ("a", "b"):
        assert reclaimed(cluster, name) == 0, (name, whole_log(cluster, name)[-3000:])
        log = whole_log(cluster, name)
        assert "reclaimed" not in log and "taken over by another worker" not in log, log[-3000:]


def test_a_step_longer_than_max_step_s_is_taken_for_stuck(cluster):
    """The watchdog: a's loop is in one iteration for longer than its --max-step-s, so its
    keeper stops touching and b takes the entries over as hung; still one answer each."""
    one_long_step(cluster, "--max-step-s", "0.3")
    assert reclaimed(cluster, "b", "hung") >= 1, whole_log(cluster, "b")[-3000:]
    assert "worker loop stuck in one iteration" in whole_log(cluster, "a")


def test_a_stopped_worker_is_still_taken_over_as_hung(cluster):
    """Worker a (its heartbeat alive for 30 s) holds a long generation and is SIGSTOPped:
    its keeper thread stops with it, so b takes the entry over as hung after
    --reclaim-idle-ms and answers it; a, resumed, drops it. One answer."""
    args = ("--reclaim-idle-ms", str(RECLAIM_IDLE_MS), "--routing", "off")
    cluster.start("colocated", *args, "--heartbeat-ttl-s", "30", worker_id="a", wait=False)
    cluster.start("colocated", *args, worker_id="b", wait=False)
    for name in ("a", "b"):
        cluster.wait_registered(name)
    client = Client(cluster.redis_url, cluster.cluster)
    keys, r = cluster.keys, cluster.r
    cluster.signal("b", signal.SIGSTOP)   # so that a reads it
    try:
        handle = client.submit("a long one", max_tokens=2000, temperature=0.0, seed=1, ignore_eos=True)

        def a_holds() -> bool:
            pending = r.xpending_range(keys.requests, PREFILL_GROUP, min="-", max="+", count=10)
            return [p["consumer"].decode() for p in pending] == [cluster.id("a")]

        wait_for(a_holds, timeout=30, what="a to take the request")
        wait_for(lambda: r.xlen(keys.out(handle.request_id)) > 3, timeout=30, what="a's tokens")
        cluster.signal("a", signal.SIGSTOP)
    finally:
        cluster.signal("b", signal.SIGCONT)
    try:
        result = handle.result(timeout=60)
        assert result.decode_worker == cluster.id("b") and len(result.token_ids) == 2000, result
        assert reclaimed(cluster, "b", "hung") == 1
    finally:
        cluster.signal("a", signal.SIGCONT)
    wait_for(lambda: "was taken over by another worker" in whole_log(cluster, "a"), timeout=30,
             what="the resumed a to drop what it lost")
    answered_once(cluster, [handle.request_id])


# ---- the keeper's rules, in this process ------------------------------------------------

class HeldRole:
    """Just what Recovery asks of a role; ``held`` changes like a role's dict does."""
    group = PREFILL_GROUP

    def __init__(self, held: dict):
        self.entries = dict(held)
        self.collide = 0   # this many reads fail as if the loop changed the dict meanwhile

    def streams(self):
        return list(request_streams(KEYS))

    def held(self):
        if self.collide:
            self.collide -= 1
            raise RuntimeError("dictionary changed size during iteration")
        return dict(self.entries)


def deliver(r, consumer: str, n: int) -> list[str]:
    ensure_group(r, KEYS.requests, PREFILL_GROUP)
    for i in range(n):
        r.xadd(KEYS.requests, {"id": f"r{i}", "prompt": "hi"})
    return [e[1] for e in read_group(r, PREFILL_GROUP, consumer, [KEYS.requests], count=n)]


def idle_ms(r, entry_id: str) -> int:
    p, = r.xpending_range(KEYS.requests, PREFILL_GROUP, min=entry_id, max=entry_id, count=1)
    return p["time_since_delivered"]


def test_the_keeper_keeps_entries_only_while_the_loop_makes_progress(r):
    """Touched from the keeper's thread while iterations are young (however long since the
    last one ended), not once the current one is older than max_step_s; and again as soon
    as the loop moves on. A read of the entries in hand that collides with a change is retried."""
    entry, = deliver(r, "w1", 1)
    role = HeldRole({"r0": (KEYS.requests, entry)})
    role.collide = 2
    recovery = Recovery(r, KEYS, "w1", reclaim_idle_ms=300, publisher=Publisher(lambda: r), max_step_s=1.5)
    try:
        recovery.progress()            # one iteration begins: a step of up to 1.5 s
        recovery.start_keeper(lambda: role)
        time.sleep(1.0)                # the step goes on (the loop's thread does nothing here)
        assert idle_ms(r, entry) < 300 and recovery.kept_rounds >= 2
        # past max_step_s: stuck, no longer kept
        wait_for(lambda: recovery.stuck_rounds >= 1, timeout=5, what="the keeper to find the loop stuck")
        wait_for(lambda: idle_ms(r, entry) >= 800, timeout=5, what="the entry to go idle")
        recovery.progress()            # the loop moves on: kept again
        wait_for(lambda: idle_ms(r, entry) < 300, timeout=5, what="the entry to be touched again")
    finally:
        recovery.stop_keeper()
        recovery.publisher.close()


def test_the_keeper_reports_what_was_taken_over_and_not_what_was_answered(r):
    a, b, c = deliver(r, "w1", 3)
    role = HeldRole({"r0": (KEYS.requests, a), "r1": (KEYS.requests, b), "r2": (KEYS.requests, c)})
    r.xclaim(KEYS.requests, PREFILL_GROUP, "w2", 0, [b])     # taken over by w2
    r.xack(KEYS.requests, PREFILL_GROUP, c)                   # answered by us ...
    recovery = Recovery(r, KEYS, "w1", reclaim_idle_ms=300, publisher=Publisher(lambda: r))
    try:
        recovery.progress()
        recovery.start_keeper(lambda: role)
        wait_for(lambda: recovery.kept_rounds >= 1, timeout=5, what="a keeper round")
        del role.entries["r2"]                                # ... and gone from hand since
        assert recovery.keep(role) == ["r1"]                  # on the loop's thread: drop r1
        del role.entries["r1"]
        rounds = recovery.kept_rounds
        wait_for(lambda: recovery.kept_rounds > rounds, timeout=5, what="another keeper round")
        assert recovery.keep(role) == []
        assert idle_ms(r, a) < 300                            # what is still ours is kept
    finally:
        recovery.stop_keeper()
        recovery.publisher.close()
