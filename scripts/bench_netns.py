"""KV transfer across two network namespaces (veth + bridge), as between two hosts.

    .venv/bin/python scripts/bench_netns.py transfer [--tokens 128,512,2048] [--repeats 7] [--json]
    .venv/bin/python scripts/bench_netns.py serve [--model smollm2] [--requests 6] [--json]

Both run as root (``tests/netns.py`` makes the namespaces; nothing touches the machine's own
network, and everything is removed at the end, also on Ctrl-C or an error).

``transfer``: `pdqueue bench transfer`'s network paths, from a prefill-side process on one
host to a decode-side process on another, over the veth pair: ``tcp`` and ``zmq``
(``KVReceiver.fetch`` forced to each path, authenticated as workers run by default) against
``raw_socket`` (``sendall`` / ``recv_into`` of the same bytes straight into the pool, the
limit of any wire), all in the same rounds (order alternating) on SmolLM2's KV layout
(45 KiB/token, fp32). The bytes that arrive are checked against the sender's (the pool is
filled from a fixed seed on both sides).

``serve``: real workers, Redis on a third host: one prefill worker and two decode workers
(one with ``--transfer tcp``, one with ``--transfer zmq``) on their hosts; prompts of
``--prompt-tokens`` random token ids are sent one at a time and each ``done`` entry gives
``transfer_ms`` (the decode side's KV fetch), ``ttft_ms`` (enqueue to token 0, which the
prefill worker publishes) and ``ttst_ms`` (enqueue to token 1, the first the decode worker
makes: the transfer is on this path). Reported per path: medians and transfer / TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMOLLM2_DIMS = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
CLUSTER = "bench"


# -- the prefill side (runs on host "prefill") ----------------------------------------------

def peer(args) -> None:
    import socket
    import threading
    from multiprocessing.connection import Listener

    import torch

    from pdqueue.bench.transfer_bench import _serve_raw, _wait_for_blocks
    from pdqueue.engine.kv_cache import KVCacheLayout
    from pdqueue.transfer import KVAuth, KVSender, SharedKVPool, node_id

    torch.set_num_threads(1)
    layout = KVCacheLayout(num_blocks=args.blocks, **SMOLLM2_DIMS)
    pool = SharedKVPool.create(layout, "pdq-kv-benchnetns", "bench-prefill", secrets.token_hex(6))
    try:
        torch.manual_seed(0)
        pool.tensor.uniform_(-1, 1)
        sender = KVSender.for_shared_pool(pool, node_id(), lease_s=120, endpoint=f"tcp://{args.addr}:*",
                                          auth=KVAuth(bytes.fromhex(args.secret), CLUSTER))
        raw = socket.create_server((args.addr, 0))
        threading.Thread(target=_serve_raw, args=(raw, pool.tensor), daemon=True).start()
        with Listener(args.ctl, "AF_UNIX", authkey=args.secret.encode()) as listener, listener.accept() as conn:
            conn.send({"raw_port": raw.getsockname()[1], "zmq": sender.endpoint, "data": sender.data_endpoint})
            while True:
                cmd, *rest = conn.recv()
                if cmd == "close":
                    break
                _wait_for_blocks(sender)
                conn.send(sender.export(*rest).to_dict())
        sender.close()
    finally:
        pool.close()


# -- the decode side (runs on host "decode") -----------------------------------------------

def decode(args) -> None:
    import socket
    from multiprocessing.connection import Client as ConnClient

    import torch

    from pdqueue.bench.stats import median
    from pdqueue.bench.transfer_bench import _raw_fetch, _timed
    from pdqueue.engine.kv_cache import KVCacheLayout
    from pdqueue.transfer import KVAuth, KVReceiver, Ticket, node_id
    from pdqueue.transfer.blocks import planes

    torch.set_num_threads(1)
    layout = KVCacheLayout(num_blocks=args.blocks, **SMOLLM2_DIMS)
    pool = layout.allocate()
    pool.fill_(0)
    torch.manual_seed(0)
    expected = torch.empty_like(pool).uniform_(-1, 1)   # what the sender's pool holds
    auth = KVAuth(bytes.fromhex(args.secret), CLUSTER)
    receivers = {m: KVReceiver(pool, layout, node_id(), mode=m, timeout_s=60, auth=auth) for m in ("tcp", "zmq")}
    conn = ConnClient(args.ctl, "AF_UNIX", authkey=args.secret.encode())
    info = conn.recv()
    raw = socket.create_connection((args.peer, info["raw_port"]))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    flat = pool.view(-1).view(torch.uint8)
    seq = 0
    rows = []
    for tokens in args.tokens:
        n = -(-tokens // layout.block_size)
        ids = list(range(n))
        nbytes = n * 2 * layout.num_layers * layout.block_nbytes

        def fetch(mode):
            nonlocal seq
            seq += 1
            conn.send(("export", f"r{seq}", ids, tokens))
            ticket = Ticket.from_dict(conn.recv())
            return _timed(lambda: receivers[mode].fetch(ticket, ids))

        runners = {"tcp": lambda: fetch("tcp"), "zmq": lambda: fetch("zmq"),
                   "raw_socket": lambda: _timed(lambda: _raw_fetch(raw, memoryview(flat.numpy())[:nbytes]))}
        for path, fn in runners.items():   # warm-up, and the bytes checked once per path
            pool.zero_()
            fn()
            if path == "raw_socket":
                ok = torch.equal(flat[:nbytes], expected.view(-1).view(torch.uint8)[:nbytes])
            else:
                ok = torch.equal(planes(pool)[:, :n], planes(expected)[:, :n])
            if not ok:
                raise SystemExit(f"{path} delivered wrong bytes at {tokens} tokens")
        seconds = {p: [] for p in runners}
        for round_ in range(args.repeats):
            for path in (list(runners) if round_ % 2 == 0 else list(reversed(runners))):
                seconds[path].append(runners[path]())
        row = {"tokens": tokens, "bytes": nbytes, "paths": {}}
        for path, values in seconds.items():
            s = median(values)
            row["paths"][path] = {"ms": round(s * 1e3, 3), "gb_s": round(nbytes / s / 1e9, 3)}
        raw_s = row["paths"]["raw_socket"]["ms"]
        row["vs_raw_socket"] = {p: round(raw_s / row["paths"][p]["ms"], 3) for p in ("tcp", "zmq")}
        rows.append(row)
    conn.send(("close",))
    for r in receivers.values():
        r.close()
    raw.close()
    print(json.dumps(rows), flush=True)


# -- the runs (root namespace) ----------------------------------------------------------------

def run_transfer(args) -> dict:
    from tests import netns

    blocks = -(-max(args.tokens) // SMOLLM2_DIMS["block_size"])
    secret = secrets.token_hex(32)
    mib = blocks * 2 * SMOLLM2_DIMS["num_layers"] * 16 * 3 * 64 * 4 / 2**20
    with netns.Net(["prefill", "decode"], shm_size=f"{int(mib) + 64}m") as net:
        ctl = str(net.workdir / "ctl.sock")
        common = ["--blocks", str(blocks), "--secret", secret, "--ctl", ctl]
        here = [sys.executable, str(Path(__file__).resolve())]
        p = net.popen("prefill", [*here, "_peer", "--addr", net.addr("prefill"), *common], cwd=ROOT)
        deadline = time.monotonic() + 60
        while not os.path.exists(ctl):
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the prefill-side process did not start")
            time.sleep(0.05)
        d = net.popen("decode", [*here, "_decode", "--peer", net.addr("prefill"), "--tokens",
                                 ",".join(map(str, args.tokens)), "--repeats", str(args.repeats), *common],
                      cwd=ROOT, stdout=subprocess.PIPE, text=True)
        out, _ = d.communicate(timeout=1800)
        if d.returncode != 0:
            raise SystemExit(f"the decode-side process failed ({d.returncode})")
        p.wait(30)
    return {"bench": "transfer across network namespaces (veth + bridge)", "layout": "smollm2",
            "repeats": args.repeats, "load_avg": os.getloadavg(), "rows": json.loads(out.strip().splitlines()[-1])}


def run_serve(args) -> dict:
    import random

    import redis

    from pdqueue.client import Client
    from pdqueue.queue.redis_server import find_redis_server_binary
    from tests import netns

    with netns.Net(["redis", "prefill", "decode"], shm_size=f"{args.kv_cache_mb + 64}m") as net:
        sock = net.workdir / "redis.sock"
        logs = Path(args.log_dir or net.workdir)
        logs.mkdir(parents=True, exist_ok=True)
        net.popen("redis", [find_redis_server_binary(), "--bind", net.addr("redis"), "--port", "6379",
                            "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                            "--protected-mode", "no", "--dir", str(net.workdir)], stdout=subprocess.DEVNULL)
        unix_url, tcp_url = f"unix://{sock}", f"redis://{net.addr('redis')}:6379/0"
        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis.from_url(unix_url).ping()
                break
            except (redis.RedisError, OSError):
                if time.monotonic() > deadline:
                    raise SystemExit("Redis did not start in its namespace")
                time.sleep(0.1)
        worker = [sys.executable, "-m", "workers", "worker"]
        common = ["--model", args.model, "--redis-url", tcp_url, "--cluster", CLUSTER, "--threads", str(args.threads),
                  "--kv-cache-mb", str(args.kv_cache_mb)]
        net.popen("prefill", [*worker, "prefill", *common, "--transfer", "tcp", "--bind",
                              f"tcp://{net.addr('prefill')}:*", "--no-prefix-caching"],
                  cwd=ROOT, stdout=open(logs / "prefill.log", "ab"), stderr=subprocess.STDOUT)
        for mode in ("tcp", "zmq"):
            net.popen("decode", [*worker, "decode", *common, "--transfer", mode, "--worker-id", f"decode-{mode}"],
                      cwd=ROOT, stdout=open(logs / f"decode-{mode}.log", "ab"), stderr=subprocess.STDOUT)
        r = redis.Redis.from_url(unix_url, decode_responses=True)
        deadline = time.monotonic() + 300
        while len(r.keys(f"pdq:{{{CLUSTER}}}:worker:*")) < 3:
            gone = [(p.args[-1], p.returncode) for p in net.procs if p.poll() is not None]
            if time.monotonic() > deadline or gone:
                raise SystemExit(f"the workers did not start ({gone}; logs in {logs})")
            time.sleep(0.2)
        rng = random.Random(0)
        client = Client(unix_url, CLUSTER)
        results = []
        for i in range(args.warmup + args.requests * 2):
            ids = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
            res = client.submit(prompt_ids=ids, max_tokens=4, temperature=0.0, ignore_eos=True).result(timeout=300)
            if i >= args.warmup:
                results.append(res)
        by_path: dict[str, list] = {}
        for res in results:
            by_path.setdefault(res.transfer_path, []).append(res)

    def med(values):
        values = sorted(values)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    out = {"bench": "serve across network namespaces", "model": args.model, "prompt_tokens": args.prompt_tokens,
           "threads": args.threads, "load_avg": os.getloadavg(), "paths": {}}
    for path, rs in sorted(by_path.items()):
        out["paths"][path] = {
            "requests": len(rs), "transfer_ms": round(med([r.transfer_ms for r in rs]), 2),
            "transfer_mib": round(med([r.transfer_bytes for r in rs]) / 2**20, 2),
            "ttft_ms": round(med([r.ttft_ms for r in rs]), 1), "ttst_ms": round(med([r.ttst_ms for r in rs]), 1),
            "transfer_share_of_ttft": round(med([r.transfer_ms / r.ttft_ms for r in rs]), 4),
            "transfer_share_of_ttst": round(med([r.transfer_ms / r.ttst_ms for r in rs]), 4)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("transfer", help="tcp and zmq against a raw socket over a veth pair")
    t.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 2048])
    t.add_argument("--repeats", type=int, default=7)
    t.add_argument("--json", action="store_true")
    s = sub.add_parser("serve", help="transfer time as a share of TTFT with real workers on three hosts")
    s.add_argument("--model", default="smollm2")
    s.add_argument("--prompt-tokens", type=int, default=512)
    s.add_argument("--requests", type=int, default=6, help="per path (tcp, zmq), sent one at a time")
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--kv-cache-mb", type=int, default=512)
    s.add_argument("--log-dir", default=None, help="keep the workers' logs here")
    s.add_argument("--json", action="store_true")
    for name in ("_peer", "_decode"):   # the two sides of `transfer`, run inside the namespaces
        h = sub.add_parser(name)
        h.add_argument("--blocks", type=int, required=True)
        h.add_argument("--secret", required=True)
        h.add_argument("--ctl", required=True)
        h.add_argument("--addr")
        h.add_argument("--peer")
        h.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")])
        h.add_argument("--repeats", type=int)
    args = p.parse_args()
    if args.cmd == "_peer":
        return peer(args)
    if args.cmd == "_decode":
        return decode(args)
    from tests import netns

    reason = netns.unavailable()
    if reason:
        raise SystemExit(f"cannot make network namespaces: {reason}")
    result = run_transfer(args) if args.cmd == "transfer" else run_serve(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['bench']} (load average {', '.join(f'{x:.2f}' for x in result['load_avg'])})")
    if args.cmd == "transfer":
        print(f"{'tokens':>7} {'MiB':>7} {'tcp ms':>8} {'zmq ms':>8} {'raw ms':>8} {'tcp/raw':>8} {'zmq/raw':>8}")
        for row in result["rows"]:
            ps = row["paths"]
            print(f"{row['tokens']:>7} {row['bytes'] / 2**20:>7.1f} {ps['tcp']['ms']:>8.2f} {ps['zmq']['ms']:>8.2f} "
                  f"{ps['raw_socket']['ms']:>8.2f} "
                  f"{row['vs_raw_socket']['tcp']:>8.2f} {row['vs_raw_socket']['zmq']:>8.2f}")
        print("x/raw: raw socket time / path time (1.0 = as fast as a raw socket)")
    else:
        for path, v in result["paths"].items():
            print(f"{path}: {v['requests']} requests, {v['transfer_mib']} MiB each; transfer {v['transfer_ms']} ms, "
                  f"TTFT {v['ttft_ms']} ms, to token 1 {v['ttst_ms']} ms; transfer / TTFT "
                  f"{100 * v['transfer_share_of_ttft']:.2f}%, "
                  f"/ time to token 1 {100 * v['transfer_share_of_ttst']:.2f}%")


if __name__ == "__main__":
    main()
