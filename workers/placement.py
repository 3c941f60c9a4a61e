"""Prompt placement, both halves: which worker prefills a prompt, decided per request from
measured costs. The decode side says what it can take (``SpareTime``, ``prompt_load``: its
heartbeat's load); the prefill side decides from that (``Placement``). One module, so the
fields one half writes and the other reads are defined side by side.

The decode half. A decode worker started with ``--take-prompts`` also prefills prompts, in
chunks under its TBT budget beside its decodes (the chunked scheduler,
engine/scheduler.py). Its heartbeat says how fast it can take prompt tokens now:
``prompt_tok_s`` = the share of its clock its decodes left over the last ~2 s (``spare``,
``SpareTime``) over its own cost of a prompt token, 0 below ``SPARE_MIN`` spare or while its
decode steps miss the TBT target (``GAP_GUARD``); and ``prompt_backlog``, the prompt tokens
it holds (``prompt_load``, which workers/decode.py adds to its load).

The prefill half. A prefill worker, at intake (workers/intake.py), sends a prompt there as a
*prompt handoff* (no KV, no token: protocol/handoff.py) instead of prefilling it, when

- it is online (not batch) and at most ``max_tokens`` long;
- it would wait here at least ``MIN_WAIT_S``: an unloaded split stays a split, so the
  placement can only matter where the prefill side queues;
- and its first token comes sooner there: ``remote < local * MARGIN`` with

      local  = seconds per step here (a) + seconds per prompt token here (c)
               x (prompt tokens queued in this engine + the prompt)
      remote = (its prompt_backlog at its last beat + what we sent since
                - what it took since, at its prompt_tok_s + the prompt) / its prompt_tok_s

Only decode workers compatible with the prefill worker are candidates (the view holds no
other: workers/decode_peers.py); while one of another kind lives, the prompt goes to the
stream of the prefill worker's kind rather than to the chosen worker's node stream.

The decode worker's heartbeat is seconds old (a beat every ttl/3), so the placer counts
what it sent since that beat and lets the backlog drain at the advertised rate. Only
estimates here; no I/O but the heartbeat reads (``refresh``: the prefill worker's
``DecodePeers``, read at most every 0.5 s).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from workers.decode_peers import DecodePeers, takes_work

# ---- the decode half: what a decode worker taking prompts advertises ------------------------
SPARE_MIN = 0.2        # a decode worker whose decodes leave less of its time takes no placed prompt
# A prompt token's cost (s) until this engine has timed one: a small quantized model's on a CPU.
TOKEN_S_UNKNOWN = 0.005
SPARE_TAU_S = 2.0      # the time constant of the spare-time average
RECENT_STEPS = 32      # steps with decodes the gap guard looks at
GAP_GUARD = 1.0        # of the TBT target: a step p90 past it stops placed prompts


class SpareTime:
    """The share of a worker's time its decodes leave free, averaged over ~SPARE_TAU_S: steps
    without prompt tokens count whole, steps with some count what the step cost model gives
    their decode rows alone (the prompt tokens in them are the spare time's use).

    Each step is measured against ``frame_s`` when that is longer than the step: the time the
    TBT target allows a step (``TbtBudget.step_s``, engine/policies.py). A decode worker
    stepping back to back has no idle time, yet a decode step shorter than its step budget
    leaves the rest of each step to prompt chunks (by the idle clock alone its spare read 0,
    and it took no prompt while the prefill worker queued)."""

    def __init__(self, tau_s: float = SPARE_TAU_S, clock=time.monotonic):
        self.share, self.tau_s, self.clock = 1.0, tau_s, clock
        self._at = clock()

    def add(self, decode_s: float, frame_s: float = 0.0) -> None:
        now = self.clock()
        wall, self._at = now - self._at, now
        if wall <= 0:
            return
        keep = math.exp(-wall / self.tau_s)
        self.share = keep * self.share + (1 - keep) * max(0.0, 1 - decode_s / max(wall, frame_s))

    def add_step(self, scheduler, decode_rows: int, prompts: bool, step_s: float) -> None:
        """An engine step of ``step_s`` with ``decode_rows`` decodes (and prompt tokens when
        ``prompts``), against the scheduler's TBT step budget."""
        cost = scheduler.cost
        decode_s = min(step_s, max(0.0, cost.predict(decode_rows, 0))) if prompts and cost.ready else step_s
        self.add(decode_s, frame_s=scheduler.tbt.step_s or 0.0)


def prompt_load(engine, spare: SpareTime, recent_steps, placed_waiting: int, tbt_slo_ms: float | None) -> dict:
    """What prefill workers place prompts by (``Placement.refresh`` reads it): the prompt
    tokens a second this worker (``engine``, a decode engine) can take in the time its
    decodes leave (0 below SPARE_MIN: placed prompts would then lengthen every gap) and the
    prompt tokens it holds (in its engine, and ``placed_waiting``: those of placed prompts
    not in the engine yet)."""
    cost = engine.scheduler.cost
    token_s = cost.theta[2] if cost.ready and cost.theta[2] > 0 else TOKEN_S_UNKNOWN
    share = spare.share
    tok_s = share / token_s if share >= SPARE_MIN else 0.0
    target_ms = tbt_slo_ms
    if target_ms is not None and len(recent_steps) >= 8:
        # Its decodes' gaps are missing the target (a step p90 past GAP_GUARD of it): no more
        # prompts until they recover (without a guard, past the split's capacity placed
        # prompts kept coming and gaps reached seconds). The chunks are sized by the TBT
        # budget (scheduler.py), so steps with prompts run up to 0.85 targets by design; a
        # guard at 0.6 closed placement whenever it was used.
        steps = sorted(recent_steps)
        if steps[int(0.9 * (len(steps) - 1))] * 1000 > GAP_GUARD * target_ms:
            tok_s = 0.0
    scheduler = engine.scheduler
    held = sum(s.num_uncomputed_tokens for s in scheduler.waiting if not scheduler.share.yields(s))
    held += sum(s.num_uncomputed_tokens for s in scheduler.running if s.num_uncomputed_tokens > 1)
    held += placed_waiting
    return {"takes_prompts": 1, "prompt_tok_s": round(tok_s, 1), "spare": round(share, 2), "prompt_backlog": held}


# ---- the prefill half: where a prompt goes ---------------------------------------------------
MIN_WAIT_S = 0.15    # a prompt that would wait less here stays here
MARGIN = 0.7         # the remote estimate must beat the local one by this factor
MAX_PROMPT_TOKENS = 1024
MAX_REMOTE_WAIT_S = 1.0   # a decode worker with more than this ahead gets none (both sides overloaded)


@dataclass(slots=True)
class Peer:
    """A decode worker that takes prompts, as its last heartbeat showed it."""
    worker_id: str
    stream: str            # the handoff stream it reads first (its node's)
    tok_s: float           # prompt tokens per second it can take beside its decodes
    backlog: float         # prompt tokens it held at its beat
    beat_s: float          # its beat, on this process's monotonic clock
    free_slots: int
    sent: list[tuple[float, int]] = field(default_factory=list)   # (when, tokens) sent since the beat

    def wait_s(self, now: float, num_tokens: int) -> float:
        sent = sum(n for _, n in self.sent)
        queued = max(0.0, self.backlog + sent - self.tok_s * (now - self.beat_s))
        return (queued + num_tokens) / self.tok_s


class Placement:
    """``mode``: ``auto`` (the rule above) or ``always`` (every short online prompt goes to a
    decode worker taking prompts while it has a free slot: tests, decode-heavy setups)."""

    def __init__(self, r, keys, worker_id: str, mode: str = "auto", max_tokens: int = MAX_PROMPT_TOKENS,
                 peers: DecodePeers | None = None):
        self.worker_id, self.mode, self.max_tokens = worker_id, mode, max_tokens
        self.view = peers if peers is not None else DecodePeers(r, keys)
        self.keys = keys
        self.peers: dict[str, Peer] = {}
        self._read_at = float("-inf")
        self.placed = 0   # prompts sent to decode workers (the heartbeat's ``placed_out``)

    def refresh(self, now: float) -> None:
        """The decode workers that take prompts, from the shared view's last read (read
        again when older than its period)."""
        self.view.refresh(now)
        if self.view.read_at == self._read_at:
            return
        self._read_at = self.view.read_at
        wall_ms = time.time() * 1000
        peers: dict[str, Peer] = {}
        # Only compatible decode workers are in the view (workers/compat.py); while one of
        # another kind lives (it reads the node streams too), a placed prompt goes to the
        # stream of this worker's kind, which every compatible decode worker reads.
        shared = self.view.compat_stream()
        for w in self.view.workers:
            load = w.get("load") or {}
            tok_s = float(load.get("prompt_tok_s") or 0)
            if not load.get("takes_prompts") or tok_s <= 0 or not takes_work(w):
                continue
            beat_s = now - max(0.0, wall_ms - float(w.get("beat_ms") or wall_ms)) / 1000
            old = self.peers.get(w["worker_id"])
            sent = [(t, n) for t, n in old.sent if t > beat_s] if old else []
            peers[w["worker_id"]] = Peer(w["worker_id"], shared or self.keys.handoff_node(w.get("node") or ""), tok_s,
                                         float(load.get("prompt_backlog") or 0), beat_s,
                                         int(load.get("free_slots") or 0), sent)
        self.peers = peers

    def has_room(self, now: float) -> bool:
        """Whether some decode worker taking prompts has a free slot and would start a prompt
        within ``MAX_REMOTE_WAIT_S`` (``always``: a free slot)."""
        self.refresh(now)
        return self._soonest(now, 0) is not None

    def _soonest(self, now: float, num_tokens: int) -> Peer | None:
        """The peer with a free slot that would give a prompt of ``num_tokens`` its first token
        soonest, if within ``MAX_REMOTE_WAIT_S`` (``always``: however long)."""
        best = min((p for p in self.peers.values() if p.free_slots > len(p.sent)),
                   key=lambda p: p.wait_s(now, num_tokens), default=None)
        if best is None or self.mode != "always" and best.wait_s(now, num_tokens) > MAX_REMOTE_WAIT_S:
            return None
        return best

    def place(self, engine, num_tokens: int) -> str | None:
        """The handoff stream of the decode worker that should prefill a prompt of
        ``num_tokens`` (this worker's ``engine`` holding what it has queued), or None: here."""
        if num_tokens > self.max_tokens:
            return None
        now = time.monotonic()
        self.refresh(now)
        best = self._soonest(now, num_tokens)
        if best is None:
            return None
        if self.mode != "always":
            local = local_wait_s(engine, num_tokens)
            if local is None or local < MIN_WAIT_S or best.wait_s(now, num_tokens) >= local * MARGIN:
                return None
        best.sent.append((now, num_tokens))
        self.view.handed_off()
        self.placed += 1
        return best.stream


def local_wait_s(engine, num_tokens: int) -> float | None:
    """Seconds until a prompt of ``num_tokens`` admitted now has its first token in
    ``engine`` (a prefill engine: every queued prompt token first), from its step cost
    model; None until the model has learned a positive cost per prompt token."""
    cost = engine.scheduler.cost
    if cost.steps < 4:
        return None
    a, _b, c = cost.theta
    if c <= 0:
        return None
    scheduler = engine.scheduler
    queued = sum(s.num_uncomputed_tokens for s in scheduler.waiting)
    queued += sum(s.num_uncomputed_tokens for s in scheduler.running if s.num_uncomputed_tokens > 1)
    return max(a, 0.0) + c * (queued + num_tokens)
