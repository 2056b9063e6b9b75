"""Real Hugging Face `config.json` contents of the models the seeds' worked examples name (values as published)."""

from __future__ import annotations

from typing import Any

from returns.result import Failure, Success

from nxdi.core.errors import ConfigError
from nxdi.core.families import parse_model_spec
from nxdi.core.model_spec import ModelSpec

_LLAMA_31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

LLAMA_31_8B: dict[str, Any] = {
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
    "rope_scaling": _LLAMA_31_ROPE,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

LLAMA_31_70B: dict[str, Any] = {
    **LLAMA_31_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}
"""Llama-3.1-70B; Llama-3.3-70B has the same architecture."""

LLAMA_31_405B: dict[str, Any] = {
    **LLAMA_31_8B,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_attention_heads": 128,
    "num_hidden_layers": 126,
}

LLAMA_3_8B: dict[str, Any] = {
    **LLAMA_31_8B,
    "max_position_embeddings": 8192,
    "rope_scaling": None,
    "transformers_version": "4.40.0.dev0",
}

OPT_13B: dict[str, Any] = {
    "_name_or_path": "facebook/opt-13b",
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
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 5120,
}

OPT_30B: dict[str, Any] = {
    **OPT_13B,
    "_name_or_path": "facebook/opt-30b",
    "ffn_dim": 28672,
    "hidden_size": 7168,
    "num_attention_heads": 56,
    "num_hidden_layers": 48,
    "word_embed_proj_dim": 7168,
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
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}

GEMMA_3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}
"""google/gemma-3-1b-it: the hub's layout before transformers 5 (`sliding_window_pattern`,
`rope_local_base_freq`)."""

GEMMA_3_27B_TEXT: dict[str, Any] = {
    "model_type": "gemma3_text",
    "head_dim": 128,
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_hidden_layers": 62,
    "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
    "vocab_size": 262208,
}
"""The `text_config` of google/gemma-3-27b-it as a text model (the rest takes transformers' defaults):
a query_pre_attn_scalar other than head_dim, and linear RoPE scaling on the global layers."""

GEMMA_3_4B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
"""google/gemma-3-4b-it, the multimodal Gemma3ForConditionalGeneration: a sparse `text_config`
(vocab_size and the head counts are transformers' defaults) and the end-of-turn token among the
top-level eos ids."""


def spec(config: dict[str, Any]) -> ModelSpec:
    """The parsed ModelSpec of a config dict (tests only; a parse failure fails the test, listing its problems)."""
    match parse_model_spec(config):
        case Success(parsed):
            return parsed
        case Failure(error):
            raise AssertionError(error.render())
    raise AssertionError("unreachable")


def spec_failure(config: dict[str, Any]) -> ConfigError:
    """The ConfigError a config dict fails with (tests only; parsing fails the test)."""
    match parse_model_spec(config):
        case Failure(error):
            return error
    raise AssertionError(f"{config} parsed, but should not")


PLAN_JSON_KEYS: dict[str, set[str]] = {
    "buckets": {"context_encoding", "token_generation"},
    "sharding": {"strategy", "q_heads", "kv_heads", "q_heads_per_rank", "kv_heads_per_rank"},
    "kv_cache": {"shape_per_rank", "dtype", "bytes_per_rank"},
    "memory": {
        "weights_bytes",
        "kv_cache_bytes",
        "total_bytes",
        "per_core_bytes",
        "hbm_per_core_bytes",
        "fits",
        "min_tp_degree",
    },
    "lora": {"max_adapters"},
}
"""The keys the issue requires in `nxdi plan --json` / `Plan.to_dict()`, per section."""

MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
