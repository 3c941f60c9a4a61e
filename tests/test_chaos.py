"""Chaos: 200 requests of mixed lengths through 2 prefill + 2 decode workers while one
random worker is SIGKILLed and restarted every few seconds. 200 completions, none lost,
none answered twice, the colocated engine's tokens, no block or segment leaked; one usage
record per request (pdqueue/queue/ledger.py), counting the tokens its client received."""

from __future__ import annotations

import collections
import random
import signal
import statistics
import threading
import time

import redis

from pdqueue.client import Client
from pdqueue.keys import Keys
from pdqueue.models.loader import load_model
from pdqueue.protocol import entry_id_ms
from tests.cluster import Cluster
from tests.helpers import FAST, assert_ledger_is, mixed_prompts, oracle, wait_for, wait_pools_free
from tests.oracle import assert_same_tokens

NUM_REQUESTS = 200


def test_chaos_kill_and_restart(redis_url, tmp_path):
    tiny = load_model("tiny")
    c = Cluster(redis_url, tmp_path)
    rng = random.Random(7)
    names = [f"{role}{i}" for role in ("prefill", "decode") for i in range(2)]
    for name in names:   # loading together, while this process computes the oracle
        c.start(name.rstrip("01"), *FAST, worker_id=name, wait=False)
    prompts = mixed_prompts(NUM_REQUESTS, seed=3)
    params = [{"max_tokens": rng.choice([16, 64, 256]), "temperature": 0.0 if i % 3 else 0.8, "seed": i}
              for i in range(NUM_REQUESTS)]
    prompt_ids, expected, sampling = oracle(tiny, prompts, params)
    for name in names:
        c.wait_registered(name)
    client = Client(redis_url)
    kills: list[tuple[float, str]] = []
    stop = threading.Event()

    def chaos():
        n = 0
        while not stop.wait(rng.uniform(1.0, 2.0)):
            victim = rng.choice(sorted(w for w, p in c.procs.items() if p.poll() is None))
            c.signal(victim, signal.SIGKILL)
            c.procs[victim].wait()
            kills.append((time.time() * 1000, victim))
            n += 1
            role = victim.rstrip("0123456789").split("-")[0]
            # Half restart under the same consumer name (resuming its own pending), half new.
            c.start(role, *FAST, worker_id=victim if n % 2 else f"{role}{10 + n}")

    killer = threading.Thread(target=chaos, daemon=True)
    try:
        handles = []
        num_batches = NUM_REQUESTS // 20
        for j, i in enumerate(range(0, NUM_REQUESTS, 20)):  # arrivals spread over time
            # Paced by the kills, not only by the clock: by the last batch at least 3 workers
            # have died with work in hand, however fast the cluster gets through it.
            deadline = time.monotonic() + 60
            while len(kills) < 3 * j // (num_batches - 1) and time.monotonic() < deadline:
                time.sleep(0.05)
            handles += client.submit_many([dict(prompt=p, **kw) for p, kw in
                                           zip(prompts[i:i + 20], params[i:i + 20])])
            if i == 0:
                killer.start()
            time.sleep(1.0)
        results = [h.result(timeout=300) for h in handles]
        stop.set()
        killer.join()
        for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
            assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp)
        r = redis.Redis.from_url(redis_url)
        counts = collections.Counter(f[b"id"].decode() for _, f in r.xrange(Keys().done))
        assert len(results) == NUM_REQUESTS
        assert sorted(counts[h.request_id] for h in handles) == [1] * NUM_REQUESTS, "lost or duplicated"
        assert len(kills) >= 3, "the chaos thread should have killed several workers"
        assert_ledger_is(r, Keys(), handles, results)
        # Recovery: a request resumed elsewhere (recompute) stalled once; its longest gap
        # between consecutive tokens is the time from its worker's death to the resumed stream.
        stalls = []
        for h, res in zip(handles, results):
            if res.transfer_path != "recompute":
                continue
            times = [entry_id_ms(eid) for eid, f in r.xrange(Keys().out(h.request_id)) if f[b"type"] == b"token"]
            gaps = [b - a for a, b in zip(times, times[1:])]
            if gaps:
                stalls.append(max(gaps))
        print(f"\nchaos: {len(kills)} kills ({', '.join(v for _, v in kills)}); {len(stalls)} requests resumed "
              f"by recompute; recovery (longest token gap): p50 "
              f"{statistics.median(stalls) if stalls else 0:.0f} ms, max {max(stalls, default=0):.0f} ms")
        wait_pools_free(c, timeout=30)
        # A SIGKILLed prefill cannot unlink its segment; the next prefill start on this node
        # removes it once the registry and the pid both say its owner is gone: wait until the
        # registry lists only live workers (the killed ones' heartbeats expired).
        live = {w for w, p in c.procs.items() if p.poll() is None}
        wait_for(lambda: set(c.workers()) <= live, timeout=30, what="the killed workers' heartbeats to expire")
        c.start("prefill", *FAST, worker_id="prefill-final")
        # Its sweeps (every min(TTL, lease) / 3) remove them, each once the last lease its
        # owner exported could have ended (keep_until: --lease-s after the last export, and
        # the chaos thread kills until the end): within 2x that.
        lease_s, sweep_s = float(FAST[FAST.index("--lease-s") + 1]), 0.5
        wait_for(lambda: not c.dead_segments(), timeout=2 * (lease_s + sweep_s),
                 what="the dead workers' segments removed")
    finally:
        stop.set()
        codes = c.stop_all()
    assert not c.segments(list(codes))
