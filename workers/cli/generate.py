"""`pdqueue generate`: the colocated engine in this process, without Redis (the reference);
options parsed and checked before torch is imported.
"""

from __future__ import annotations

import secrets
import sys
import time

import click

from workers.cli.common import (
    UserError,
    check_device,
    check_engine_config,
    check_kv_pool,
    check_model,
    check_sampling,
    engine_options,
    load,
    model_option,
    sampling_options,
)


@click.command()
@click.argument("prompt")
@model_option
@sampling_options
@click.option("--seed", type=int, default=None, callback=check_sampling,
              help="Sampling seed [default: random; the seed used is printed on stderr].")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chat", is_flag=True, help="Apply the model's chat template to PROMPT.")
@engine_options
def generate(prompt, model, max_tokens, temperature, top_p, top_k, seed, stop, chat, device, dtype,
             threads, kv_cache_mb, prefix_caching, weights, cuda_graphs):
    """Generate in this process with the colocated engine, streaming tokens (the reference)."""
    check_model(model)
    config = check_engine_config(model=model, device=device, dtype=dtype, num_threads=threads,
                                 kv_cache_mb=kv_cache_mb, prefix_caching=prefix_caching, cuda_graphs=cuda_graphs,
                                 weights=weights)
    check_device(device)
    check_kv_pool(model, config)
    if seed is None:
        seed = secrets.randbits(63)  # as a prefill worker picks one for a request without a seed
    from pdqueue.engine.llm_engine import LLMEngine
    from pdqueue.engine.sampling import SamplingParams

    loaded = load(model, device, dtype, weights)
    engine = LLMEngine(loaded, config)
    tok = loaded.tokenizer
    prompt_ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    reason = engine.check_prompt(len(prompt_ids))
    if reason:
        raise UserError(reason)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop))
    started = time.perf_counter()
    outputs = []

    def show(out):
        outputs.append(out)
        click.echo(out.text, nl=False)
        sys.stdout.flush()

    engine.generate([prompt_ids], params, on_output=show)
    click.echo()
    elapsed = time.perf_counter() - started
    reason = outputs[-1].finish_reason if outputs else "?"
    click.secho(f"[{len(outputs)} tokens in {elapsed:.2f}s, {len(outputs) / elapsed:.1f} tok/s, "
                f"finish: {reason}, seed {seed}]", fg="cyan", err=True)
