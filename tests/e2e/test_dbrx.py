"""DBRX through the documented API, beyond what every family gets (test_families.py, test_engine_*.py,
test_tensor_parallel.py, test_accuracy.py check its logits, tokens and ranks against transformers):

- clip_qkv binds in the tiny model (transformers without the clip gives logits far outside the
  tolerance), and our logits are transformers' clipped ones: skipping the clamp fails here.
- A fused experts tensor ([X*F, E]) of the wrong shape is refused before anything is read, naming
  the checkpoint key, its shape and the expected one.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from nxdi.shell.config import MoENeuronConfig
from nxdi.shell.exceptions import CheckpointValidationError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import DbrxInferenceConfig, NeuronDbrxForCausalLM
from nxdi.testing.checkpoints import write_checkpoint_file
from tests.support.engine_fixtures import PAD, hf_logits, padded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ((1, 5, 7, 9, 11, 3, 4, 5, 6, 7, 8, 9), (3, 4))


def _unclipped(hf: Any) -> Any:
    """The transformers model with a clip that never binds (it cannot run with clip_qkv None)."""
    free = copy.deepcopy(hf)
    for block in free.transformer.blocks:
        block.norm_attn_norm.attn.clip_qkv = 1e9
    return free


def test_clip_qkv_binds_and_our_logits_are_the_clipped_ones(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    hf = tiny_model("dbrx")
    model = loaded_model("dbrx", batch_size=2, output_logits=True)  # test_families' model, shared
    assert model.model_spec.clip_qkv == hf.config.attn_config.clip_qkv == 0.75
    ids, mask = padded(PROMPTS, "left")
    model.reset()
    logits = model(ids, attention_mask=mask).logits[:, 0]  # [B, V], each prompt's last position
    free = _unclipped(hf)
    for row, prompt in enumerate(PROMPTS):
        clipped, unclipped = hf_logits(hf, prompt)[-1], hf_logits(free, prompt)[-1]
        tolerance = 1e-4 * clipped.abs().max().item()
        assert (logits[row] - clipped).abs().max().item() <= tolerance
        assert (unclipped - clipped).abs().max().item() > 100 * tolerance, "the clip must bind in this model"


def test_a_fused_experts_tensor_of_the_wrong_shape_is_refused_naming_it(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    src = tiny_checkpoint("dbrx")
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(src / "config.json", path / "config.json")
    tensors = safetensors.torch.load_file(src / "model.safetensors")
    key = "transformer.blocks.1.ffn.experts.mlp.w2"
    assert tuple(tensors[key].shape) == (4 * 48, 64)  # X*F rows: every expert's [F, E] block
    tensors[key] = tensors[key][:-1]  # one row short: the experts' blocks no longer tile it
    write_checkpoint_file(path / "model.safetensors", tensors)
    neuron = MoENeuronConfig(torch_dtype="float32", seq_len=64)
    model = NeuronDbrxForCausalLM(path, DbrxInferenceConfig(neuron, load_config=load_pretrained_config(path)))
    named = r"transformer\.blocks\.1\.ffn\.experts\.mlp\.w2=\(191, 64\): has shape \(191, 64\), expected \(192, 64\)"
    with pytest.raises(CheckpointValidationError, match=named) as caught:
        model.to_cpu()
    assert str(caught.value).count("\n  - ") <= 1, "one problem, stated once"
    with pytest.raises(RuntimeError, match="not loaded"):
        model.forward(torch.tensor([[3, PAD]]))
