"""The CPU backend's C++ graph runner (`cpu_runner.run_in_cpp`) on whole compiled decoders.

Bound with it, every program of a compiled model hands its long runs of ops to C++, and the
model's logits over a prefill and teacher-forced decode steps (which read what the earlier steps
wrote into the KV cache) equal those of the same programs bound without it, bit for bit: bf16 at
batch 1 and 2, float32, int8 weights, and a family with q/k norms (Qwen3).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi import NeuronConfig, load_pretrained_config
from nxdi.effects.backends import cpu_runner, kernels
from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES
from tests.support.engine_fixtures import PROMPTS, load_model, teacher_forced, with_and_without

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")

FEED = torch.tensor([[5, 9, 13, 4, 7], [3, 8, 6, 12, 10]])
"""Tokens fed back as decode steps (teacher forcing), one row per sequence."""

CASES = {
    "llama-bf16-1": ("llama", 1, {"torch_dtype": "bfloat16"}),
    "llama-bf16-2": ("llama", 2, {"torch_dtype": "bfloat16"}),
    "llama-fp32-2": ("llama", 2, {"torch_dtype": "float32"}),
    "llama-int8-2": ("llama", 2, {"torch_dtype": "bfloat16", "quantized": True}),
    "qwen3-bf16-2": ("qwen3", 2, {"torch_dtype": "bfloat16"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_programs_run_from_cpp_give_the_python_bits(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    variant, batch, settings = CASES[case]
    extra: dict[str, Any] = dict(settings)
    if extra.get("quantized"):
        extra |= {
            "quantized_checkpoints_path": str(tmp_path / "quantized"),
            "quantization_type": "per_channel_symmetric",
        }
        config = CONFIG_TYPES[variant](
            NeuronConfig(batch_size=batch, **extra), load_config=load_pretrained_config(tiny_checkpoint(variant))
        )
        MODEL_TYPES[variant]["causal-lm"].save_quantized_state_dict(tiny_checkpoint(variant), config)

    def logits() -> torch.Tensor:
        model = load_model(
            tiny_checkpoint(variant), variant, workdir=tmp_path, backend="cpu", batch_size=batch, **extra
        )
        return teacher_forced(model, PROMPTS[:batch], FEED[:batch])

    cpp, python, moved = with_and_without(monkeypatch, cpu_runner, "run_in_cpp", logits)
    assert len(moved) == 2 and min(moved) >= 20  # context encoding and token generation, each mostly in C++
    torch.testing.assert_close(cpp, python, rtol=0, atol=0)
