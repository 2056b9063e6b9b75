"""nxdi's one-op bf16 RoPE kernel and the CPU backend's rewrite to it.

- The kernel equals `layers.apply_rope` (torch's two products, roll and sum, each rounded to bf16)
  bit for bit: decode rows read where they lie in the fused qkv output, prefill rows split over
  threads, cos and sin broadcast over heads and batch, half widths that are and are not multiples
  of its 16-wide step; it keeps NaN and infinity and refuses what it cannot take.
- The rewrite turns `apply_rope`'s traced form into the kernel, in bf16 only, and leaves a roll
  with other users alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, fx

from nxdi.core.programs import layers
from nxdi.effects.backends import cpu_fusions, kernels
from tests.support.graph_rewrites import rewritten, targets

needs_kernel = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")


def _same_bits(got: Tensor, want: Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _tables(b: int, s: int, d: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    angles = torch.rand(b, s, 1, d // 2, generator=g) * 100
    cos = torch.cat((angles, angles), -1).cos().bfloat16()
    sin = torch.cat((angles, angles), -1).sin()
    return cos, torch.cat((-sin[..., : d // 2], sin[..., d // 2 :]), -1).bfloat16()


@needs_kernel
@pytest.mark.parametrize(
    ("x_shape", "rows", "table_batch"),
    [
        ((1, 1, 40, 64), slice(0, 36), 1),  # decode: q and k heads of the fused qkv output, in place
        ((4, 1, 12, 128), slice(None), 4),
        ((2, 37, 12, 128), slice(None), 1),  # prefill rows over threads, tables shared by the batch
        ((1, 3, 5, 40), slice(1, 4), 1),  # half width 20: a masked tail step
        ((1, 2, 3, 2), slice(None), 1),
    ],
)
def test_kernel_gives_apply_ropes_bits(x_shape: tuple[int, int, int, int], rows: slice, table_batch: int) -> None:
    g = torch.Generator().manual_seed(sum(x_shape))
    x = (4 * torch.randn(*x_shape, generator=g)).bfloat16()[:, :, rows]
    cos, sin = _tables(table_batch, x_shape[1], x_shape[-1], g)
    _same_bits(torch.ops.nxdi_kernels.rope(x, cos, sin), layers.apply_rope(x, cos, sin))


@needs_kernel
def test_kernel_keeps_nan_and_infinity_where_torch_does() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, 2, 64, generator=g).bfloat16()
    x[0, 0, 0, 3], x[0, 0, 1, 40], x[0, 0, 1, 7] = float("nan"), float("inf"), 3e38
    cos, sin = _tables(1, 1, 64, g)
    _same_bits(torch.ops.nxdi_kernels.rope(x, cos, sin), layers.apply_rope(x, cos, sin))


@needs_kernel
@pytest.mark.parametrize(
    ("x", "table", "message"),
    [
        (torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 1, 8).bfloat16(), "must be bf16"),
        (torch.zeros(1, 1, 2, 7).bfloat16(), torch.zeros(1, 1, 1, 7).bfloat16(), "D even"),
        (torch.zeros(1, 1, 2, 8).bfloat16(), torch.zeros(1, 1, 8).bfloat16(), "x's rank"),
        (torch.zeros(1, 2, 2, 8).bfloat16(), torch.zeros(1, 3, 1, 8).bfloat16(), "broadcast to x"),
    ],
)
def test_kernel_refuses_what_it_cannot_take(x: Tensor, table: Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.nxdi_kernels.rope(x, table, table)


class _Ropes(torch.nn.Module):
    def forward(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        qk = layers.apply_rope(qkv[:, :, :6], cos, sin)  # the decoder's form: q and k heads at once
        v = qkv[:, :, 6:]
        turned = torch.roll(v, v.shape[-1] // 2, -1)  # a roll with another user: left alone
        return qk, v * cos + turned * sin + turned


def _bound(dtype: torch.dtype) -> tuple[fx.GraphModule, int, tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    cos, sin = _tables(2, 1, 64, g)
    args = (torch.randn(2, 1, 8, 64, generator=g).to(dtype), cos.to(dtype), sin.to(dtype))
    return rewritten(_Ropes(), args, cpu_fusions.fused_ropes)


@needs_kernel
def test_the_rewrite_fuses_apply_rope_in_bf16_only() -> None:
    gm, count, (qk, other), (want_qk, want_other) = _bound(torch.bfloat16)
    assert count == 1 and targets(gm).count(torch.ops.nxdi_kernels.rope.default) == 1
    assert targets(gm).count(torch.ops.aten.roll.default) == 1  # the roll with another user
    _same_bits(qk, want_qk)
    assert torch.equal(other, want_other)
    gm, count, _, _ = _bound(torch.float32)
    assert count == 0 and torch.ops.nxdi_kernels.rope.default not in targets(gm)


def test_without_the_kernels_nothing_is_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: False)
    _, count, (qk, _), (want_qk, _) = _bound(torch.bfloat16)
    assert count == 0 and torch.equal(qk, want_qk)
