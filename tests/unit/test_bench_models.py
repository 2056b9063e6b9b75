"""`nxdi.shell.cli.bench_models`: the random checkpoints `nxdi bench` builds, per family and shape."""

from __future__ import annotations

import pytest

from nxdi.core import families
from nxdi.shell.cli import bench_models
from nxdi.shell.cli.errors import UsageError
from nxdi.testing import checkpoints


def _spec(model_type: str, shape: str) -> object:
    config = checkpoints.tiny_config(model_type, **bench_models.config_overrides(model_type, shape))
    return families.parse_model_spec(config.to_dict()).unwrap()


@pytest.mark.parametrize("shape", ["small", "tiny"])
@pytest.mark.parametrize("model_type", sorted(bench_models.FAMILIES))
def test_a_mixture_of_experts_reads_as_many_parameters_per_token_as_the_dense_shape(
    model_type: str, shape: str
) -> None:
    assert model_type in bench_models.model_types()
    dense, spec = _spec("llama", shape), _spec(model_type, shape)
    assert (spec.hidden_size, spec.num_layers, spec.head_dim) == (dense.hidden_size, dense.num_layers, 64)
    assert spec.sliding_window is None and spec.is_moe == families.by_model_type()[model_type].moe
    # the router and the q/k norms differ: well under 0.1%
    assert spec.active_params() == pytest.approx(dense.active_params(), rel=1e-3)
    if spec.is_moe:
        assert (spec.num_experts, spec.num_experts_per_tok) == (bench_models.EXPERTS, bench_models.TOP_K)
        assert spec.num_params() > 2 * spec.active_params()


def test_a_sized_shape_of_a_family_without_its_config_keys_is_refused() -> None:
    with pytest.raises(UsageError, match=r"--shape small is not defined for gpt2 .*use --shape toy"):
        bench_models.config_overrides("gpt2", "small")
    assert bench_models.config_overrides("gpt2", "toy") == {}
