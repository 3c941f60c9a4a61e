"""How long a decode worker takes to stop while it holds running requests: with migration
(its requests move, with their KV, to another decode worker) against without (it finishes
them), alternating, on real workers.

    .venv/bin/python scripts/bench_migration.py [--model smollm2] [--requests 32] [--max-tokens 256]
                                                [--rounds 3] [--json]

Each round, each way: an embedded Redis, 1 prefill worker and decode worker d0 (one torch
thread each); ``--requests`` requests (short chat prompts, ``ignore_eos``, greedy) until all
run on d0 with a few tokens out; then decode worker d1 starts, d0 gets SIGTERM, and the time
to its exit is measured; every request must then complete (counted). With migration the
parts come from d0's log line (``workers/migration.py``): stop -> first move (announce,
settle, peers), detach + export, until the peers fetched their KV. Nothing else should run
on the machine meanwhile (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARTS = re.compile(r"(\d+) running requests moved: (\d+) ms from the stop to the first move .*?, (\d+) ms "
                   r"detaching and exporting, then (\d+) ms until the peers had fetched")


def one_stop(model: str, n: int, max_tokens: int, migrate: bool, log_dir: Path) -> dict:
    from pdqueue.client import Client
    from pdqueue.queue.redis_server import free_port
    from workers.cli.local_cluster import LocalCluster, LocalClusterConfig

    extra = () if migrate else ("--no-migrate",)
    lc = LocalCluster(LocalClusterConfig(model=model, cluster="bench-migrate", redis_port=free_port(), threads=1,
                                         kv_cache_mb=256, log_dir=log_dir, worker_args=extra))
    try:
        lc.start_server()
        lc.start_workers()
        lc.wait_ready(timeout_s=600)
        client = Client(lc.url, "bench-migrate")
        handles = client.submit_many([dict(prompt=f"Tell me a story about the number {i}.", max_tokens=max_tokens,
                                           temperature=0.0, ignore_eos=True) for i in range(n)])
        r, keys = client.redis, client.keys
        d0 = next(w for w in lc.workers if w.role == "decode")
        deadline = time.monotonic() + 300
        while not all(r.xlen(keys.out(h.request_id)) >= 3 for h in handles):
            if time.monotonic() > deadline:
                raise TimeoutError("the requests did not all start decoding")
            time.sleep(0.05)
        d1 = lc.spawn("decode", f"decode-late-{lc.run_id}")
        while d1.worker_id not in lc.registered():
            time.sleep(0.05)
        stopped = time.monotonic()
        d0.signal(signal.SIGTERM)
        d0.proc.wait(timeout=600)
        stop_s = time.monotonic() - stopped
        results = [h.result(timeout=600) for h in handles]
        assert len(results) == n and all(len(res.token_ids) == max_tokens for res in results)
        out = {"stop_s": stop_s, "moved": sum(res.decode_worker == d1.worker_id for res in results)}
        if migrate:
            m = PARTS.search(d0.log_path.read_text(errors="replace"))
            if m:
                out.update(zip(("logged_moved", "settle_ms", "export_ms", "fetched_ms"), map(int, m.groups())))
        return out
    finally:
        lc.stop(grace_s=30, keep_logs=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    log_root = Path(args.log_dir or f"/tmp/pdq-bench-migration-{os.getpid()}")
    rows = {"migrate": [], "finish": []}
    for i in range(args.rounds):
        order = ("migrate", "finish") if i % 2 == 0 else ("finish", "migrate")
        for way in order:
            row = one_stop(args.model, args.requests, args.max_tokens, way == "migrate", log_root / f"{way}-{i}")
            row["load_avg"] = os.getloadavg()[0]
            rows[way].append(row)
            if not args.json:
                print(f"round {i + 1} {way:8s} " + " ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in row.items()), flush=True)
    summary = {way: {k: statistics.median(r[k] for r in rs) for k in rs[0] if all(k in r for r in rs)}
               for way, rs in rows.items()}
    result = {"model": args.model, "requests": args.requests, "max_tokens": args.max_tokens, "rounds": rows,
              "median": summary,
              "stop_speedup": summary["finish"]["stop_s"] / summary["migrate"]["stop_s"]}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        spread = {w: (min(r["stop_s"] for r in rs), max(r["stop_s"] for r in rs)) for w, rs in rows.items()}
        print(f"median stop: with migration {summary['migrate']['stop_s']:.2f} s "
              f"(spread {spread['migrate'][0]:.2f}-{spread['migrate'][1]:.2f}), finishing "
              f"{summary['finish']['stop_s']:.2f} s ({spread['finish'][0]:.2f}-{spread['finish'][1]:.2f}): "
              f"{result['stop_speedup']:.1f}x")


if __name__ == "__main__":
    main()
