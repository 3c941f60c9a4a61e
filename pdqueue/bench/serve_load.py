"""`pdqueue bench serve`'s load: the settings of a run, the workload (short chat prompts and
long documents, or the prefix workload's conversations, or phases of a load that changes, or
the multi-turn workload's sessions) and the seeded request lists, the same for every mode.
Imports the standard library only."""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = {"tiny": 264, "smollm2": 49152}
DEFAULT_MODES = ("disagg", "colocated-prefill-first", "colocated-chunked")   # of serve_modes.MODES


@dataclass(frozen=True, slots=True)
class Workload:
    short_prompt: tuple[int, int]      # token counts, inclusive ranges (uniform)
    short_output: tuple[int, int]
    long_prompt: tuple[int, int]
    long_output: tuple[int, int]
    long_fraction: float = 0.25
    vocab_size: int = 256

    def ranges(self, kind: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """(prompt, output) length ranges of a "short" or "long" request."""
        return (self.long_prompt, self.long_output) if kind == "long" else (self.short_prompt, self.short_output)


@dataclass(frozen=True, slots=True)
class Phase:
    """A stretch of the load: ``duration_s`` of Poisson arrivals at ``rate`` with this share of
    long documents. A phased run sends its phases back to back, once per mode."""
    name: str
    long_fraction: float
    rate: float
    duration_s: float


# The two regimes of the phased load: mostly chat favours 1 prefill + 1 decode; half documents
# saturate one prefill worker, where 2 colocated workers win (docs/performance-history.md, "a load
# that changes, fixed splits against the adaptive one").
PHASE_KINDS = {"chat": (0.1, 2.0), "docs": (0.5, 1.0)}


def parse_phases(text: str, phase_s: float) -> tuple[Phase, ...]:
    """``chat,docs,chat`` (kinds of ``PHASE_KINDS``, each ``phase_s`` long), or explicit
    ``name:long_fraction:rate:seconds`` items."""
    phases = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) == 1 and item in PHASE_KINDS:
            phases.append(Phase(item, *PHASE_KINDS[item], phase_s))
        elif len(parts) == 4:
            try:
                phases.append(Phase(parts[0], float(parts[1]), float(parts[2]), float(parts[3])))
            except ValueError:
                raise ValueError(f"phase {item!r}: expected name:long_fraction:rate:seconds") from None
        else:
            raise ValueError(f"phase {item!r}: expected one of {sorted(PHASE_KINDS)} "
                             "or name:long_fraction:rate:seconds")
    for ph in phases:
        if not (0 <= ph.long_fraction <= 1 and ph.rate > 0 and ph.duration_s > 0):
            raise ValueError(f"phase {ph.name!r}: long_fraction in [0, 1], rate and seconds > 0")
    return tuple(phases)


@dataclass(frozen=True, slots=True)
class Settings:
    model: str
    workload: Workload
    slo_ttft_ms: float
    slo_tbt_ms: float
    modes: tuple[str, ...] = DEFAULT_MODES
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    num_requests: int | None = 24      # per rate; None: rate x duration_s
    duration_s: float | None = None
    seed: int = 0
    warmup: int = 2
    probes: int = 10                   # one at a time, for the idle queue overhead
    chunk_tokens: int = 256            # colocated-chunked: token budget per step
    placed_chunk_tokens: int = 512     # placement and elastic modes: the decode worker's token budget per step
    late_last: bool = True             # every worker gets --ttft-slo-ms slo_ttft_ms (prompts past it wait last)
    kv_cache_mb: int = 256
    drain_timeout_s: float = 180.0     # after the last arrival, unfinished requests are failed
    phases: tuple[Phase, ...] = ()     # a load that changes (instead of ``rates``)
    plan_mode: str = "reactive"        # the adaptive mode's planner
    plan_dwell_s: float = 15.0
    plan_cooldown_s: float = 8.0
    plan_window_s: float = 20.0
    workload_kind: str = "mixed"       # mixed: short chat and long documents; prefix: shared system prompts
                                       # and multi-turn conversations (plan_prefix_requests); multiturn:
                                       # sessions whose next turn waits for the last answer (plan_sessions)
    think_s: float = 0.0               # multiturn: from an answer to the session's next turn
    runs: int = 1                      # each mode run this many times, the modes by turns (serve_runs.py)
    kv_host_tier_mb: int = 256         # the tiers modes: each worker's host tier (--kv-host-tier-mb)
    kv_disk_gb: float = 2.0            # ... and their shared disk tier's bound (--kv-disk-gb)
    openai_url: str | None = None      # drive this OpenAI-compatible server instead of starting workers
    openai_model: str | None = None    # its model (default: the first of GET /v1/models)
    api_key: str | None = None
    batch_lines: int = 0               # batch-class requests queued at each rate's start (serve_batch.py)
    batch_max_tokens: int = 32
    chaos: tuple = ()                  # serve_chaos.Event's: faults at each rate (--chaos, with --batch-lines)
    chaos_alternate: int = 0           # with chaos: each rate run N times without and N times with it, alternately
    tenants_path: str | None = None    # a gateway with this tenants file in front of each mode (serve_tenants.py)
    tenant_rates: tuple[tuple[str, float], ...] = ()   # (tenant, req/s) of each tenant's load

    @classmethod
    def for_model(cls, model: str, *, long_fraction: float = 0.25, slo_ttft_ms: float | None = None,
                  slo_tbt_ms: float | None = None, num_requests: int | None = None,
                  duration_s: float | None = None, **kw) -> "Settings":
        """Defaults sized for one thread per worker on this class of CPU: SmolLM2 prefills
        ~250 tokens/s and decodes one step in ~50 ms (batch 1) to ~140 ms (batch 8)."""
        if model == "tiny":
            workload = Workload((8, 32), (16, 48), (384, 768), (8, 16), long_fraction, VOCAB["tiny"])
            ttft, tbt = 250.0, 50.0
        else:
            workload = Workload((16, 64), (16, 48), (256, 512), (8, 16), long_fraction, VOCAB.get(model, 256))
            ttft, tbt = 4000.0, 250.0
        if num_requests is None and duration_s is None:
            num_requests = 24
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
        return cls(model=model, workload=workload, slo_ttft_ms=slo_ttft_ms or ttft, slo_tbt_ms=slo_tbt_ms or tbt,
                   num_requests=num_requests, duration_s=duration_s, **kw)

    def requests_at(self, rate: float) -> int:
        return self.num_requests or max(1, round(rate * self.duration_s))




# -- the request list -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Planned:
    at_s: float            # arrival, seconds after the rate's start
    kind: str              # "short" | "long"
    prompt_ids: tuple[int, ...]
    max_tokens: int
    phase: int = -1        # index into Settings.phases, in a phased run
    tenant: str = ""       # whose API key sends it, in a tenants run (serve_tenants.py)
    session: int = -1      # a multiturn run: its session's index (Session.index)
    turn: int = 0          # ... and which turn of it, from 1


def plan_requests(settings: Settings, rate: float, count: int, salt: int = 0) -> list[Planned]:
    """The seeded request list of one rate: the same for every mode."""
    w = settings.workload
    rng = random.Random(f"{settings.seed}/{rate}/{salt}")
    at, out = 0.0, []
    for _ in range(count):
        kind = "long" if rng.random() < w.long_fraction else "short"
        prompt_range, output_range = w.ranges(kind)
        prompt = tuple(rng.randrange(3, w.vocab_size) for _ in range(rng.randint(*prompt_range)))
        out.append(Planned(at, kind, prompt, rng.randint(*output_range)))
        at += rng.expovariate(rate)
    return out


# The prefix workload: ``SYSTEM_PROMPTS`` system prompts of ``SYSTEM_LEN`` tokens, and
# ``CONVERSATIONS`` conversations, each on one system prompt; each arrival (Poisson) is the
# next turn of a conversation picked at random, which resends the whole conversation so far
# (system prompt, then user and assistant turns) plus a new user turn. The assistant turns
# are synthetic (the planned list is fixed before any answer exists): what matters is that
# turn k+1 repeats turn k's prompt, as chat clients do.
SYSTEM_PROMPTS, SYSTEM_LEN, CONVERSATIONS = 8, (400, 600), 12
USER_LEN, ASSISTANT_LEN, MAX_TURNS = (40, 120), (32, 96), 6


def plan_prefix_requests(settings: Settings, rate: float, count: int, salt: int = 0) -> list[Planned]:
    """The seeded request list of the prefix workload at one rate (the same for every mode)."""
    w = settings.workload
    rng = random.Random(f"{settings.seed}/prefix/{rate}/{salt}")

    def toks(bounds) -> list[int]:
        return [rng.randrange(3, w.vocab_size) for _ in range(rng.randint(*bounds))]

    systems = [toks(SYSTEM_LEN) for _ in range(SYSTEM_PROMPTS)]
    history = [list(systems[i % SYSTEM_PROMPTS]) for i in range(CONVERSATIONS)]
    turns = [0] * CONVERSATIONS
    at, out = 0.0, []
    for _ in range(count):
        c = rng.randrange(CONVERSATIONS)
        if turns[c] == MAX_TURNS:   # a finished conversation starts over on its system prompt
            history[c], turns[c] = list(systems[c % SYSTEM_PROMPTS]), 0
        history[c] += toks(USER_LEN)
        out.append(Planned(at, "long" if turns[c] else "short", tuple(history[c]), rng.randint(*w.short_output)))
        history[c] += toks(ASSISTANT_LEN)
        turns[c] += 1
        at += rng.expovariate(rate)
    return out


# The multi-turn workload: sessions arrive by Poisson at the rate (sessions/s); each has
# ``TURNS`` turns (uniform) and each turn adds ``USER_TOKENS`` tokens of user text (uniform) to
# the history and asks for an answer of the workload's short output length. Unlike the prefix
# workload, the history holds the real answers: a turn is sent once the last answer arrived
# (serve_turns.py), so only the new user text is planned here.
TURNS, USER_TOKENS = (3, 6), (32, 256)


@dataclass(frozen=True, slots=True)
class Session:
    index: int
    at_s: float                          # arrival of its first turn, seconds after the rate's start
    user: tuple[tuple[int, ...], ...]    # each turn's new user tokens
    max_tokens: tuple[int, ...]          # each turn's answer length

    @property
    def turns(self) -> int:
        return len(self.user)


def plan_sessions(settings: Settings, rate: float, count: int, salt: int = 0) -> list[Session]:
    """The seeded session list of the multi-turn workload at one rate (sessions/s): the same
    for every mode and every run."""
    w = settings.workload
    rng = random.Random(f"{settings.seed}/multiturn/{rate}/{salt}")
    at, out = 0.0, []
    for index in range(count):
        turns = rng.randint(*TURNS)
        user = tuple(tuple(rng.randrange(3, w.vocab_size) for _ in range(rng.randint(*USER_TOKENS)))
                     for _ in range(turns))
        out.append(Session(index, at, user, tuple(rng.randint(*w.short_output) for _ in range(turns))))
        at += rng.expovariate(rate)
    return out


def plan_phases(settings: Settings) -> list[Planned]:
    """The seeded request list of a phased run: each phase's Poisson arrivals over its
    duration, its own share of documents, one after the other (the same for every mode)."""
    w, out, start = settings.workload, [], 0.0
    for index, ph in enumerate(settings.phases):
        rng = random.Random(f"{settings.seed}/phase{index}/{ph.name}")
        at = rng.expovariate(ph.rate)
        while at < ph.duration_s:
            kind = "long" if rng.random() < ph.long_fraction else "short"
            prompt_range, output_range = w.ranges(kind)
            prompt = tuple(rng.randrange(3, w.vocab_size) for _ in range(rng.randint(*prompt_range)))
            out.append(Planned(start + at, kind, prompt, rng.randint(*output_range), index))
            at += rng.expovariate(ph.rate)
        start += ph.duration_s
    return out


def warmup_requests(settings: Settings) -> list[Planned]:
    """``settings.warmup`` requests at once, long and short in turn (mid-range lengths)."""
    w, out = settings.workload, []
    for i in range(settings.warmup):
        kind = "long" if i % 2 == 0 else "short"
        prompt_range, output_range = w.ranges(kind)
        num_prompt = sum(prompt_range) // 2
        out.append(Planned(0.0, kind, tuple(3 + (i * 7919 + j) % (w.vocab_size - 3) for j in range(num_prompt)),
                           sum(output_range) // 2))
    return out

