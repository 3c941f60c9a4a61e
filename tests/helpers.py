"""Helpers shared by test modules (test modules never import from each other).

- ``wait_for``: the one way tests poll for a condition.
- ``FAST``: worker flags that make fault handling quick (short heartbeat TTL, reclaim idle
  time, fetch timeout, lease), for tests that kill or hang workers.
- ``mixed_prompts``, ``oracle``: requests of mixed lengths and the colocated engine's
  tokens for them.
- ``wait_pools_free``: every worker's KV pool back to all-free (from the heartbeats).
- ``pdqueue_up``: a real ``pdqueue up`` (tiny model, 1 prefill + 1 decode, a gateway) on a
  given Redis, stopped with SIGINT when the block ends.
- ``assert_ledger_is``: one usage record per request, counting what its client received.

Real worker processes live in ``tests/cluster.py``, the token comparison rule in
``tests/oracle.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

FAST = ("--heartbeat-ttl-s", "1.5", "--reclaim-idle-ms", "3000", "--fetch-timeout-s", "2", "--lease-s", "10")


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, what: str = "condition",
             interval: float = 0.02) -> T:
    """Poll ``predicate()`` every ``interval`` s until it returns something truthy, and return
    that value. Past ``timeout`` s (one last check included), raise AssertionError naming
    ``what``: a timeout is a test failure, so callers never check the result themselves."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while seven ravens watch quietly".split()
    out = []
    for i in range(n):
        length = rng.choice([1, 3, 15, 16, 17, 40, 90, 200])
        out.append(" ".join(rng.choice(words) for _ in range(length))[: max(1, length * 3)])
    return out


# Where ``oracle`` keeps what it computed, shared by the xdist workers of one run (set by
# tests/conftest.py for the session; None: computed every time).
ORACLE_CACHE: Path | None = None


def oracle(loaded, prompts: list[str], params: list[dict]):
    """(prompt ids, the colocated engine's output ids, the SamplingParams) per request.

    The same load of the same weights gives the same tokens (seeded sampling, batch
    invariance: tests/test_engine.py), so with ``ORACLE_CACHE`` set the answer is computed
    once per run and read back after: test_migration's module oracle (8 x 1500 tokens, ~30
    CPU-s) was computed by each xdist worker that ran one of its tests, again whenever a
    worker came back to that module, while another worker computed it too."""
    # Imported here: modules that only poll (wait_for) need not load torch.
    from pdqueue.engine.sampling import SamplingParams

    sp = [SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"], top_p=p.get("top_p", 1.0),
                         top_k=p.get("top_k", 0), seed=p["seed"], ignore_eos=p.get("ignore_eos", False))
          for p in params]

    def compute() -> tuple[list, list]:
        from pdqueue.engine.config import EngineConfig
        from pdqueue.engine.llm_engine import LLMEngine

        engine = LLMEngine(loaded, EngineConfig(model="tiny", kv_cache_mb=16))
        ids = [loaded.tokenizer.encode(p) for p in prompts]
        return ids, engine.generate(ids, sp)

    if ORACLE_CACHE is None or not loaded.fingerprint:   # (a model built by hand: no identity to key on)
        ids, outputs = compute()
    else:
        key = json.dumps([loaded.fingerprint, loaded.weights, repr(loaded.config), prompts, params],
                         sort_keys=True, default=repr)
        ids, outputs = _computed_once(hashlib.sha256(key.encode()).hexdigest(), compute)
    return ids, outputs, sp


def _computed_once(key: str, compute: Callable[[], tuple[list, list]]) -> tuple[list, list]:
    """``compute()``'s value, from ``ORACLE_CACHE``/``key``.json when a process of this run
    computed it already; one computes while the others wait (a lock file per key)."""
    import fcntl

    ORACLE_CACHE.mkdir(parents=True, exist_ok=True)
    path = ORACLE_CACHE / f"{key}.json"
    with open(ORACLE_CACHE / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            ids, outputs = json.loads(path.read_text())
            return ids, outputs
        ids, outputs = compute()
        part = path.with_suffix(".part")
        part.write_text(json.dumps([ids, outputs]))
        part.rename(path)
        return ids, outputs


def wait_pools_free(cluster, timeout: float = 20.0) -> None:
    """Every worker's KV pool back to all-free and no lease held (from the heartbeats) of
    ``cluster`` (a ``tests.cluster.Cluster``)."""
    busy: dict = {}

    def all_free() -> bool:
        loads = {wid: w.get("load", {}) for wid, w in cluster.workers().items()}
        busy.clear()
        busy.update({wid: load for wid, load in loads.items()
                     if load.get("kv_free") != load.get("kv_total") or load.get("leases", 0) or load.get("running", 0)})
        return not busy

    try:
        wait_for(all_free, timeout, what="every KV pool all-free", interval=0.2)
    except AssertionError:
        raise AssertionError(f"pools not all-free after {timeout:g} s: {busy}") from None


@contextmanager
def pdqueue_up(redis_url: str, cluster: str, logs: Path, env: dict, log_dir: Path,
               stop_timeout: float = 120.0) -> Iterator[tuple[subprocess.Popen, str]]:
    """``pdqueue up --model tiny`` against ``redis_url`` (its gateway on a free port, worker
    logs in ``log_dir``, its stdout and stderr in ``logs``/up.out and up.err), once it printed
    "ready:": (the process, the gateway's URL). At the end SIGINT, then up to
    ``stop_timeout`` s (killed after that): the caller checks ``proc.returncode`` and up.err."""
    out_path, err_path = logs / "up.out", logs / "up.err"
    root = Path(__file__).resolve().parent.parent
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "workers", "up", "--model", "tiny", "--cluster", cluster,
                                 "--redis-url", redis_url, "--threads", "1", "--kv-cache-mb", "16",
                                 "--gateway-port", "0", "--log-dir", str(log_dir)],
                                stdout=out, stderr=err, cwd=root, env=env, stdin=subprocess.DEVNULL)

    def ready():
        assert proc.poll() is None, f"up exited with {proc.returncode}: {err_path.read_text()}"
        return "ready:" in out_path.read_text()

    try:
        wait_for(ready, 120, what="pdqueue up ready")
        yield proc, re.search(r"OpenAI API: (http://\S+)/v1 ", out_path.read_text()).group(1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_together(code: str, args: list[str], n: int, cache_dir) -> list[str]:
    """``n`` Python processes running ``code`` (with ``args``) at once, on the model cache
    ``cache_dir`` (``$PDQ_CACHE_DIR``); each must exit 0. Returns their standard outputs."""
    env = {**os.environ, "PDQ_CACHE_DIR": str(cache_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=Path(__file__).resolve().parent.parent) for _ in range(n)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    return [out for out, _ in outs]


def assert_ledger_is(r, keys, handles, results) -> None:
    """One usage record per request (written with its done, so there once its client read
    it), whatever kills, restarts and recomputes came before: the tokens its client received,
    the prompt, cached and recomputed tokens its completion says."""
    from pdqueue.queue import ledger

    records = list(ledger.read(r, keys))
    counts = Counter(rec.request_id for rec in records)
    assert all(counts[h.request_id] == 1 for h in handles), {h.request_id: counts[h.request_id] for h in handles
                                                               if counts[h.request_id] != 1}
    by_id = {rec.request_id: rec for rec in records}
    for h, res in zip(handles, results):
        rec = by_id[h.request_id]
        assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens, rec.recomputed_tokens, rec.outcome) == \
            (len(res.token_ids), res.num_prompt_tokens, res.cached_tokens, res.recomputed_tokens,
             res.finish_reason.value), (rec, res)
    ours = [by_id[h.request_id] for h in handles]   # and so the totals
    assert ledger.totals(ours, ())[0]["output_tokens"] == sum(len(res.token_ids) for res in results)


def wait_takes_prompts(cluster, name: str = "d0") -> None:
    """Until the decode worker ``name`` advertises that it takes prompts, and a prefill
    worker's view of the decode workers (read at most every ``decode_peers.EVERY_S``, maybe
    just before that heartbeat) has been read since."""
    from workers.decode_peers import EVERY_S

    wait_for(lambda: cluster.workers()[name]["load"].get("takes_prompts"), what=f"{name} advertising")
    time.sleep(EVERY_S + 0.1)
