"""Helpers shared by test modules (test modules never import from each other).

- ``wait_for``: the one way tests poll for a condition.
- ``FAST``: worker flags that make fault handling quick (short heartbeat TTL, reclaim idle
  time, fetch timeout, lease), for tests that kill or hang workers.
- ``mixed_prompts``, ``oracle``: requests of mixed lengths and the colocated engine's
  tokens for them.
- ``wait_pools_free``: every worker's KV pool back to all-free (from the heartbeats).

Real worker processes live in ``tests/cluster.py``, the token comparison rule in
``tests/oracle.py``.
"""

from __future__ import annotations

import random
import time
from typing import Callable, TypeVar

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


def oracle(loaded, prompts: list[str], params: list[dict]):
    """(prompt ids, the colocated engine's output ids, the SamplingParams) per request."""
    # Imported here: modules that only poll (wait_for) need not load torch.
    from pdqueue.engine.config import EngineConfig
    from pdqueue.engine.llm_engine import LLMEngine
    from pdqueue.engine.sampling import SamplingParams

    engine = LLMEngine(loaded, EngineConfig(model="tiny", kv_cache_mb=16))
    ids = [loaded.tokenizer.encode(p) for p in prompts]
    sp = [SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"], top_p=p.get("top_p", 1.0),
                         top_k=p.get("top_k", 0), seed=p["seed"], ignore_eos=p.get("ignore_eos", False))
          for p in params]
    return ids, engine.generate(ids, sp), sp


def wait_pools_free(cluster, timeout: float = 20.0) -> None:
    """Every worker's KV pool back to all-free and no lease held (from the heartbeats) of
    ``cluster`` (a ``tests.cluster.Cluster``)."""
    busy: dict = {}

    def all_free() -> bool:
        loads = {wid: w.get("load", {}) for wid, w in cluster.workers().items()}
        busy.clear()
        busy.update({wid: l for wid, l in loads.items()
                     if l.get("kv_free") != l.get("kv_total") or l.get("leases", 0) or l.get("running", 0)})
        return not busy

    try:
        wait_for(all_free, timeout, what="every KV pool all-free", interval=0.2)
    except AssertionError:
        raise AssertionError(f"pools not all-free after {timeout:g} s: {busy}") from None
