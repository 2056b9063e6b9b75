"""nxdi's one-op bf16 RMSNorm kernel and the CPU backend's rewrite to it.

- The kernel equals `w * F.rms_norm(x)` (torch's two roundings) for one row, decode rows and
  prefill rows (split over threads), widths that are and are not multiples of its 16-wide step;
  it keeps a NaN a NaN and refuses what it cannot take.
- The rewrite turns `layers.rms_norm`'s traced form (`rms_norm` then `mul` by the weight, bf16)
  into the kernel and leaves fp32, a norm with other users and Gemma's offset form alone.
- `add_rms_norm` gives torch's bf16 sum and the kernel's norm of it, bit for bit; the rewrite folds
  each residual sum a fused norm reads into it (the sum still read by its other users), bf16 only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx

from nxdi.core.programs import layers
from nxdi.effects.backends import cpu_fusions, kernels
from tests.support.graph_rewrites import rewritten, targets

needs_kernel = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")


def _torchs(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * F.rms_norm(x, (x.shape[-1],), eps=eps)


def _one_step_apart(got: Tensor, want: Tensor) -> None:
    """Equal, but for fp32 summation order: an output may sit one bf16 step (2**-8 relative) away."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-8 + 1e-30).all()


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 2048), (4, 2048), (3, 1, 37), (130, 96), (2, 5)])
def test_kernel_equals_torchs_norm_and_weight_product(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(*shape, generator=g)).bfloat16()
    w = torch.randn(shape[-1], generator=g).bfloat16()
    got = torch.ops.nxdi_kernels.rms_norm(x, w, 1e-5)
    _one_step_apart(got, _torchs(x, w, 1e-5))
    assert (got == _torchs(x, w, 1e-5)).float().mean() > 0.99  # nearly all bit for bit


@needs_kernel
def test_kernel_uses_eps_and_keeps_nan() -> None:
    x = torch.full((1, 16), 1e-3).bfloat16()
    w = torch.ones(16).bfloat16()
    assert torch.ops.nxdi_kernels.rms_norm(x, w, 1.0).float().max() < 0.01  # eps dominates the tiny mean
    assert torch.ops.nxdi_kernels.rms_norm(x, w, 0.0).float().min() > 0.99
    x[0, 3] = float("nan")
    assert torch.ops.nxdi_kernels.rms_norm(x, w, 1e-5).isnan().all()  # the row's mean is NaN


@needs_kernel
@pytest.mark.parametrize(
    ("x", "w", "message"),
    [
        (torch.zeros(1, 8), torch.zeros(8).bfloat16(), "must be bf16"),
        (torch.zeros(1, 8).bfloat16(), torch.zeros(9).bfloat16(), r"x \[..., N\] and w \[N\]"),
    ],
)
def test_kernel_refuses_what_it_cannot_take(x: Tensor, w: Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.nxdi_kernels.rms_norm(x, w, 1e-5)


class _Norms(torch.nn.Module):
    def forward(self, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        h = layers.rms_norm(x, w, 1e-6)
        return h, layers.rms_norm(h + x, w, 1e-6, offset=True)  # Gemma's form: left alone


def _bound(dtype: torch.dtype) -> tuple[fx.GraphModule, int, tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 1, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    return rewritten(_Norms(), (x, w), cpu_fusions.fused_rms_norms)


@needs_kernel
def test_the_rewrite_fuses_llamas_norm_in_bf16_only() -> None:
    gm, count, (h, gemma), (want_h, want_gemma) = _bound(torch.bfloat16)
    assert count == 1 and torch.ops.nxdi_kernels.rms_norm.default in targets(gm)
    assert torch.ops.aten.rms_norm.default in targets(gm)  # the offset form stays torch's
    _one_step_apart(h, want_h)
    torch.testing.assert_close(gemma, want_gemma, rtol=2**-7, atol=1e-2)
    gm, count, _, _ = _bound(torch.float32)
    assert count == 0 and torch.ops.nxdi_kernels.rms_norm.default not in targets(gm)


def test_without_the_kernels_nothing_is_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: False)
    _, count, (h, _), (want_h, _) = _bound(torch.bfloat16)
    assert count == 0 and torch.equal(h, want_h)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 2048), (4, 2048), (3, 1, 37), (2, 5)])
def test_add_rms_norm_gives_torchs_sum_and_the_norms_bits(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    a, b = ((3 * torch.randn(*shape, generator=g)).bfloat16() for _ in range(2))
    w = torch.randn(shape[-1], generator=g).bfloat16()
    a[0, ..., 1] = float("nan")
    total, normed = torch.ops.nxdi_kernels.add_rms_norm(a, b, w, 1e-5)
    torch.testing.assert_close(total, a + b, rtol=0, atol=0, equal_nan=True)
    want = torch.ops.nxdi_kernels.rms_norm(a + b, w, 1e-5)
    torch.testing.assert_close(normed, want, rtol=0, atol=0, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        (torch.zeros(1, 8), torch.zeros(1, 8).bfloat16(), "must be bf16"),
        (torch.zeros(1, 8).bfloat16(), torch.zeros(2, 8).bfloat16(), "one shape"),
        (torch.zeros(1, 9).bfloat16(), torch.zeros(1, 9).bfloat16(), r"w \[N\]"),
    ],
)
def test_add_rms_norm_refuses_what_it_cannot_take(a: Tensor, b: Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.nxdi_kernels.add_rms_norm(a, b, torch.zeros(8).bfloat16(), 1e-5)


class _Residuals(torch.nn.Module):
    """The decoder's form: each residual sum normed, then read again by the next sum."""

    def forward(self, x: Tensor, w: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = x + y
        n = layers.rms_norm(h, w, 1e-6)
        h2 = h + n * 2
        return h2, layers.rms_norm(h2, w, 1e-6), layers.rms_norm(x * 3, w, 1e-6)  # the last: no sum


def _residuals(dtype: torch.dtype) -> tuple[fx.GraphModule, int, tuple[Tensor, ...], tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(4)
    x, w, y = (torch.randn(*shape, generator=g).to(dtype) for shape in ((2, 64), (64,), (2, 64)))

    def both(gm: fx.GraphModule) -> int:
        cpu_fusions.fused_rms_norms(gm)
        return cpu_fusions.fused_residual_norms(gm)

    return rewritten(_Residuals(), (x, w, y), both)


@needs_kernel
def test_the_rewrite_folds_each_residual_sum_into_its_norm_with_the_same_bits() -> None:
    gm, count, got, want = _residuals(torch.bfloat16)
    assert count == 2 and targets(gm).count(torch.ops.nxdi_kernels.add_rms_norm.default) == 2
    assert targets(gm).count(torch.ops.nxdi_kernels.rms_norm.default) == 1  # x * 3 has no sum
    assert torch.ops.aten.add.Tensor not in targets(gm)
    for g_, w_ in zip(got, want, strict=True):
        _one_step_apart(g_, w_)
    gm, count, _, _ = _residuals(torch.float32)
    assert count == 0 and torch.ops.nxdi_kernels.add_rms_norm.default not in targets(gm)
