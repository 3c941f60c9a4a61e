"""Chaos for the elastic levers, with real worker processes on a real Redis: 200 requests of
mixed lengths through switchable workers (a prefill worker, a decode worker taking placed
prompts, two colocated workers on the chunked policy) while a chaos thread, about every
second, moves running decodes with their KV (``op=migrate``), changes a colocated worker's
TBT budget (``op=budget``), switches a role (``op=switch``), and now and then SIGKILLs a
worker and starts it again. Every request is answered exactly once, with the colocated
engine's tokens; each lever fired (read from the ``events`` stream), and no KV block,
lease or segment is left behind."""

from __future__ import annotations

import collections
import random
import signal
import threading
import time

import pytest

from pdqueue.client import Client
from pdqueue.control import commands
from pdqueue.models.loader import load_model
from pdqueue.protocol import as_str
from tests.cluster import Cluster
from tests.helpers import FAST, mixed_prompts, oracle, wait_for, wait_pools_free
from tests.oracle import assert_same_tokens

NUM_REQUESTS = 200
BATCH = 20
LEASE_S = 5.0   # a killed worker's segment may go LEASE_S after its last export
BASE = (*FAST, "--lease-s", f"{LEASE_S:g}", "--switchable")
CHUNKED = ("--policy", "chunked", "--tbt-slo-ms", "200")
# name -> (role at start, its flags); p0 and c1 are the workers whose roles flip.
WORKERS = {
    "p0": ("prefill", BASE),
    "d0": ("decode", (*BASE, "--take-prompts", *CHUNKED)),
    "c0": ("colocated", (*BASE, *CHUNKED)),
    "c1": ("colocated", (*BASE, *CHUNKED)),
}
FLIPS = {"p0": ("prefill", "colocated"), "c1": ("colocated", "decode")}
# One lever a tick, in this order (kills at ticks 2, 10, 18: at most MAX_KILLS).
SCHEDULE = ("migrate", "budget", "kill", "switch", "migrate", "budget", "migrate", "switch")
TICKS_PER_BATCH = 2   # a batch of requests goes in every other tick
MAX_KILLS = 3
# What must have happened for the test to mean anything.
MIN_MIGRATIONS, MIN_MOVED, MIN_BUDGETS, MIN_SWITCHES, MIN_KILLS = 3, 5, 3, 2, 2


def events_by_command(r, keys) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = collections.defaultdict(list)
    for _eid, fields in r.xrange(keys.events):
        f = {as_str(k): as_str(v) for k, v in fields.items()}
        if f.get("type") in commands.OPS:
            out[f.get("command", "")].append(f)
    return out


@pytest.mark.processes
def test_levers_and_kills_under_load_lose_nothing_and_double_nothing(redis_url, tmp_path, one_thread):
    tiny = load_model("tiny")
    c = Cluster(redis_url, tmp_path)
    keys, r = c.keys, c.r
    rng = random.Random(11)
    for name, (role, args) in WORKERS.items():   # loading in parallel
        c.start(role, *args, worker_id=name, wait=False)
    prompts = mixed_prompts(NUM_REQUESTS, seed=21)
    params = [{"max_tokens": rng.choice([16, 64, 256]), "temperature": 0.0 if i % 3 else 0.8, "seed": 500 + i}
              for i in range(NUM_REQUESTS)]
    prompt_ids, expected, sampling = oracle(tiny, prompts, params)   # while they load
    for name in WORKERS:
        c.wait_registered(name)
    client = Client(redis_url)

    sent: list[tuple[str, str, str]] = []   # (lever, command id, worker)
    kills: list[str] = []
    errors: list[BaseException] = []
    ticks = [0]
    stop = threading.Event()

    def beats() -> dict[str, dict]:
        return c.workers()

    def in_flight(worker: str) -> bool:
        """A switch or migration sent to ``worker`` not answered yet (a second one would be
        refused; it is not wrong, only wasted)."""
        mine = [cid for lever, cid, w in sent if w == worker and lever in ("switch", "migrate")]
        if not mine:
            return False
        final = [e for e in commands.switch_events(r, keys, mine[-1]) if e["status"] in ("done", "refused", "failed")]
        return not final

    def migrate(workers: dict) -> None:
        busy = [n for n, w in workers.items() if w.get("role") == "colocated" and not w.get("switching_to")
                and w.get("load", {}).get("running", 0) > 0 and not in_flight(n)]
        if busy:
            name = max(busy, key=lambda n: workers[n]["load"]["running"])
            sent.append(("migrate", commands.send_migrate(r, keys, c.id(name), rng.choice([2, 3, 4]), by="chaos"),
                         name))

    def budget(workers: dict) -> None:
        names = [n for n, w in workers.items() if w.get("role") == "colocated" and not w.get("switching_to")
                 and "--tbt-slo-ms" in WORKERS[n][1]]   # (p0 as colocated has no budget: prefill_first)
        if names:
            name = rng.choice(names)
            value = rng.choice([60.0, 100.0, 200.0, 400.0, None])
            sent.append(("budget", commands.send_budget(r, keys, c.id(name), value, by="chaos"), name))

    def switch(workers: dict) -> None:
        names = [n for n in FLIPS if n in workers and not workers[n].get("switching_to") and not in_flight(n)]
        if names:
            name = rng.choice(names)
            a, b = FLIPS[name]
            role = b if workers[name]["role"] == a else a
            sent.append(("switch", commands.send_switch(r, keys, c.id(name), role, workers[name]["role_epoch"],
                                                        by="chaos"), name))

    def kill(_workers: dict) -> None:
        if len(kills) >= MAX_KILLS:
            return
        victim = rng.choice(sorted(n for n, p in c.procs.items() if p.poll() is None))
        c.signal(victim, signal.SIGKILL)
        c.procs[victim].wait()
        kills.append(victim)
        role, args = WORKERS[victim]
        # its role at start, resuming its own pending entries; not waited for (the levers go
        # on while it loads, and it may be killed again before it serves)
        c.start(role, *args, worker_id=victim, wait=False)

    levers = {"migrate": migrate, "budget": budget, "switch": switch, "kill": kill}

    def chaos() -> None:
        try:
            while not stop.wait(rng.uniform(0.5, 0.9)):
                levers[SCHEDULE[ticks[0] % len(SCHEDULE)]](beats())
                ticks[0] += 1
        except BaseException as exc:   # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=chaos, daemon=True)
    started = time.monotonic()
    try:
        handles = []
        for j, i in enumerate(range(0, NUM_REQUESTS, BATCH)):   # arrivals spread over ~15 s
            # Paced by the chaos thread, so every batch meets some levers however fast (or
            # slow) this machine is.
            wait_for(lambda: ticks[0] >= TICKS_PER_BATCH * j or errors, timeout=60, what=f"chaos tick {j}",
                     interval=0.05)
            handles += client.submit_many([dict(prompt=p, **kw) for p, kw in
                                           zip(prompts[i:i + BATCH], params[i:i + BATCH])])
            if i == 0:
                thread.start()
        results = [h.result(timeout=300) for h in handles]
        stop.set()
        thread.join(timeout=120)
        assert not errors, errors
        load_s = time.monotonic() - started

        # 0 lost, 0 doubled: one done entry per request, one final entry on out:<id>
        counts = collections.Counter(f[b"id"].decode() for _, f in r.xrange(keys.done))
        wrong = {h.request_id: counts[h.request_id] for h in handles if counts[h.request_id] != 1}
        assert not wrong, f"done entries per request (want 1): {wrong}"
        with r.pipeline(transaction=False) as pipe:
            for h in handles:
                pipe.xrange(keys.out(h.request_id))
            outs = pipe.execute()
        for h, entries in zip(handles, outs):
            finals = [f[b"type"] for _, f in entries if f[b"type"] in (b"done", b"error")]
            assert finals == [b"done"], (h.request_id, finals)
        # token for token the colocated engine's (or a recorded near-tie flip)
        for pid, exp, res, sp in zip(prompt_ids, expected, results, sampling):
            assert_same_tokens(tiny, pid, exp, list(res.token_ids), sp, label=res.request_id)

        # the levers fired: what the workers answered, from the events stream
        events = events_by_command(r, keys)
        final = {cid: next((e for e in events.get(cid, []) if e["status"] in ("done", "refused", "failed")), None)
                 for _, cid, _ in sent}
        done = collections.Counter(lever for lever, cid, _ in sent if final[cid] and final[cid]["status"] == "done")
        migrations = [int(final[cid]["moved"]) for lever, cid, _ in sent
                      if lever == "migrate" and final[cid] and final[cid]["status"] == "done"]
        moved = [res for res in results if res.prefill_worker != res.decode_worker
                 and res.prefill_worker in {c.id("c0"), c.id("c1")}]
        summary = (f"{len(results)} answers in {load_s:.1f} s; levers sent "
                   f"{dict(collections.Counter(lever for lever, _, _ in sent))}, done {dict(done)}; "
                   f"not done {dict(collections.Counter((lever, final[cid]['status'] if final[cid] else 'no answer', final[cid].get('reason', '') if final[cid] else '') for lever, cid, _ in sent if not final[cid] or final[cid]['status'] != 'done'))}; "
                   f"migrations moved {migrations}; {len(moved)} answers finished off the colocated worker "
                   f"that started them; kills {kills}; transfer paths "
                   f"{dict(collections.Counter(res.transfer_path for res in results))}")
        print("\n" + summary)
        assert sum(m > 0 for m in migrations) >= MIN_MIGRATIONS and sum(migrations) >= MIN_MOVED, summary
        assert done["budget"] >= MIN_BUDGETS and done["switch"] >= MIN_SWITCHES, summary
        assert len(kills) >= MIN_KILLS, summary
        assert moved, summary   # requests a colocated worker started were finished by another

        # nothing leaked: pools all-free, no lease; the killed workers' segments removed by
        # the live workers' sweeps once their last lease could have ended
        wait_pools_free(c, timeout=30)
        live = {n for n, p in c.procs.items() if p.poll() is None}
        wait_for(lambda: set(c.workers()) <= live, timeout=30, what="the killed workers' heartbeats to expire")
        wait_for(lambda: not c.dead_segments(), timeout=2 * (LEASE_S + 1.0), what="the dead workers' segments removed")
    finally:
        stop.set()
        codes = c.stop_all()
    assert all(code == 0 for code in codes.values()), {n: (code, c.log(n)) for n, code in codes.items()}
    assert not c.segments(list(codes)), c.segments(list(codes))
