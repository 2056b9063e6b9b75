"""RoPE tables of every supported scaling kind against transformers' rotary embedding, through the config parser."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from nxdi.core import families
from nxdi.core.programs import layers

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
