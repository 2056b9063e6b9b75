"""Quantized weights under fused speculation: a quantized target with its draft, the draft config a
deep copy of the target's NeuronConfig (so quantized too), as NxDI's examples make it.

- `draft_model_modules_to_not_convert` replaces the draft's modules_to_not_convert: listing every
  layer keeps the draft in float (read from draft_model_path); listing some keeps those in float
  while the rest are read quantized. The tokens are the quantized target's own greedy tokens.
- Without it the copied config quantizes the draft, whose weights draft_model_path must then hold
  quantized: a float draft checkpoint is refused, naming the draft's tensors.
- Refused: the setting on a draft that is not quantized, or against a list the draft config sets
  itself; without fused speculation it has no effect and the model warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import nxdi
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import CheckpointValidationError, IncompatibleConfigError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.testing import checkpoints
from tests.support.engine_fixtures import PROMPTS, SEQ_LEN, load_model, nxdi_generate
from tests.support.fused_models import fused_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LM = nxdi.NeuronLlamaForCausalLM
QUANT = {"quantization_type": "per_channel_symmetric"}


@pytest.fixture(scope="module")
def setup(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(target, its int8 quantized checkpoint, a float one-layer draft)."""
    root = tmp_path_factory.mktemp("fused-quantized")
    target = tiny_checkpoint("llama")
    fmt = checkpoints.SaveFormat.SAFETENSORS
    draft, _ = checkpoints.build_checkpoint(root / "draft", "llama", fmt, seed=7, num_hidden_layers=1)
    quantized = root / "target-q"
    quantized.mkdir()
    config = fused_config(target, draft, quantized=True, quantized_checkpoints_path=str(quantized), **QUANT)
    LM.save_quantized_state_dict(target, config)
    return target, quantized, draft


@pytest.fixture(scope="module")
def expected(setup: tuple[Path, Path, Path]) -> torch.Tensor:
    """The quantized target's greedy tokens without speculation, batch 2."""
    target, quantized, _ = setup
    plain = load_model(
        target, "llama", batch_size=2, quantized=True, quantized_checkpoints_path=str(quantized), **QUANT
    )
    return nxdi_generate(plain, PROMPTS[:2])


def _fused(setup: tuple[Path, Path, Path], **kwargs: Any) -> Any:
    target, quantized, draft = setup
    settings = {"batch_size": 2, "quantized": True, "quantized_checkpoints_path": str(quantized), **QUANT, **kwargs}
    return fused_config(target, draft, **settings)


def _quantized_steps(model: Any) -> set[str]:
    return {s.name for s in model._fused.draft_plan.steps if s.quantized}


def test_listing_every_draft_layer_keeps_the_draft_in_float(setup: Any, expected: torch.Tensor) -> None:
    model = LM(setup[0], _fused(setup, draft_model_modules_to_not_convert=["layers", "lm_head"]))
    model.to_cpu()
    assert _quantized_steps(model) == set()
    assert torch.equal(nxdi_generate(model, PROMPTS[:2]), expected)


def test_a_partly_quantized_draft_reads_its_own_quantized_checkpoint(
    setup: Any, expected: torch.Tensor, tmp_path: Path
) -> None:
    """The draft's quantized checkpoint (saved with the list as its modules_to_not_convert) is
    named by the draft config's own quantized_checkpoints_path; lm_head stays in float."""
    _, _, draft = setup
    draft_q = tmp_path / "draft-q"
    draft_q.mkdir()
    saving = NeuronConfig(
        torch_dtype="float32",
        quantized=True,
        quantized_checkpoints_path=str(draft_q),
        modules_to_not_convert=["lm_head"],
        **QUANT,
    )
    LM.save_quantized_state_dict(draft, LM.get_config_cls()(saving, load_config=load_pretrained_config(draft)))
    config = _fused(setup, draft_model_modules_to_not_convert=["lm_head"])
    config.fused_spec_config.draft_config.neuron_config.quantized_checkpoints_path = str(draft_q)
    model = LM(setup[0], config)
    model.to_cpu()
    steps = _quantized_steps(model)
    assert "lm_head.weight" not in steps and "layers.0.mlp.down_proj.weight" in steps
    assert torch.equal(nxdi_generate(model, PROMPTS[:2]), expected)


def test_a_copied_config_quantizes_the_draft_and_a_float_draft_checkpoint_is_refused(setup: Any) -> None:
    model = LM(setup[0], _fused(setup))
    with pytest.raises(CheckpointValidationError, match=r"draft_model\.layers\.0\.mlp\.down_proj\.scale"):
        model.to_cpu()


def test_what_cannot_take_effect_is_refused_or_reported(setup: Any) -> None:
    target, _, draft = setup
    unquantized = fused_config(target, draft, batch_size=2, draft_model_modules_to_not_convert=["lm_head"])
    with pytest.raises(IncompatibleConfigError, match=r"draft_model_modules_to_not_convert.*not quantized"):
        LM(target, unquantized)
    conflicting = _fused(setup, draft_model_modules_to_not_convert=["lm_head"])
    conflicting.fused_spec_config.draft_config.neuron_config.modules_to_not_convert = ["layers.0.mlp"]
    with pytest.raises(IncompatibleConfigError, match=r"would replace the draft config's own modules_to_not_convert"):
        LM(target, conflicting)
    alone = LM.get_config_cls()(
        NeuronConfig(torch_dtype="float32", seq_len=SEQ_LEN, draft_model_modules_to_not_convert=["lm_head"]),
        load_config=load_pretrained_config(target),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LM(target, alone)
    assert any("draft_model_modules_to_not_convert" in str(w.message) for w in caught)
