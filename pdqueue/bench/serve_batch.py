"""`bench serve --batch-lines N`: a batch-class backlog beside the online load (issue 27).

At the start of each rate, N requests of the batch class (seeded short prompts, greedy,
``ignore_eos``, ``--batch-max-tokens`` each) are queued in one pipelined round trip; the
online (Poisson) load then runs as without them. Their answers are counted from the cluster's
``done`` stream (one XREAD loop, not one reader per request), with the time each was answered.
Figures (``batch`` beside the online figures of the rate):

- ``answered``/``duplicates``/``missing``: every line answered once, checked on ``done``;
  and on each line's own answer stream ``out:<id>`` (what its client reads): ``out_not_once``
  lines whose stream does not end in exactly one final entry, a ``done`` (an error entry, or
  none, or two, count), ``short`` lines answered with fewer or more tokens than asked
  (greedy, ``ignore_eos``: each must have exactly ``max_tokens``); ``exactly_once``: all of
  these hold (``bench serve`` exits with status 1 when one does not);
- ``window_s``: from the first online arrival to the last online answer; ``tok_s_in_window``:
  batch output tokens per second answered in that window;
- ``capacity_tok_s``: the cluster's output rate on batch alone, measured on the tail (batch
  answers after the window, when nothing else runs), so in the same run as what it judges;
- ``idle_share_used``: ``tok_s_in_window / (capacity_tok_s - online tok/s in the window)``,
  the share of the capacity the online load left that batch used (None without a tail of at
  least ``MIN_TAIL`` answers).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

from pdqueue.bench.serve_load import Settings
from pdqueue.protocol import entry_id_ms

MIN_TAIL = 10        # batch answers after the window needed to measure the capacity
OUT_CHECK_TRIES = 10


class BatchBeside:
    def __init__(self, url: str, cluster: str, settings: Settings, rate: float):
        self.url, self.cluster, self.settings, self.rate = url, cluster, settings, rate
        self.ids: set[str] = set()
        self.tokens = settings.batch_max_tokens
        self.answered: dict[str, float] = {}   # request id -> time answered (unix s, from the done entry id)
        self.duplicates = 0
        self.short: set[str] = set()             # answered with another number of tokens than asked
        self._reader: asyncio.Task | None = None

    def requests(self) -> list[dict]:
        w = self.settings.workload
        rng = random.Random(f"batch/{self.settings.seed}/{self.rate}")
        run = uuid.uuid4().hex[:8]
        out = []
        for i in range(self.settings.batch_lines):
            prompt = [rng.randrange(3, w.vocab_size) for _ in range(rng.randint(*w.short_prompt))]
            out.append(dict(prompt_ids=prompt, max_tokens=self.tokens, temperature=0.0, ignore_eos=True,
                            id=f"bench-batch-{run}-{i}", service_class="batch"))
        return out

    async def start(self, client) -> None:
        import redis.asyncio

        from pdqueue.keys import Keys

        self._r = redis.asyncio.Redis.from_url(self.url)
        self._done_key = Keys(self.cluster).done
        last = await self._r.xrevrange(self._done_key, count=1)
        self._from = last[0][0] if last else b"0-0"
        specs = self.requests()
        self.ids = {s["id"] for s in specs}
        await client.submit_many(specs)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        import json

        import redis

        cursor = self._from
        while len(self.answered) < len(self.ids):
            try:
                reply = await self._r.xread({self._done_key: cursor}, count=500, block=500)
            except (redis.ConnectionError, redis.TimeoutError):   # Redis restarting (--chaos): read on from cursor
                await asyncio.sleep(0.2)
                continue
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    cursor = entry_id
                    rid = fields.get(b"id", b"").decode()
                    if rid not in self.ids:
                        continue
                    if rid in self.answered:
                        self.duplicates += 1
                    else:
                        self.answered[rid] = entry_id_ms(entry_id) / 1000
                    try:
                        if len(json.loads(fields.get(b"token_ids", b"[]"))) != self.tokens:
                            self.short.add(rid)
                    except ValueError:
                        self.short.add(rid)

    async def _check_out_streams(self) -> tuple[int, int]:
        """(lines whose ``out:<id>`` does not hold exactly one final entry, a ``done``;
        error entries among them)."""
        import redis

        from pdqueue.keys import Keys

        keys, ids = Keys(self.cluster), sorted(self.ids)
        not_once = errors = 0
        for at in range(0, len(ids), 200):
            chunk = ids[at:at + 200]
            for attempt in range(OUT_CHECK_TRIES):   # a connection from before a Redis restart (--chaos) fails once
                try:
                    async with self._r.pipeline(transaction=False) as pipe:
                        for rid in chunk:
                            pipe.xrange(keys.out(rid))
                        streams = await pipe.execute()
                    break
                except (redis.ConnectionError, redis.TimeoutError):
                    if attempt == OUT_CHECK_TRIES - 1:
                        raise
                    await asyncio.sleep(0.5)
            for entries in streams:
                finals = [f.get(b"type") for _, f in entries if f.get(b"type") in (b"done", b"error")]
                errors += finals.count(b"error")
                not_once += finals != [b"done"]
        return not_once, errors

    async def finish(self, window_start: float, window_end: float, online_tok_s: float,
                     timeout_s: float) -> dict:
        """Wait (at most ``timeout_s``) for every batch answer; the figures above. The
        window's ends are unix seconds."""
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        try:
            out_not_once, out_errors = await self._check_out_streams()
        finally:
            await self._r.aclose()
        times = sorted(self.answered.values())
        window_s = max(1e-3, window_end - window_start)
        in_window = [t for t in times if t <= window_end]
        tail = [t for t in times if t > window_end]
        capacity = None
        if len(tail) >= MIN_TAIL and tail[-1] > window_end:
            capacity = len(tail) * self.tokens / (tail[-1] - window_end)
        rate_in_window = len(in_window) * self.tokens / window_s
        left = None if capacity is None else capacity - online_tok_s
        missing = len(self.ids) - len(self.answered)
        return {"lines": len(self.ids), "answered": len(self.answered), "duplicates": self.duplicates,
                "missing": missing, "out_not_once": out_not_once, "out_errors": out_errors,
                "short": len(self.short),
                "exactly_once": not (self.duplicates or missing or out_not_once or self.short),
                "max_tokens": self.tokens,
                "window_s": window_s, "answered_in_window": len(in_window),
                "tok_s_in_window": rate_in_window, "capacity_tok_s": capacity,
                "online_tok_s": online_tok_s,
                "idle_share_used": None if not left or left <= 0 else rate_in_window / left,
                "all_answered_after_s": (times[-1] - window_start) if times else None,
                "measured_at": time.time()}
