"""The CPU backend's bf16 SwiGLU rewrite (`cpu_fusions.fused_swiglus` over `bf16_linear`) on whole
compiled decoders: bound with it, a bf16 model's decode program calls `nxdi_kernels::bf16_swiglu`
once per layer (context encoding in its last layer, run at the output tokens only), and the model's
logits over a prefill and teacher-forced decode steps equal those of the same compiled programs
bound without it, bit for bit, at batch 1 and 2.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nxdi.effects.backends import cpu_fusions, kernels
from tests.support.engine_fixtures import PROMPTS, load_model, teacher_forced, with_and_without

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")

FEED = torch.tensor([[5, 9, 13, 4], [3, 8, 6, 12]])
"""Tokens fed back as decode steps (teacher forcing), one row per sequence."""


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_steps_give_the_unfused_bits(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    def logits() -> torch.Tensor:
        model = load_model(
            tiny_checkpoint("llama"), "llama", workdir=tmp_path, backend="cpu", torch_dtype="bfloat16", batch_size=batch
        )
        return teacher_forced(model, PROMPTS[:batch], FEED[:batch])

    fused, plain, counts = with_and_without(monkeypatch, cpu_fusions, "fused_swiglus", logits)
    # decode: both layers; context encoding: its last layer, whose MLP runs at each row's output
    # token only (the first layer's prompt rows take oneDNN's GEMM)
    assert sorted(counts) == [1, 2]
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)
