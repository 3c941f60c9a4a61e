"""Every supported family against transformers, the oracle: a tiny random checkpoint of each,
built by transformers from its config class (tests/hf_models.py), must give transformers'
prompt logits (within 1e-4 in float32) and its greedy continuation, token for token, through
the engine's paged attention (batched, chunked, alone). A config field pdqueue does not
implement is refused by name, before any weight is read.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from pdqueue.engine.config import EngineConfig, PrefillPolicy
from pdqueue.engine.llm_engine import LLMEngine
from pdqueue.engine.sampling import SamplingParams
from pdqueue.models.families import FAMILIES, ConfigError, config_from_hf
from pdqueue.models.loader import load_model
from pdqueue.models.source import ModelSourceError, resolve_model_path
from tests import chat_templates, hf_models, run_cache

pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox jumps over the lazy dog, then runs away into the forest.",
           "Hello", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12"]
GREEDY_32 = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints():
    """case -> its directory, built when first asked for, once per test run (shared by the
    run's xdist workers and the other family modules: tests/run_cache.py). Tests that change
    one copy it first."""
    return run_cache.Lazy(hf_models.checkpoint)


def prompt_ids() -> list[list[int]]:
    tok = hf_models.smollm2_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


def test_every_family_has_a_case():
    covered = {json.loads(json.dumps(hf_models._configs()[c][0])) for c in hf_models.CASES}
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config",
               "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}
    assert {f.name for f in FAMILIES} == set(classes)
    assert set(classes.values()) <= covered


@pytest.mark.parametrize("case", hf_models.CASES)
def test_prompt_logits_match_transformers(checkpoints, case):
    loaded = load_model(checkpoints[case])
    assert loaded.config.family == case.split("-")[0].replace("llama3", "llama")
    ids = prompt_ids()[0]
    assert len(ids) > hf_models.WINDOW   # the sliding layers' window is in play
    expected = hf_models.hf_logits(checkpoints[case], ids)
    with torch.no_grad():
        got = loaded.model.dense_logits(torch.tensor(ids))
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", hf_models.CASES)
def test_greedy_continuation_matches_transformers(checkpoints, case):
    """32 greedy tokens of three prompts (one longer than the sliding window), batched with
    whole prompts, in chunks of 7 tokens, and each alone: all equal transformers' generate."""
    loaded = load_model(checkpoints[case])
    ids = prompt_ids()
    expected = [hf_models.greedy(case, i, 32) for i in ids]
    config = EngineConfig(model=str(checkpoints[case]), kv_cache_mb=16)
    assert LLMEngine(loaded, config).generate(ids, GREEDY_32) == expected
    chunked = EngineConfig(model=str(checkpoints[case]), kv_cache_mb=16, policy=PrefillPolicy.CHUNKED,
                           max_num_batched_tokens=7)
    assert LLMEngine(loaded, chunked).generate(ids, GREEDY_32) == expected
    assert [LLMEngine(loaded, config).generate([i], GREEDY_32)[0] for i in ids] == expected


@pytest.mark.parametrize("case,change", [
    ("mistral", {"sliding_window": None}),                         # the window ignored
    ("llama3", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),   # the llama3 scaling ignored
    ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None}),       # the caps ignored
])
def test_the_comparison_sees_a_missing_part(checkpoints, tmp_path, case, change):
    """The same weights served without one of the family's parts answer differently: the
    comparisons above can fail (as a Llama 3 checkpoint's did while its rope scaling was
    ignored)."""
    copy = tmp_path / case
    shutil.copytree(checkpoints[case], copy)
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, **change}))
    ids = prompt_ids()[0]
    expected = hf_models.greedy(case, ids, 32)
    loaded = load_model(copy)
    assert LLMEngine(loaded, EngineConfig(model=str(copy), kv_cache_mb=16)).generate([ids], GREEDY_32)[0] != expected


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_moe_rows_of_one_batch_route_to_different_experts(checkpoints, case):
    loaded = load_model(checkpoints[case])
    ids = prompt_ids()
    layer = next(layer for layer in loaded.model.layers if hasattr(layer.mlp, "router"))
    hidden = loaded.model.embed_tokens(torch.tensor([i[0] for i in ids] + [i[-1] for i in ids]))
    with torch.no_grad():
        chosen = layer.mlp.router(layer.input_layernorm(hidden)).topk(loaded.config.moe.top_k).indices
    assert len({tuple(sorted(row)) for row in chosen.tolist()}) > 1   # rows pick different experts
    # ... and the batch's answers are each row's alone (test_greedy_continuation_... above too)
    engine = LLMEngine(loaded, EngineConfig(model=str(checkpoints[case]), kv_cache_mb=16))
    together = engine.generate(ids, GREEDY_32)
    assert together == [hf_models.greedy(case, i, 32) for i in ids]


def test_quantized_weights_serve_biases_and_refuse_experts(checkpoints):
    """int8 keeps Qwen2's q/k/v biases (its logits stay close to float's); a mixture of experts
    is refused with a reason."""
    ids = torch.tensor(prompt_ids()[0])
    float_logits = load_model(checkpoints["qwen2"]).model.dense_logits(ids)
    int8 = load_model(checkpoints["qwen2"], weights="int8", use_cache=False)
    with torch.no_grad():
        got = int8.model.dense_logits(ids)
    cos = torch.nn.functional.cosine_similarity(got, float_logits, dim=-1)
    assert cos.min() > 0.99
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_model(checkpoints["qwen3_moe"], weights="int8")


@pytest.mark.parametrize("change,named", [
    ({"rope_parameters": {"rope_type": "su-per", "rope_theta": 10000.0}}, "rope_type='su-per'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                       "low_freq_factor": 1, "high_freq_factor": 4, "mrope_section": [1, 2]}}, "mrope_section"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"my_new_idea": 3}, "'my_new_idea'"),
    ({"quantization_config": {"quant_method": "awq"}}, "pre-quantized"),
    ({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}, "FalconForCausalLM"),
])
def test_a_config_pdqueue_does_not_implement_is_refused_by_name(checkpoints, tmp_path, change, named):
    copy = tmp_path / "model"
    shutil.copytree(checkpoints["llama"], copy)
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ModelSourceError, match=named.replace("(", r"\(").replace("[", r"\[")):
        resolve_model_path(copy)   # before anything is loaded (and before a worker registers)
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        load_model(copy)


# Configs as the published checkpoints ship them (transformers 4.x: rope_theta and
# rope_scaling at the top level), abridged to what decides the family's parts.
REAL_CONFIGS = {
    "Llama-3.2-1B-Instruct": ({
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {
            "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}, "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256},
        dict(family="llama", eos_token_ids=(128001, 128008, 128009), tie_word_embeddings=True)),
    "Qwen2.5-0.5B-Instruct": ({
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
        dict(family="qwen2", qkv_bias=True, sliding_window=None, head_dim=64)),
    "gemma-2-2b-it": ({
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
        "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000},
        dict(family="gemma2", attn_softcap=50.0, final_softcap=30.0, sliding_window=4096, tie_word_embeddings=True)),
    "gemma-3-1b-it": ({
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144},
        dict(family="gemma3", qk_norm=True, sliding_window=512)),
    "Phi-3-mini-4k-instruct": ({
        "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "auto_map": {
            "AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": True, "vocab_size": 32064},
        dict(family="phi3", sliding_window=2047, head_dim=96)),
    "Mixtral-8x7B-Instruct-v0.1": ({
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000},
        dict(family="mixtral", sliding_window=None)),
    "Qwen3-30B-A3B": ({
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
        dict(family="qwen3_moe", qk_norm=True)),
}


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_published_configs_are_read_with_their_parts(name):
    raw, expected = REAL_CONFIGS[name]
    config = config_from_hf(raw, name)
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    if name.startswith("Llama-3"):
        assert config.rope.kind == "llama3" and config.rope.factor == 32.0 and config.rope.theta == 500000.0
    if name.startswith("gemma-3"):
        assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
        assert config.local_rope.theta == 10000.0 and config.rope.theta == 1000000.0
    if name.startswith("Qwen3-30B"):
        assert config.moe.num_experts == 128 and config.moe.top_k == 8 and all(config.moe.layers)
    with pytest.raises(ConfigError, match="not understood"):
        config_from_hf({**raw, "some_new_switch": True}, name)


@pytest.fixture(scope="module")
def template_dir(checkpoints, tmp_path_factory):
    directory = tmp_path_factory.mktemp("templates") / "model"
    shutil.copytree(checkpoints["qwen3"], directory)
    return directory


@pytest.mark.parametrize("style", list(chat_templates.TEMPLATES))
def test_chat_templates_render_as_transformers_does(template_dir, style):
    """Text and ids of each conversation (system prompt, multi-turn, with and without the
    generation prompt) equal transformers' apply_chat_template; a prompt's plain ids equal
    tokenizer(text)."""
    import transformers

    from pdqueue.models.loader import _hf_config, _hf_tokenizer

    raw = json.loads((template_dir / "tokenizer_config.json").read_text())
    (template_dir / "tokenizer_config.json").write_text(json.dumps({**raw, "chat_template":
                                                                    chat_templates.TEMPLATES[style]}))
    ours = _hf_tokenizer(template_dir, _hf_config(template_dir))
    theirs = transformers.AutoTokenizer.from_pretrained(str(template_dir))
    for conversation in chat_templates.CONVERSATIONS:
        for generation_prompt in (True, False):
            text = theirs.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False)
            ids = theirs.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt) == text
            assert ours.encode_chat(conversation, add_generation_prompt=generation_prompt) == ids
    assert ours.encode(PROMPTS[0]) == theirs(PROMPTS[0])["input_ids"]


def test_a_chat_template_file_and_the_generation_configs_eos_ids_are_read(checkpoints, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(checkpoints["gemma3"], copy)
    (copy / "chat_template.jinja").write_text(chat_templates.GEMMA)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load_model(copy)
    assert loaded.tokenizer.apply_chat_template(chat_templates.CONVERSATIONS[0]).endswith("<start_of_turn>model\n")
    assert set(loaded.config.eos_token_ids) >= {2, 7}   # config.json's, and generation_config.json's
    assert set(loaded.tokenizer.eos_token_ids) >= {2, 7}


def test_sharded_bfloat16_checkpoints_load_as_transformers_reads_them(tmp_path):
    """A checkpoint saved in bfloat16 over several safetensors shards (with its index): the same
    logits as transformers' float32 load of those files."""
    import transformers

    directory = hf_models.build("gemma3", tmp_path / "src")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16)
    sharded = tmp_path / "sharded"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(sharded, max_shard_size="1MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, sharded / name)
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").exists()
    # a file the index does not name (Mistral's repositories ship a consolidated.safetensors) is not read
    from safetensors.torch import save_file
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(sharded / "consolidated.safetensors"))
    ids = prompt_ids()[0]
    with torch.no_grad():
        got = load_model(sharded).model.dense_logits(torch.tensor(ids))
    assert (got - hf_models.hf_logits(sharded, ids)).abs().max().item() < 1e-4


def test_pdqueue_models_lists_the_families_and_reads_a_checkpoint(checkpoints, tmp_path):
    from click.testing import CliRunner

    from workers.cli import cli

    listing = CliRunner().invoke(cli, ["models", "--json"])
    assert listing.exit_code == 0
    assert [row["family"] for row in json.loads(listing.output)] == [f.name for f in FAMILIES]
    shown = CliRunner().invoke(cli, ["models", str(checkpoints["mixtral"])])
    assert shown.exit_code == 0 and "mixtral" in shown.output and "4 experts (top 2)" in shown.output
    copy = tmp_path / "model"
    shutil.copytree(checkpoints["llama"], copy)
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, "rope_parameters": {"rope_type": "su", "rope_theta": 1.0}}))
    refused = CliRunner().invoke(cli, ["models", str(copy)])
    assert refused.exit_code == 1 and "rope_type='su'" in refused.output
