"""`parse_model_spec` on real-world configs, on transformers' own config classes, and `num_params`
against the parameter counts of real (tiny) transformers models."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import transformers

from nxdi.core.model_spec import ModelSpec, NormKind, PositionKind, RopeKind, RopeSpec
from tests.support.planner_configs import MIXTRAL_8X7B
from tests.support.planner_configs import spec as parsed
from tests.support.planner_configs import spec_failure as failure

# Real config.json files, abridged to the keys that matter (plus a few they carry that nxdi ignores).

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

LLAMA_3_2_1B: dict[str, Any] = LLAMA_3_1_8B | {
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
}

MISTRAL_7B: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}

QWEN2_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}

QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_0_6B: dict[str, Any] = QWEN3_8B | {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "tie_word_embeddings": True,
}
"""Qwen3's head_dim (128) is not hidden_size / num_attention_heads (64) here."""


DBRX: dict[str, Any] = {
    "architectures": ["DbrxForCausalLM"],
    "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "model_type": "", "rope_theta": 500000},
    "d_model": 6144,
    "emb_pdrop": 0.0,
    "ffn_config": {
        "ffn_hidden_size": 10752,
        "model_type": "",
        "moe_jitter_eps": 0.01,
        "moe_loss_weight": 0.05,
        "moe_num_experts": 16,
        "moe_top_k": 4,
    },
    "initializer_range": 0.02,
    "max_seq_len": 32768,
    "model_type": "dbrx",
    "n_heads": 48,
    "n_layers": 40,
    "output_router_logits": False,
    "resid_pdrop": 0.0,
    "router_aux_loss_coef": 0.05,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 100352,
}

OPT_13B: dict[str, Any] = {
    "_remove_final_layer_norm": False,
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 20480,
    "hidden_size": 5120,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "output_projection": True,
    "pad_token_id": 1,
    "torch_dtype": "float16",
    "vocab_size": 50272,
    "word_embed_proj_dim": 5120,
}

GPT2_XL: dict[str, Any] = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 1600,
    "n_head": 25,
    "n_layer": 48,
    "n_positions": 1024,
    "output_past": True,
    "resid_pdrop": 0.1,
    "vocab_size": 50257,
}


LLAMA3_ROPE = RopeSpec(
    theta=500000.0, kind=RopeKind.LLAMA3, factor=8.0, original_max_position_embeddings=8192, high_freq_factor=4.0
)


def test_llama_3_1_8b() -> None:
    assert parsed(LLAMA_3_1_8B) == ModelSpec(
        model_type="llama",
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        num_layers=32,
        vocab_size=128256,
        intermediate_size=14336,
        max_position_embeddings=131072,
        norm_eps=1e-5,
        rope=LLAMA3_ROPE,
        bos_token_id=128000,
        eos_token_ids=(128001,),
    )


def test_llama_3_2_1b_ties_embeddings_and_scales_rope() -> None:
    spec = parsed(LLAMA_3_2_1B)
    assert spec.tie_word_embeddings
    assert (spec.hidden_size, spec.head_dim, spec.num_layers, spec.num_kv_heads) == (2048, 64, 16, 8)
    assert spec.rope == attrs.evolve(LLAMA3_ROPE, factor=32.0)
    assert spec.eos_token_ids == (128001, 128008, 128009)


def test_mistral_7b_has_a_sliding_window() -> None:
    spec = parsed(MISTRAL_7B)
    assert (spec.model_type, spec.sliding_window, spec.num_kv_heads, spec.head_dim) == ("mistral", 4096, 8, 128)
    assert spec.rope == RopeSpec(theta=10000.0)
    assert not (spec.qkv_bias or spec.o_bias or spec.mlp_bias or spec.tie_word_embeddings)


def test_qwen2_7b_has_qkv_bias_and_windows_only_from_max_window_layers() -> None:
    spec = parsed(QWEN2_7B)
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias) == (True, False, False)
    assert spec.sliding_window is None  # use_sliding_window is false
    # transformers slides layers i >= max_window_layers: none of Qwen2-7B's 28 at max_window_layers=28
    assert parsed(QWEN2_7B | {"use_sliding_window": True}).sliding_window is None
    some = parsed(QWEN2_7B | {"use_sliding_window": True, "max_window_layers": 20})
    assert (some.sliding_window, some.full_attention_layers) == (131072, tuple(range(20)))
    typed = parsed(QWEN2_7B | {"use_sliding_window": True, "layer_types": ["sliding_attention"] * 28})
    assert (typed.sliding_window, typed.full_attention_layers) == (131072, ())
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (28, 4, 128)
    assert spec.rope == RopeSpec(theta=1e6) and spec.norm_eps == 1e-6


def test_qwen3_takes_an_explicit_head_dim_and_qk_norm() -> None:
    big, small = parsed(QWEN3_8B), parsed(QWEN3_0_6B)
    assert big.qk_norm and big.head_dim == 128 and big.rope == RopeSpec(theta=1e6)
    assert (small.hidden_size, small.num_attention_heads, small.head_dim) == (1024, 16, 128)
    assert (small.q_size, small.kv_size) == (2048, 1024)


def test_mixtral_8x7b_has_experts() -> None:
    spec = parsed(MIXTRAL_8X7B)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.is_moe) == (8, 2, True)
    assert spec.sliding_window is None and spec.rope == RopeSpec(theta=1e6)


def test_dbrx_reads_its_nested_blocks() -> None:
    spec = parsed(DBRX)
    assert (spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (6144, 48, 8, 128)
    assert (spec.num_layers, spec.vocab_size, spec.intermediate_size, spec.max_position_embeddings) == (
        40,
        100352,
        10752,
        32768,
    )
    assert (spec.num_experts, spec.num_experts_per_tok, spec.clip_qkv) == (16, 4, 8.0)
    assert (spec.norm, spec.norm_bias, spec.activation) == (NormKind.LAYER, False, "silu")
    assert spec.rope == RopeSpec(theta=500000.0)
    assert (spec.moe_normalize, spec.moe_normalize_p) == (True, 1.0)  # transformers' default p


@pytest.mark.parametrize(("p", "expected"), [(2.0, (True, 2.0)), (None, (False, 1.0))])
def test_dbrx_expert_weights_are_normalised_by_their_p_norm_or_not_at_all(
    p: float | None, expected: tuple[bool, float]
) -> None:
    ffn = DBRX["ffn_config"] | {"moe_normalize_expert_weights": p}
    spec = parsed(DBRX | {"ffn_config": ffn})
    assert (spec.moe_normalize, spec.moe_normalize_p) == expected


def test_opt_13b_has_learned_positions_and_biases() -> None:
    spec = parsed(OPT_13B)
    assert (spec.position, spec.position_offset, spec.rope) == (PositionKind.LEARNED, 2, None)
    assert (spec.norm, spec.gated_mlp, spec.activation) == (NormKind.LAYER, False, "relu")
    assert spec.qkv_bias and spec.o_bias and spec.mlp_bias and spec.tie_word_embeddings
    assert (spec.hidden_size, spec.num_attention_heads, spec.intermediate_size, spec.pad_token_id) == (
        5120,
        40,
        20480,
        1,
    )


def test_gpt2_xl_defaults_its_inner_size() -> None:
    spec = parsed(GPT2_XL)
    assert (spec.hidden_size, spec.num_attention_heads, spec.head_dim, spec.intermediate_size) == (1600, 25, 64, 6400)
    assert (spec.max_position_embeddings, spec.activation, spec.position) == (1024, "gelu_new", PositionKind.LEARNED)


@pytest.mark.parametrize(
    ("raw", "published"),
    [
        (LLAMA_3_1_8B, 8_030_261_248),
        (LLAMA_3_2_1B, 1_235_814_400),
        (MISTRAL_7B, 7_241_732_096),
        (QWEN2_7B, 7_615_616_512),
        (QWEN3_8B, 8_190_735_360),
        (QWEN3_0_6B, 596_049_920),
        (MIXTRAL_8X7B, 46_702_792_704),
        (GPT2_XL, 1_557_611_200),
    ],
    ids=["llama-3.1-8b", "llama-3.2-1b", "mistral-7b", "qwen2-7b", "qwen3-8b", "qwen3-0.6b", "mixtral-8x7b", "gpt2-xl"],
)
def test_num_params_matches_published_counts(raw: dict[str, Any], published: int) -> None:
    assert parsed(raw).num_params() == published


# The newer layout: transformers 5 writes `rope_parameters` (with rope_theta inside) instead of
# top-level `rope_theta` + `rope_scaling`. Both must describe the same model.


@pytest.mark.parametrize(
    ("config_class", "raw"),
    [
        (transformers.LlamaConfig, LLAMA_3_1_8B),
        (transformers.LlamaConfig, LLAMA_3_2_1B),
        (transformers.MistralConfig, MISTRAL_7B),
        (transformers.Qwen2Config, QWEN2_7B),
        (transformers.Qwen3Config, QWEN3_8B),
        (transformers.MixtralConfig, MIXTRAL_8X7B),
        (transformers.OPTConfig, OPT_13B),
        (transformers.GPT2Config, GPT2_XL),
    ],
)
def test_transformers_rewrite_of_a_real_config_parses_the_same(
    config_class: type[transformers.PretrainedConfig], raw: dict[str, Any]
) -> None:
    rewritten = config_class.from_dict(raw).to_dict()
    assert "rope_scaling" not in rewritten and "rope_theta" not in rewritten
    assert parsed(rewritten) == parsed(raw)


def test_a_saved_llama_config_with_llama3_scaling_parses(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=65536,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
    )
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_parameters"]["rope_theta"] == 500000.0  # the layout transformers writes today
    spec = parsed(raw)
    assert spec.rope == LLAMA3_ROPE
    assert (spec.hidden_size, spec.num_kv_heads, spec.head_dim, spec.tie_word_embeddings) == (256, 2, 32, True)


def test_legacy_rope_scaling_with_type_key_and_yarn() -> None:
    raw = QWEN2_7B | {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    rope = parsed(raw).rope
    assert rope == RopeSpec(theta=1e6, kind=RopeKind.YARN, factor=4.0, original_max_position_embeddings=32768)


def test_dbrx_rope_parameters_win_over_the_legacy_attn_config_theta() -> None:
    # transformers 5 runs DBRX with rope_parameters; a config that has both follows it.
    spec = parsed(DBRX | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert spec.rope == RopeSpec(theta=10000.0)


# transformers' own config classes, default and customised, for every family.


def _dbrx_config(**kw: Any) -> transformers.PretrainedConfig:
    attn = {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}
    ffn = {"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2}
    return transformers.DbrxConfig(attn_config=attn, ffn_config=ffn, **kw)


TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY_GQA = TINY | {"num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}

TINY_MODELS: dict[str, tuple[Callable[[], transformers.PretrainedConfig], type[torch.nn.Module]]] = {
    "llama": (lambda: transformers.LlamaConfig(**TINY_GQA), transformers.LlamaForCausalLM),
    "llama-tied-biased": (
        lambda: transformers.LlamaConfig(**TINY_GQA, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
        transformers.LlamaForCausalLM,
    ),
    "llama-head-dim": (lambda: transformers.LlamaConfig(**TINY_GQA | {"head_dim": 32}), transformers.LlamaForCausalLM),
    "mistral": (lambda: transformers.MistralConfig(**TINY_GQA, head_dim=None), transformers.MistralForCausalLM),
    "qwen2": (lambda: transformers.Qwen2Config(**TINY_GQA), transformers.Qwen2ForCausalLM),
    "qwen2-tied": (
        lambda: transformers.Qwen2Config(**TINY_GQA, tie_word_embeddings=True),
        transformers.Qwen2ForCausalLM,
    ),
    "qwen3": (lambda: transformers.Qwen3Config(**TINY_GQA, head_dim=32), transformers.Qwen3ForCausalLM),
    "qwen3-biased": (
        lambda: transformers.Qwen3Config(**TINY_GQA, head_dim=8, attention_bias=True),
        transformers.Qwen3ForCausalLM,
    ),
    "mixtral": (
        lambda: transformers.MixtralConfig(**TINY_GQA, num_local_experts=4, num_experts_per_tok=2),
        transformers.MixtralForCausalLM,
    ),
    "dbrx": (
        lambda: _dbrx_config(d_model=64, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=64),
        transformers.DbrxForCausalLM,
    ),
    "opt": (
        lambda: transformers.OPTConfig(
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=128,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
        ),
        transformers.OPTForCausalLM,
    ),
    "opt-no-bias": (
        lambda: transformers.OPTConfig(
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=128,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            enable_bias=False,
        ),
        transformers.OPTForCausalLM,
    ),
    "gpt2": (
        lambda: transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
        ),
        transformers.GPT2LMHeadModel,
    ),
    "gpt2-inner": (
        lambda: transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_inner=80, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
        ),
        transformers.GPT2LMHeadModel,
    ),
    "opt-post-ln": (
        lambda: transformers.OPTConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=96,
            vocab_size=128,
            max_position_embeddings=64,
            do_layer_norm_before=False,
        ),
        transformers.OPTForCausalLM,
    ),
    "bloom": (
        lambda: transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=128),
        transformers.BloomForCausalLM,
    ),
    "gptj": (
        lambda: transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=128, n_positions=64),
        transformers.GPTJForCausalLM,
    ),
    "gpt_neox": (
        lambda: transformers.GPTNeoXConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128
        ),
        transformers.GPTNeoXForCausalLM,
    ),
    "gpt_neox-sequential-tied": (
        lambda: transformers.GPTNeoXConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            vocab_size=128,
            use_parallel_residual=False,
            tie_word_embeddings=True,
            attention_bias=False,
        ),
        transformers.GPTNeoXForCausalLM,
    ),
}


def _unique_param_count(model: torch.nn.Module) -> int:
    return sum({id(p): p.numel() for p in model.parameters()}.values())


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_num_params_equals_the_real_model(name: str) -> None:
    make_config, model_class = TINY_MODELS[name]
    config = make_config()
    torch.manual_seed(0)
    model = model_class(config)
    assert parsed(config.to_dict()).num_params() == _unique_param_count(model)


@pytest.mark.parametrize(
    "config_class",
    [
        transformers.LlamaConfig,
        transformers.MistralConfig,
        transformers.Qwen2Config,
        transformers.Qwen3Config,
        transformers.MixtralConfig,
        transformers.DbrxConfig,
        transformers.OPTConfig,
        transformers.GPT2Config,
    ],
)
def test_default_transformers_configs_parse(config_class: type[transformers.PretrainedConfig]) -> None:
    config = config_class()
    spec = parsed(config.to_dict())
    assert spec.model_type == config.model_type
    assert spec.hidden_size == config.hidden_size  # attribute_map covers d_model / n_embd
    assert spec.num_attention_heads == config.num_attention_heads
    assert spec.num_layers == config.num_hidden_layers
    assert spec.vocab_size == config.vocab_size
    assert spec.num_kv_heads == (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    assert spec.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rope = getattr(config, "rope_parameters", None)
    if spec.rope is not None and rope is not None:
        assert spec.rope.theta == rope["rope_theta"]


# Failures: each names its field, and all are reported together.


def test_unknown_model_type_is_named() -> None:
    error = failure(LLAMA_3_1_8B | {"model_type": "gemma"})
    assert error.fields() == {"model_type"}
    assert "llama" in error.problems[0].reason  # lists the supported families
    assert failure({}).fields() == {"model_type"}


def test_every_problem_is_reported_at_once() -> None:
    raw = LLAMA_3_1_8B | {
        "num_key_value_heads": 5,
        "vocab_size": -1,
        "hidden_act": "tanh",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    del raw["num_hidden_layers"]
    error = failure(raw)
    assert error.fields() == {
        "num_key_value_heads",
        "vocab_size",
        "hidden_act",
        "num_hidden_layers",
        "rope_scaling.original_max_position_embeddings",
    }
    assert len(error.problems) == 5
    assert error.render().startswith("Invalid configuration: 5 problems:")


def test_missing_heads_is_reported_once_not_as_missing_kv_heads_too() -> None:
    raw = dict(MISTRAL_7B)
    del raw["num_attention_heads"], raw["num_key_value_heads"]
    assert [p.field for p in failure(raw).problems] == ["num_attention_heads"]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (QWEN2_7B | {"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling.type"),
        (QWEN2_7B | {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e6}}, "rope_parameters.rope_type"),
        (QWEN2_7B | {"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_parameters.rope_theta"),
        (QWEN2_7B | {"rope_theta": "1e6"}, "rope_theta"),
        (QWEN2_7B | {"rope_scaling": {"type": "linear", "factor": 0}}, "rope_scaling.factor"),
        (QWEN2_7B | {"rope_scaling": "yarn"}, "rope_scaling"),
        (QWEN2_7B | {"hidden_size": 3585}, "hidden_size"),
        (QWEN2_7B | {"sliding_window": -4, "use_sliding_window": True}, "sliding_window"),
        (QWEN2_7B | {"use_sliding_window": "no"}, "use_sliding_window"),
        (QWEN2_7B | {"use_sliding_window": True, "layer_types": ["full_attention"]}, "layer_types"),
        (QWEN2_7B | {"eos_token_id": [1, None]}, "eos_token_id"),
        (QWEN2_7B | {"hidden_act": ["silu"]}, "hidden_act"),
        (MIXTRAL_8X7B | {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        (MIXTRAL_8X7B | {"num_local_experts": 0}, "num_local_experts"),
        (DBRX | {"attn_config": {"kv_n_heads": 5, "rope_theta": 500000}}, "attn_config.kv_n_heads"),
        (DBRX | {"attn_config": {"kv_n_heads": 8, "rope_theta": 0}}, "attn_config.rope_theta"),
        (DBRX | {"attn_config": {"kv_n_heads": 8, "clip_qkv": -8}}, "attn_config.clip_qkv"),
        (
            DBRX | {"ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 4, "moe_top_k": 8}},
            "ffn_config.moe_top_k",
        ),
        (
            DBRX | {"ffn_config": {"ffn_hidden_size": 10752, "ffn_act_fn": {"name": "swiglu"}}},
            "ffn_config.ffn_act_fn.name",
        ),
        (DBRX | {"attn_config": "8 heads"}, "attn_config"),
        (
            DBRX | {"ffn_config": {"ffn_hidden_size": 10752, "moe_normalize_expert_weights": 0}},
            "ffn_config.moe_normalize_expert_weights",
        ),
        (OPT_13B | {"activation_function": "tanh"}, "activation_function"),
        (OPT_13B | {"num_attention_heads": 3}, "hidden_size"),
        (GPT2_XL | {"n_head": 0}, "n_head"),
        (GPT2_XL | {"n_inner": 0.5}, "n_inner"),
    ],
)
def test_each_problem_names_its_field(raw: dict[str, Any], field: str) -> None:
    assert [p.field for p in failure(raw).problems] == [field]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "dbrx"])
def test_active_params_count_the_chosen_experts_only(name: str) -> None:
    """One token reads every parameter but those of the experts it does not choose."""
    from nxdi.testing.checkpoints import build_model

    model = build_model(name)
    spec = parsed(model.config.to_dict())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    unchosen = experts * (spec.num_experts - spec.num_experts_per_tok) // spec.num_experts
    assert spec.active_params() == _unique_param_count(model) - unchosen
