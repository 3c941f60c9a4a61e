"""`pdqueue bench quality --kv-formats`: what a KV format (engine.kv_codec: the formats of
``--kv-wire-format`` and ``--kv-tier-format``) costs in quality, against native KV.

What a decode worker does with KV it receives in a format, done in one process: each prompt
is prefilled in full precision into a paged pool, its KV is round-tripped through the codec
(encoded, decoded back into the same blocks: what the wire or a tier hands over), and
decoding goes on from there; the tokens decoded after the prompt keep full precision, as on
a decode worker. Measured per format, over the fixed prompts of ``quality_text.PROMPTS``
(short) and windows of ``quality_text.TEXT`` (long: the KV of many blocks):

- greedy agreement with native: positions equal, the mean share of tokens before the first
  difference, prompts whose whole output is equal (``quality.agreement``);
- KL(native || format) of the next-token distribution, teacher-forced along native's greedy
  tokens (the same tokens in, the distributions compared), mean and max over positions.

Native's round trip is the identity (KL 0, agreement 1): the harness's own check.
Imports torch, the engine's codec and layout, the models.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pdqueue.bench.quality import agreement
from pdqueue.bench.quality_text import PROMPTS, TEXT
from pdqueue.engine.kv_cache import KVCacheLayout
from pdqueue.engine.kv_codec import FORMATS, NATIVE, KVCodec
from pdqueue.models.attention import AttentionBatch
from pdqueue.models.loader import load_model

BLOCK_SIZE = 16


class PagedRun:
    """One sequence in a paged pool whose block table is the identity (block i holds
    positions ``16i .. 16i+15``): prefill, round-trip the prompt's blocks, then forward
    chunks of tokens after it."""

    def __init__(self, model, config, max_tokens: int):
        self.model = model
        num_blocks = -(-max_tokens // BLOCK_SIZE)
        self.layout = KVCacheLayout(config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim,
                                    "float32")
        self.pool = self.layout.allocate()
        self.table = torch.arange(num_blocks, dtype=torch.long)

    def forward(self, tokens: list[int], start: int) -> torch.Tensor:
        """The logits [len(tokens), vocab] of ``tokens`` at positions ``start..``, the KV of
        positions before ``start`` read from the pool (theirs written there)."""
        end = start + len(tokens)
        batch = AttentionBatch(query_starts=[0], query_lens=[len(tokens)], context_lens=[end],
                               block_tables=[self.table], slot_mapping=torch.arange(start, end, dtype=torch.long))
        hidden = self.model(torch.tensor(tokens, dtype=torch.long), torch.arange(start, end, dtype=torch.long),
                            batch, self.pool)
        return self.model.compute_logits(hidden).float()

    def round_trip(self, codec: KVCodec, num_tokens: int) -> None:
        """The KV of the first ``num_tokens`` positions (their whole blocks), encoded and
        decoded back in place."""
        ids = list(range(-(-num_tokens // BLOCK_SIZE)))
        planes = self.pool.view(2 * self.layout.num_layers, self.layout.num_blocks, -1)
        buf = torch.empty(planes.shape[0], len(ids), codec.unit_nbytes, dtype=torch.uint8)
        codec.encode(planes, ids, buf)
        codec.decode(buf, planes, ids)


@torch.inference_mode()
def run_prompt(run: PagedRun, codec: KVCodec, prompt: list[int], max_tokens: int,
               reference: list[int] | None) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens, teacher-forced log-probabilities [max_tokens - 1, vocab] along
    ``reference``'s tokens, or along its own when None) with the prompt's KV through ``codec``."""
    n = len(prompt)
    out = [int(run.forward(prompt, 0)[-1].argmax())]   # token 0: from the prefill, full precision
    run.round_trip(codec, n)
    for i in range(max_tokens - 1):
        out.append(int(run.forward([out[-1]], n + i)[-1].argmax()))
    path = reference if reference is not None else out
    forced = run.forward(path[:-1], n) if max_tokens > 1 else torch.empty(0, 1)
    return out, F.log_softmax(forced, dim=-1)


def prompts_for(tokenizer, contexts: int, context_tokens: int) -> list[list[int]]:
    """The short prompts, then ``contexts`` disjoint windows of the text of ``context_tokens``."""
    ids = tokenizer.encode(TEXT)
    windows = [ids[i * context_tokens:(i + 1) * context_tokens] for i in range(contexts)]
    return [tokenizer.encode(p) for p in PROMPTS] + [w for w in windows if len(w) == context_tokens]


def run(model: str = "smollm2", formats=FORMATS, max_tokens: int = 32, contexts: int = 4, context_tokens: int = 512,
        progress=print) -> dict:
    """Native first (the reference), then each other format, on one model in float32."""
    formats = [NATIVE, *[f for f in formats if f != NATIVE]]
    loaded = load_model(model)
    prompts = prompts_for(loaded.tokenizer, contexts, context_tokens)
    run_ = PagedRun(loaded.model, loaded.config, max(len(p) for p in prompts) + max_tokens)
    native_unit = KVCodec.for_layout(NATIVE, run_.layout).unit_nbytes
    results: dict[str, dict] = {}
    ref_out: list[list[int]] = []
    ref_logp: list[torch.Tensor] = []
    for fmt in formats:
        codec = KVCodec.for_layout(fmt, run_.layout)
        progress(f"kv {fmt}: {len(prompts)} prompts x {max_tokens} tokens ...")
        started = time.perf_counter()
        outs, kls = [], []
        for i, prompt in enumerate(prompts):
            out, logp = run_prompt(run_, codec, prompt, max_tokens, ref_out[i] if fmt != NATIVE else None)
            outs.append(out)
            if fmt == NATIVE:
                ref_out.append(out)
                ref_logp.append(logp)
            elif len(logp):
                ref = ref_logp[i]
                kls.append((ref.exp() * (ref - logp)).sum(dim=-1))   # KL(native || fmt) per position
        kl = torch.cat(kls) if kls else torch.zeros(1)
        results[fmt] = {"bytes_vs_native": codec.unit_nbytes / native_unit, **agreement(outs, ref_out),
                        "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                        "seconds": time.perf_counter() - started}
    return {"model": model, "prompts": len(prompts), "short_prompts": len(PROMPTS),
            "context_tokens": context_tokens, "max_tokens": max_tokens, "block_size": BLOCK_SIZE,
            "threads": torch.get_num_threads(), "results": results}


def format_table(result: dict) -> str:
    lines = [f"model {result['model']}: KV formats, prompt KV round-tripped after a full-precision prefill; "
             f"{result['prompts']} prompts ({result['short_prompts']} short, the rest {result['context_tokens']} "
             f"tokens) x {result['max_tokens']} tokens",
             f"{'kv':<8}{'bytes':>7}{'greedy =':>10}{'prefix =':>10}{'identical':>11}{'KL mean':>10}{'KL max':>10}"]
    for fmt, r in result["results"].items():
        lines.append(f"{fmt:<8}{r['bytes_vs_native']:>7.3f}{r['greedy_token_agreement']:>10.3f}"
                     f"{r['greedy_prefix_match']:>10.3f}{r['greedy_identical']:>11.3f}{r['kl_mean']:>10.2e}"
                     f"{r['kl_max']:>10.2e}")
    return "\n".join(lines)
