"""Mixtures of experts through the documented API, beyond what every family gets (test_families.py,
test_tensor_parallel.py, test_accuracy.py): MoENeuronConfig settings that take effect, and those
refused with a named error.

- capacity_factor: below full capacity tokens are dropped (the prefill logits change); at a
  capacity that holds every token the logits are those of no capacity_factor.
- moe_mask_padded_tokens: padding takes no expert capacity.
- Refused, every problem named: quantized weights, moe_tp_degree x moe_ep_degree other than
  tp_degree.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.shell.config import MoENeuronConfig, NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import MixtralInferenceConfig, NeuronMixtralForCausalLM
from tests.support.engine_fixtures import PROMPTS, SEQ_LEN

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(path: Path, **kwargs: Any) -> Any:
    neuron = MoENeuronConfig(torch_dtype="float32", seq_len=SEQ_LEN, output_logits=True, **kwargs)
    return NeuronMixtralForCausalLM(path, MixtralInferenceConfig(neuron, load_config=load_pretrained_config(path)))


def _prefill_logits(model: Any) -> torch.Tensor:
    model.to_cpu()
    ids = torch.tensor([PROMPTS[0]])
    return model(ids).logits


def test_capacity_factor_drops_tokens_only_below_full_capacity(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("mixtral")  # 4 experts, 2 per token: full capacity from 2.0
    free = _prefill_logits(_model(path))
    assert torch.allclose(_prefill_logits(_model(path, capacity_factor=1.9)), free, atol=1e-5)  # ceil(0.95 T) = T
    # The 12-token prompt runs in a 64-token bucket: capacity ceil(64 * 2 * 0.1 / 4) = 4 tokens per
    # expert, fewer than the prompt's 24 choices need.
    dropped = _prefill_logits(_model(path, capacity_factor=0.1))
    assert (dropped - free).abs().max() > 1e-3


def test_a_plain_neuron_config_compiles_and_loads(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """A NeuronConfig given to a MoE family is read as the MoENeuronConfig it stands for (MoE options
    at their defaults), so the folder compile() writes is the one load() accepts."""
    path = tiny_checkpoint("mixtral")
    config = MixtralInferenceConfig(
        NeuronConfig(torch_dtype="float32", seq_len=SEQ_LEN), load_config=load_pretrained_config(path)
    )
    assert isinstance(config.neuron_config, MoENeuronConfig) and config.neuron_config.capacity_factor is None
    model = NeuronMixtralForCausalLM(path, config)
    model.compile(tmp_path)
    model.load(tmp_path)
    eager = _model(path)
    eager.to_cpu()
    ids = torch.tensor([PROMPTS[0]])
    torch.testing.assert_close(model(ids).logits, eager(ids).logits, rtol=0, atol=1e-5)  # traced vs eager ops


def test_masking_padded_tokens_keeps_padding_from_taking_expert_capacity(tiny_checkpoint: Callable[..., Path]) -> None:
    """Two prompts (10 and 14 tokens) in a 64-token bucket: 128 tokens, capacity ceil(128 * 2 * 0.375 / 4)
    = 24 per expert, room for every real token (24 of them) but not for the first row's padding too."""
    path = tiny_checkpoint("mixtral")
    rows = [PROMPTS[0], PROMPTS[2]]
    ids = torch.zeros(2, 14, dtype=torch.int64)
    mask = torch.zeros(2, 14, dtype=torch.int64)
    for i, p in enumerate(rows):
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1

    def logits(**kw: Any) -> torch.Tensor:
        model = _model(path, batch_size=2, **kw)
        model.to_cpu()
        return model(ids, attention_mask=mask).logits

    free = logits()
    assert torch.allclose(logits(capacity_factor=0.375, moe_mask_padded_tokens=True), free, atol=1e-5)
    assert (logits(capacity_factor=0.375) - free).abs().max() > 1e-3  # padding took real tokens' places
    assert torch.allclose(logits(moe_mask_padded_tokens=True), free, atol=1e-5)  # no capacity: nothing to take


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"tp_degree": 4, "moe_ep_degree": 2}, "moe_tp_degree"),  # 1 x 2 ranks is not tp_degree=4
        ({"quantized": True, "quantized_checkpoints_path": "/nonexistent/q.pt"}, "quantized"),
        ({"tp_degree": 2, "moe_tp_degree": 4}, "moe_tp_degree"),
        ({"glu_mlp": False}, "glu_mlp"),  # Mixtral's experts are gated: its checkpoint has w1 and w3
        ({"tp_degree": 2, "hybrid_sharding_config": {"moe_cte_tp_degree": 2}}, "moe_tkg_tp_degree"),  # 1 x 1 != 2
    ],
)
def test_settings_not_implemented_are_refused_naming_the_field(
    settings: dict[str, Any], field: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    with pytest.raises(IncompatibleConfigError, match=field.replace(".", r"\.") + "="):
        _model(tiny_checkpoint("mixtral"), **settings).to_cpu()
