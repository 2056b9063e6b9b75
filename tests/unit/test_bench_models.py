"""`nxdi.shell.cli.bench_models`: the random checkpoints `nxdi bench` builds, per family and shape."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from nxdi.core import families
from nxdi.core.model_spec import ModelSpec
from nxdi.shell.cli import bench_models
from nxdi.shell.cli.errors import UsageError
from nxdi.testing import checkpoints

SIZED = [(m, s) for m in sorted(bench_models.FAMILIES) for s in bench_models.SIZES]


def _config(model_type: str, shape: str) -> Any:
    return checkpoints.tiny_config(model_type, **bench_models.config_overrides(model_type, shape))


def _spec(model_type: str, shape: str) -> ModelSpec:
    return families.parse_model_spec(_config(model_type, shape).to_dict()).unwrap()


def test_every_family_the_engine_runs_has_the_sized_shapes() -> None:
    assert set(bench_models.FAMILIES) | bench_models.TOY_ONLY == set(bench_models.model_types())
    assert not set(bench_models.FAMILIES) & bench_models.TOY_ONLY


@pytest.mark.parametrize(("model_type", "shape"), SIZED)
def test_a_mixture_of_experts_reads_as_many_parameters_per_token_as_the_dense_shape(
    model_type: str, shape: str
) -> None:
    dense, spec = _spec("llama", shape), _spec(model_type, shape)
    sizes = bench_models.SIZES[shape]
    assert (spec.hidden_size, spec.num_layers, spec.head_dim) == (dense.hidden_size, dense.num_layers, 64)
    assert (spec.num_attention_heads, spec.num_kv_heads) == (sizes["num_attention_heads"], sizes["num_key_value_heads"])
    assert (spec.vocab_size, spec.tie_word_embeddings) == (32000, False)
    assert spec.is_moe == families.by_model_type()[model_type].moe
    # the router, the q/k norms and Gemma's extra norms differ: well under 0.1%
    assert spec.active_params() == pytest.approx(dense.active_params(), rel=1e-3)
    if spec.is_moe:
        assert (spec.num_experts, spec.num_experts_per_tok) == (bench_models.EXPERTS, bench_models.TOP_K)
        assert spec.num_params() > 2 * spec.active_params()


@pytest.mark.parametrize(("model_type", "shape"), SIZED)
def test_only_gemma3_has_a_window_and_it_interleaves_as_gemma_3_does(model_type: str, shape: str) -> None:
    spec = _spec(model_type, shape)
    if model_type != "gemma3":
        assert spec.sliding_window is None
        return
    assert spec.sliding_window == 512 and spec.attention_scale == 64**-0.5
    assert spec.full_attention_layers == tuple(range(5, spec.num_layers, 6))


@pytest.mark.parametrize(("model_type", "shape"), SIZED)
def test_transformers_builds_the_model_nxdi_reads(model_type: str, shape: str) -> None:
    """transformers accepts the config (also read back from its JSON, as the bench's saved
    checkpoint is) and its model, built without memory on the meta device, has the parameters the
    spec counts."""
    config = _config(model_type, shape)
    reread = type(config).from_dict(config.to_dict())
    assert families.parse_model_spec(reread.to_dict()).unwrap() == _spec(model_type, shape)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(reread)
    assert sum(p.numel() for p in model.parameters()) == _spec(model_type, shape).num_params()


def test_dbrx_keeps_its_nested_test_settings_and_takes_the_published_ones() -> None:
    overrides = bench_models.config_overrides("dbrx", "small")
    assert "head_dim" not in overrides and overrides["d_model"] == 768
    assert overrides["attn_config"] == {"kv_n_heads": 4, "clip_qkv": 8.0, "rope_theta": 10000.0}
    spec = _spec("dbrx", "small")
    assert (spec.clip_qkv, spec.moe_normalize_p, spec.intermediate_size) == (8.0, 1.0, 1024)


def test_a_sized_shape_of_a_family_without_its_config_keys_is_refused() -> None:
    with pytest.raises(UsageError, match=r"--shape small is not defined for gpt2 .*use --shape toy"):
        bench_models.config_overrides("gpt2", "small")
    assert bench_models.config_overrides("gpt2", "toy") == {}
