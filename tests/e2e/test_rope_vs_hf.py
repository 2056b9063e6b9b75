"""RoPE tables of every supported scaling kind against transformers' rotary embedding, through the config
parser; and Gemma 3's two RoPEs (sliding-window and global layers) through the decoder's per-layer tables."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from nxdi.core import families
from nxdi.core.programs import attention, layers

MAX_POSITIONS = 64
CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-beta": {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 2.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "attention_factor": 1.3,
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("longest", [20, 100])
def test_rope_tables_match_transformers(case: str, longest: int) -> None:
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=8,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=dict(CASES[case]),
    )
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.stack([torch.arange(longest - 8, longest), torch.arange(8)])  # [B=2, S=8]
    with torch.no_grad():
        cos_hf, sin_hf = rotary(torch.zeros(1, dtype=torch.float32), positions)
    spec = families.parse_model_spec(config.to_dict()).unwrap()
    assert spec.rope is not None
    cos, sin = layers.rope_cos_sin(
        spec.rope, positions, head_dim=spec.head_dim, max_positions=spec.max_position_embeddings, dtype=torch.float32
    )
    torch.testing.assert_close(cos, cos_hf, rtol=0, atol=2e-5)
    torch.testing.assert_close(sin, sin_hf, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6, "rope_local_base_freq": 1e4},
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            }
        },
    ],
    ids=["legacy-linear", "yarn-global"],
)
def test_gemma3_layers_get_the_rope_of_their_attention_type(rope: dict[str, Any]) -> None:
    """Each layer's table is transformers' table of its layer type; alike layers share one tensor."""
    config = transformers.Gemma3TextConfig(
        hidden_size=64,
        head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=4,
        intermediate_size=8,
        vocab_size=8,
        max_position_embeddings=MAX_POSITIONS,
        sliding_window_pattern=2,
        **rope,
    )
    rotary = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    positions = torch.stack([torch.arange(92, 100), torch.arange(8)])  # [B=2, S=8]
    spec = families.parse_model_spec(config.to_dict()).unwrap()
    tables = attention.rope_tables(positions, torch.tensor(100), spec, torch.float32)
    assert tables[0] is tables[2] and tables[1] is tables[3] and tables[0][0] is not tables[1][0]
    for i, kind in enumerate(config.layer_types):
        with torch.no_grad():
            cos_hf, sin_hf = rotary(torch.zeros(1, dtype=torch.float32), positions, kind)
        cos, signed_sin = tables[i]
        torch.testing.assert_close(cos[:, :, 0], cos_hf, rtol=0, atol=2e-5)
        torch.testing.assert_close(signed_sin[:, :, 0], layers.signed_sin(sin_hf), rtol=0, atol=2e-5)
