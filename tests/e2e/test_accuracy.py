"""check_accuracy and check_accuracy_logits against transformers on the same checkpoint.

Tolerances are the reference's (REFERENCE §10): top-k groups all/1000/50/5 with rtol
0.05/0.03/0.02/0.01 scaled by the largest expected logit, atol 1e-5, near-tie 0.001. The bf16
models are stored in bf16 (as real checkpoints are) after brief training, so their logits are
confident like real weights; the golden side is transformers in fp32 on the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi import NeuronConfig, OnDeviceSamplingConfig, load_pretrained_config
from nxdi.core import families
from nxdi.shell.accuracy import LogitReport, check_accuracy, check_accuracy_logits
from nxdi.shell.exceptions import IncompatibleConfigError, LogitMatchingValidationError
from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES
from nxdi.testing import checkpoints
from nxdi.testing.training import train_briefly
from tests.support import moe_routing

FAMILIES = tuple(r.name for r in families.runnable())
INPUTS = {
    "input_ids": torch.tensor([[0, 0, 0, 10, 13, 16], [4, 5, 6, 7, 8, 9]]),
    "attention_mask": torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
}


@pytest.fixture(scope="module")
def trained_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family in FAMILIES:
        model = checkpoints.build_model(family, initializer_range=0.02)
        train_briefly(model, steps=150)
        out[family] = checkpoints.save_checkpoint(
            model.to(torch.bfloat16), tmp_path_factory.mktemp(family), checkpoints.SaveFormat.SAFETENSORS
        )
    return out


def _model(path: Path, family: str, **neuron: object) -> object:
    config = CONFIG_TYPES[family](
        NeuronConfig(batch_size=2, max_context_length=32, seq_len=64, **neuron),
        load_config=load_pretrained_config(path),
    )
    model = MODEL_TYPES[family]["causal-lm"](path, config)
    model.to_cpu()
    return model


def _passes_logit_matching(model: Any, family: str) -> LogitReport:
    """check_accuracy_logits at the reference's tolerances over 2 x 32 positions. A mixture of
    experts may fail only at a token the fp32 golden routes at a near-tie (`tests.support.moe_routing`),
    where bf16 rounding rightly picks either expert."""
    try:
        report = check_accuracy_logits(model, inputs=INPUTS, num_tokens_to_check=32)
    except LogitMatchingValidationError as e:
        if not families.record_for(family).unwrap().moe:
            raise
        failed = {(row, r.index) for row, r in e.results.positions if not r.passed}
        golden = model.load_hf_model(model.model_path).float()
        ids, mask = INPUTS["input_ids"], INPUTS["attention_mask"]
        sequences = golden.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
        ties = moe_routing.near_ties(golden, sequences, mask, model.model_spec.num_experts_per_tok)
        assert failed <= ties, f"failed at {sorted(failed - ties)}, routed without a near-tie:\n{e}"
        assert len(failed) <= 2, f"near-ties explain each failure, but {len(failed)} are more than chance:\n{e}"
        report = e.results
    assert len(report.positions) == 2 * 32
    return report


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_passes_logit_matching(family: str, trained_bf16: dict[str, Path]) -> None:
    model = _model(trained_bf16[family], family)
    assert model.spec.torch_dtype == "bfloat16"  # taken from the checkpoint
    report = _passes_logit_matching(model, family)
    assert max(report.worst().values()) > 0  # bf16 is not bit-exact: the check compared real numbers


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_passes_logit_matching_at_tp2(family: str, trained_bf16: dict[str, Path]) -> None:
    model = _model(trained_bf16[family], family, tp_degree=2)
    try:
        _passes_logit_matching(model, family)
    finally:
        model.close()  # type: ignore[attr-defined]


def test_bf16_with_on_device_sampling_and_output_logits(trained_bf16: dict[str, Path]) -> None:
    ods = OnDeviceSamplingConfig(top_k=1)
    model = _model(trained_bf16["llama"], "llama", on_device_sampling_config=ods, output_logits=True)
    assert check_accuracy_logits(model, inputs=INPUTS, num_tokens_to_check=16).passed
    without = _model(trained_bf16["llama"], "llama", on_device_sampling_config=ods)
    with pytest.raises(IncompatibleConfigError, match="output_logits"):
        check_accuracy_logits(without, inputs=INPUTS)


def test_token_matching_fp32(tmp_path: Path) -> None:
    path, _ = checkpoints.build_checkpoint(tmp_path, "llama", checkpoints.SaveFormat.SAFETENSORS)
    model = _model(path, "llama", torch_dtype="float32")
    tokens = check_accuracy(model, inputs=INPUTS, num_tokens_to_check=32)
    assert tokens.shape == (2, 6 + 32)


def test_logit_matching_detects_wrong_weights(trained_bf16: dict[str, Path], tmp_path: Path) -> None:
    """Perturb one layer of the nxdi side only: the check must fail (it can fail)."""
    model = _model(trained_bf16["llama"], "llama", torch_dtype="float32")
    golden = model.load_hf_model(model.model_path).float()
    with torch.no_grad():
        model._runtime.weights.layers[0].mlp.down.mul_(1.5)
    with pytest.raises(LogitMatchingValidationError) as info:
        check_accuracy_logits(model, inputs=INPUTS, num_tokens_to_check=8, golden_model=golden)
    assert not info.value.results.passed
    with pytest.raises(AssertionError, match="token mismatch"):
        check_accuracy(model, inputs=INPUTS, num_tokens_to_check=8, golden_model=golden)
