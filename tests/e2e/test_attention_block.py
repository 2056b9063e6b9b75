"""The CPU backend's attention-block rewrite (`cpu_attention_blocks`) on whole compiled decoders.

- Bound with it, a bf16 model's decode programs call `nxdi_kernels::attention_block` once per layer
  (context encoding only where its attention is the decode kernel's), and the model's
  logits over a prefill and decode steps equal those of the same compiled programs bound without
  it, bit for bit, for batches of one and two sequences, with grouped and with plain multi-head
  attention, and for a speculation step of three tokens (the steps read what the earlier steps wrote
  into the KV cache, so the cache writes are checked too).
- A decoder whose attention glue has another form (q/k norms between the projection and RoPE) is
  left as it is, and still runs.
- Out of range cache slots are refused with the slot named, not written past the cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from nxdi.effects.backends import cpu_attention_blocks, kernels
from nxdi.testing import checkpoints
from nxdi.testing.checkpoints import SaveFormat
from tests.support.engine_fixtures import PROMPTS, load_model, padded, teacher_forced, with_and_without

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")

T = TypeVar("T")

FEED = torch.tensor([[5, 9, 13, 4, 7, 11], [3, 8, 6, 12, 10, 14]])
"""Tokens fed back as decode steps (teacher forcing), one row per sequence."""


def _with_and_without(monkeypatch: pytest.MonkeyPatch, run: Callable[[], T]) -> tuple[T, T, list[int]]:
    """`run()` with the attention-block rewrite, then without it, and the rewrite's counts."""
    return with_and_without(monkeypatch, cpu_attention_blocks, "fused_attention_blocks", run)


def _both(
    checkpoint: Path, variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Teacher-forced logits of the compiled bf16 model bound with the rewrite, then without it, and
    the rewrite's counts."""
    settings: dict[str, Any] = {"torch_dtype": "bfloat16", "batch_size": batch}
    model = functools.partial(load_model, checkpoint, variant, workdir=tmp_path, backend="cpu", **settings)
    return _with_and_without(monkeypatch, lambda: teacher_forced(model(), PROMPTS[:batch], FEED[:batch]))


@pytest.mark.parametrize(("batch", "kv_heads"), [(1, 2), (2, 2), (2, 4)], ids=["gqa-1", "gqa-2", "mha-2"])
def test_decode_steps_give_the_unfused_bits(
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    batch: int,
    kv_heads: int,
) -> None:
    checkpoint = tiny_checkpoint("llama")  # 4 query heads, 2 KV heads
    if kv_heads != 2:
        checkpoint, _ = checkpoints.build_checkpoint(
            tmp_path / "mha", "llama", SaveFormat.SAFETENSORS, num_key_value_heads=kv_heads
        )
    fused, plain, counted = _both(checkpoint, "llama", tmp_path, monkeypatch, batch)
    layers = 2  # the tiny checkpoints' depth
    # token generation: every layer. Context encoding's attention is the decode kernel's only where
    # its query rows are few enough (64 tokens of plain multi-head attention), and then fused too.
    assert sorted(counted) == [1 if kv_heads == 4 else 0, layers]
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_a_speculation_step_of_several_tokens_gives_the_unfused_bits(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target's speculation program takes K tokens a step: the fold and the cache writes of T > 1."""
    settings: dict[str, Any] = {"torch_dtype": "bfloat16", "batch_size": 2, "speculation_length": 3}
    settings["trace_tokengen_model"] = False  # the speculation program is the only decode program
    ids, mask = padded(PROMPTS[:2], "right")
    positions = mask.sum(-1, keepdim=True) + torch.arange(3)

    def logits() -> list[torch.Tensor]:
        model = load_model(tiny_checkpoint("llama"), "llama", workdir=tmp_path, backend="cpu", **settings)
        model.reset()
        first = model.forward(ids, attention_mask=mask).logits
        return [first, model.forward(FEED[:, :3], position_ids=positions).logits]

    fused, plain, counted = _with_and_without(monkeypatch, logits)
    assert sorted(counted) == [0, 2]  # context encoding: none; speculation: both layers
    assert fused[1].shape == (2, 3, plain[1].shape[-1])
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_another_form_is_left_alone_and_runs(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused, plain, counted = _both(tiny_checkpoint("qwen3"), "qwen3", tmp_path, monkeypatch, 2)
    assert counted == [0, 0]
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_an_out_of_range_slot_is_refused() -> None:
    b, t, hq, hkv, d, s = 1, 1, 4, 2, 16, 8
    qkv = torch.randn(b * t, (hq + 2 * hkv) * d).bfloat16()
    cos, sin = torch.ones(b, t, 1, d).bfloat16(), torch.zeros(b, t, 1, d).bfloat16()
    k_cache, v_cache = torch.zeros(b, hkv, s, d).bfloat16(), torch.zeros(b, hkv, s, d).bfloat16()
    index = torch.full((b, 1, t, 1), s, dtype=torch.int64).expand(b, hkv, t, d)
    mask = torch.ones(b, 1, hq // hkv * t, s, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="cache slot 8 is out of range for a cache of 8 slots"):
        torch.ops.nxdi_kernels.attention_block(qkv, cos, sin, k_cache, v_cache, index, mask, b, t, hq, hkv, d, True)
    assert not k_cache.any() and not v_cache.any()
