"""A conversation's second turn: its TTFT when the history is pulled from the decode worker
that holds it (workers/kv_pull.py, --kv-pull always) against when it is computed again
(--kv-pull never), at several history lengths, on shm (one node) and TCP (the decode
worker on another node id), on real workers.

    .venv/bin/python scripts/bench_turns.py [--model smollm2] [--history 512 1024 2048]
                                            [--paths shm tcp] [--rounds 3] [--json]
                                            [--kv-wire-format native|fp16|int8]

Per path: an embedded Redis; decode worker d (``--switchable`` for shm: its pool a shared
segment; ``PDQ_NODE_ID`` of another node for tcp);
prefill worker p1 (the first turns; --kv-pull never) and two more prefill workers, ``pull``
(--kv-pull always) and ``recompute`` (--kv-pull never), all on this node, one torch thread
each, --routing off. Per history length and round, for each way, in alternating order: a new
conversation (random token ids, so no worker caches it): the first turn (history minus 32
tokens of prompt, 32 answer tokens, greedy) through p1 and d, whose finished KV d then
holds; the second turn (the history plus 32 new tokens, 1 answer token) on the worker of
that way, read from its own stream. Reported: the second turn's TTFT, the ratio
recompute/pull (median), the bytes the pull moved (the puller's ``kv_pull_bytes``), the
answers compared (both ways must give the same first token). Nothing else should run on the
machine meanwhile (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ANSWER = 32   # first turn's answer tokens
NEW = 32      # the second turn's new tokens


class Workers:
    """Worker processes of one path against one embedded Redis."""

    def __init__(self, model: str, path: str, log_dir: Path, kv_cache_mb: int):
        from pdqueue.client import Client
        from pdqueue.queue.redis_server import RedisServer

        self.model, self.path, self.log_dir, self.kv_cache_mb = model, path, log_dir, kv_cache_mb
        log_dir.mkdir(parents=True, exist_ok=True)
        self.server = RedisServer()
        self.server.start()
        self.cluster = "bench-turns"
        self.procs: dict[str, subprocess.Popen] = {}
        self.client = Client(self.server.url, self.cluster)
        self.tag = f"{os.getpid()}"

    def start(self, role: str, name: str, *args: str, env: dict | None = None) -> None:
        argv = [sys.executable, "-m", "workers", "worker", role, "--model", self.model, "--redis-url",
                self.server.url, "--cluster", self.cluster, "--worker-id", self.wid(name), "--threads", "1",
                "--kv-cache-mb", str(self.kv_cache_mb), "--routing", "off", *args]
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                                env={**os.environ, **(env or {})}, start_new_session=True)

    def wid(self, name: str) -> str:
        return f"{name}-{self.tag}"

    def wait_ready(self, timeout_s: float = 600) -> None:
        from pdqueue.queue.registry import list_workers

        deadline = time.monotonic() + timeout_s
        while {self.wid(n) for n in self.procs} - {w["worker_id"] for w in list_workers(self.client.redis,
                                                                                       self.client.keys)}:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs.values()):
                raise RuntimeError(f"workers did not start: see {self.log_dir}")
            time.sleep(0.1)

    def ask(self, name: str, prompt_ids: list[int], max_tokens: int):
        own = self.client.keys.requests_for(self.wid(name))
        self.client._stream_of = lambda req: own   # read by that worker first (workers/routing.py)
        return self.client.submit(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=0.0, seed=0,
                                  ignore_eos=True).result(timeout=600)

    def load(self, name: str) -> dict:
        raw = self.client.redis.hget(self.client.keys.worker(self.wid(name)), "load")
        return json.loads(raw) if raw else {}

    def close(self) -> None:
        import signal

        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.client.close()
        self.server.stop()


def second_turn(w: Workers, way: str, history: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = 256 if w.model == "tiny" else 32000
    turn1 = [rng.randrange(1, vocab) for _ in range(history - ANSWER)]
    first = w.ask("p1", turn1, ANSWER)
    turn2 = turn1 + list(first.token_ids) + [rng.randrange(1, vocab) for _ in range(NEW)]
    time.sleep(1.5)   # the hold's keys are written with the done entry; the heartbeats settle
    before = w.load(way)
    second = w.ask(way, turn2, 1)
    deadline = time.monotonic() + 6   # the puller's next heartbeat shows its pull (or failure)
    after = w.load(way)
    while way == "pull" and time.monotonic() < deadline and all(
            after.get(k, 0) == before.get(k, 0) for k in ("kv_pulls", "kv_pull_failed", "kv_pull_declined")):
        time.sleep(0.2)
        after = w.load(way)
    paths = [k[len("kv_pulls_"):] for k in after if k.startswith("kv_pulls_") and after[k] != before.get(k, 0)]
    return {"ttft_ms": second.ttft_ms, "cached_tokens": second.cached_tokens,
            "pull_bytes": after.get("kv_pull_bytes", 0) - before.get("kv_pull_bytes", 0),
            "pulled_over": ",".join(paths) or "-", "token": second.token_ids[0], "load_avg": os.getloadavg()[0]}


def run_path(args, path: str, log_root: Path) -> dict:
    w = Workers(args.model, path, log_root / path, args.kv_cache_mb)
    try:
        other = {"PDQ_NODE_ID": f"bench-turns-other-{os.getpid()}"} if path == "tcp" else None
        # shm: the decode worker's pool a shared segment (--switchable), as a prefill worker's is
        w.start("decode", "d", *(("--switchable",) if path == "shm" else ()), env=other)
        w.start("prefill", "p1", "--kv-pull", "never")
        fmt = ("--kv-wire-format", args.kv_wire_format) if path == "tcp" else ()   # shm copies native
        w.start("prefill", "pull", "--kv-pull", "always", *fmt)
        w.start("prefill", "recompute", "--kv-pull", "never")
        w.wait_ready()
        w.ask("p1", [1, 2, 3, 4] * 40, 4)   # warm-up: model, sockets, step cost
        out: dict = {}
        for history in args.history:
            rows: dict[str, list[dict]] = {"pull": [], "recompute": []}
            for i in range(args.rounds):
                for way in (("pull", "recompute") if i % 2 == 0 else ("recompute", "pull")):
                    row = second_turn(w, way, history, seed=history * 1000 + i)
                    rows[way].append(row)
                    if not args.json:
                        print(f"{path} history {history} round {i + 1} {way:9s} ttft {row['ttft_ms']:.1f} ms, "
                              f"cached {row['cached_tokens']}, pulled {row['pull_bytes'] / 1e6:.2f} MB over "
                              f"{row['pulled_over']}, "
                              f"load {row['load_avg']:.2f}", flush=True)
            med = {way: statistics.median(r["ttft_ms"] for r in rs) for way, rs in rows.items()}
            out[history] = {"rounds": rows, "median_ttft_ms": med,
                            "recompute_over_pull": med["recompute"] / med["pull"] if med["pull"] else None,
                            "pull_bytes": statistics.median(r["pull_bytes"] for r in rows["pull"]),
                            "same_first_token": all(a["token"] == b["token"]
                                                    for a, b in zip(rows["pull"], rows["recompute"]))}
        return out
    finally:
        w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--history", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--paths", nargs="+", choices=("shm", "tcp"), default=["shm", "tcp"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-mb", type=int, default=1024)
    ap.add_argument("--kv-wire-format", choices=("native", "fp16", "int8"), default="native",
                    help="what the tcp path's puller asks the holder for (bytes moved per format)")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    log_root = Path(args.log_dir or f"/tmp/pdq-bench-turns-{os.getpid()}")
    result = {"model": args.model, "paths": {path: run_path(args, path, log_root) for path in args.paths}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"\n{'path':5s} {'history':>8s} {'pulled ms':>10s} {'recomputed ms':>14s} {'ratio':>6s} {'MB moved':>9s}")
    for path, rows in result["paths"].items():
        for history, row in rows.items():
            med = row["median_ttft_ms"]
            ratio = row["recompute_over_pull"]
            print(f"{path:5s} {history:8d} {med['pull']:10.1f} {med['recompute']:14.1f} "
                  f"{ratio if ratio is not None else float('nan'):6.2f} {row['pull_bytes'] / 1e6:9.2f}"
                  + ("" if row["same_first_token"] else "  (first tokens differ!)"))


if __name__ == "__main__":
    main()
