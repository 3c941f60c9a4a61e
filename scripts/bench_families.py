"""`bench engine` per model family on random weights of SmolLM2-135M's shape (30 layers, hidden
576, 9 heads / 3 KV heads of 64, vocab 49152), beside llama.cpp's llama-bench on the same weights
(converted by llama.cpp's own convert_hf_to_gguf.py, f32) where a llama-bench binary is given.
Alternating pdqueue and llama.cpp per family, ROUNDS times; prints a table and writes JSON.

    python scripts/bench_families.py OUT_DIR [--llama-bench PATH] [--rounds 3] [--families a,b]

Run it on a quiet machine (nothing else running; see docs/performance.md). Needs transformers
(the test extras) to build the checkpoints and .llama.cpp/ (scripts/llama-cpp-source) to convert.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=4096, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(sliding_window=4096, query_pre_attn_scalar=64)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=512, query_pre_attn_scalar=64)),
    "phi3": ("Phi3Config", dict(sliding_window=4096, pad_token_id=0, tie_word_embeddings=True)),
    # 8 experts of a quarter of the dense MLP, 2 active: about the dense model's compute per token
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384,
                                         norm_topk_prob=True, tie_word_embeddings=True)),
}


def build(family: str, directory: Path) -> Path:
    import torch
    import transformers

    from tests.hf_models import smollm2_tokenizer

    if (directory / "config.json").exists():
        return directory
    cls, extra = FAMILIES[family]
    tok = smollm2_tokenizer()
    config = getattr(transformers, cls)(vocab_size=tok.vocab_size, bos_token_id=1, eos_token_id=2, **SHAPE, **extra)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(directory)
    tok.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def ours(directory: Path, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "workers", "bench", "engine", "--model", str(directory),
                          "--threads", str(threads), "--prompt-lens", "128,512", "--batch-sizes", "1,8", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout)


def llama_cpp(bench: str, gguf: Path, threads: int) -> dict:
    out = subprocess.run([bench, "-m", str(gguf), "-t", str(threads), "-p", "128,512", "-n", "64", "-r", "2",
                          "-o", "json"], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    rows = json.loads(out.stdout)
    result = {}
    for row in rows:
        if row.get("n_prompt") and not row.get("n_gen"):
            result[f"prefill_{row['n_prompt']}_tok_s"] = row["avg_ts"]
        elif row.get("n_gen") and not row.get("n_prompt"):
            result["decode_b1_ms"] = 1000.0 / row["avg_ts"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from tests import gguf_convert

    results = {}
    for family in args.families.split(","):
        directory = build(family, args.out / family)
        gguf = args.out / f"{family}.gguf"
        if args.llama_bench and not gguf.exists():
            try:
                gguf_convert.convert(directory, gguf)
            except RuntimeError as exc:
                print(f"{family}: llama.cpp's converter failed ({str(exc).splitlines()[-1][:120]})", flush=True)
        runs = {"pdqueue": [], "llama.cpp": []}
        for _ in range(args.rounds):
            runs["pdqueue"].append(ours(directory, args.threads))
            if args.llama_bench and gguf.exists():
                runs["llama.cpp"].append(llama_cpp(args.llama_bench, gguf, args.threads))
        results[family] = {"runs": runs, "load": os.getloadavg()}
        print(family, json.dumps(runs)[:2000], "load", os.getloadavg(), flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
