"""What a step costs, learned from the steps this engine ran: ``seconds = a + b * decode rows
+ c * prefill tokens``, fitted by recursive least squares with forgetting (recent steps
weigh most: the load, the thread count and the machine's other work all move it).

Used by the chunked scheduler's TBT budget (policies.py): the prompt tokens that fit beside
the running decodes in one inter-token gap. Three terms are enough here: the per-token
attention cost of a chunk grows with its context, but for the prompts a chunk budget matters
for (hundreds of tokens) the linear terms dominate, and the forgetting follows the rest.

Pure Python, no I/O.
"""

from __future__ import annotations

FORGET = 0.98        # each step's weight decays by this per later step (~50 steps remembered)
MIN_STEPS = 6        # fewer observations than this: no estimate (callers keep their default)


class StepCostModel:
    def __init__(self, forget: float = FORGET):
        self.forget = forget
        self.theta = [0.0, 0.0, 0.0]                       # a, b, c
        self.p = [[1e3 if i == j else 0.0 for j in range(3)] for i in range(3)]   # inverse information
        self.steps = 0
        self._seen_prefill = False
        self._seen_decode = False

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        x = (1.0, float(decode_rows), float(prefill_tokens))
        p, lam = self.p, self.forget
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = lam + sum(x[i] * px[i] for i in range(3))
        gain = [v / denom for v in px]
        err = seconds - sum(t * v for t, v in zip(self.theta, x))
        self.theta = [t + g * err for t, g in zip(self.theta, gain)]
        xp = [sum(x[i] * p[i][j] for i in range(3)) for j in range(3)]
        self.p = [[(p[i][j] - gain[i] * xp[j]) / lam for j in range(3)] for i in range(3)]
        self.steps += 1
        self._seen_prefill |= prefill_tokens > 0
        self._seen_decode |= decode_rows > 0

    @property
    def ready(self) -> bool:
        """Enough steps, of both kinds, for the estimate to mean something."""
        return self.steps >= MIN_STEPS and self._seen_prefill and self._seen_decode

    def predict(self, decode_rows: int, prefill_tokens: int) -> float:
        a, b, c = self.theta
        return a + b * decode_rows + c * prefill_tokens

    def prefill_tokens_within(self, seconds: float, decode_rows: int) -> int | None:
        """The prompt tokens a step with ``decode_rows`` decodes can take and still end within
        ``seconds``; None while the model is not ready or gives no positive per-token cost."""
        if not self.ready:
            return None
        a, b, c = self.theta
        if c <= 0:
            return None
        return max(0, int((seconds - max(a, 0.0) - max(b, 0.0) * decode_rows) / c))
