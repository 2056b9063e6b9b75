"""nxdi's bf16 decode attention kernel and the CPU backend's rewrite to it.

- The kernel computes torch's `scaled_dot_product_attention(q, k, v, mask)` for bf16 decode rows:
  as close to float64 attention as torch's own (the same roundings, other summation order and exp
  bits), for one and several sequences, head dims 64 and 128, slot counts off its 16-wide step, a
  mask broadcast over rows, heads or batch, strided q. A row that sees nothing gives zeros (as
  torch); slots the mask hides are not read; it refuses what it cannot take.
- The rewrite takes bf16 attention over at most `DECODE_ATTENTION_MAX_ROWS` query rows with a
  bool mask and torch's other defaults, and leaves prefill rows, fp32, causal or scaled calls alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx

from nxdi.effects.backends import cpu_fusions, kernels
from tests.support.graph_rewrites import rewritten, targets

needs_kernel = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")


def _case(b: int, h: int, rows: int, t: int, d: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v and a mask whose sequence i sees its first t - 3i - 2 slots (rows differ by one)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).bfloat16() for n in (rows, t, t))
    seen = torch.arange(t) < (t - 2 - 3 * torch.arange(b))[:, None, None, None] + torch.arange(rows)[:, None] % 2
    return q, k, v, seen  # [B, 1, L, T]


def _as_close_as_torch(got: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> None:
    """got is about as close to float64 attention as torch's bf16 result: both round p and the output
    to bf16, so an output near zero can be off by the rounding of the terms it sums, in either."""
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask)
    torchs = F.scaled_dot_product_attention(q, k, v, mask)
    assert got.dtype == torch.bfloat16 and got.shape == torchs.shape
    err, torch_err = (got.double() - exact).abs(), (torchs.double() - exact).abs()
    assert err.mean() <= 1.25 * torch_err.mean() + 1e-6
    assert err.max() <= 1.5 * torch_err.max() + 1e-4


@needs_kernel
@pytest.mark.parametrize(
    ("b", "h", "rows", "t", "d"),
    [
        (1, 4, 8, 144, 64),
        (4, 4, 8, 256, 64),
        (1, 2, 8, 2048, 64),
        (2, 8, 4, 37, 128),
        (3, 2, 1, 5, 64),
        (1, 2, 64, 96, 64),
        (2, 2, 3, 50, 80),  # a head dim without code of its own
    ],
)
def test_kernel_is_as_close_to_exact_attention_as_torchs(b: int, h: int, rows: int, t: int, d: int) -> None:
    q, k, v, mask = _case(b, h, rows, t, d, seed=rows + t)
    _as_close_as_torch(torch.ops.nxdi_kernels.decode_attention(q, k, v, mask), q, k, v, mask)


@needs_kernel
@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 40), (1, 3, 4, 40), (1, 1, 1, 1), (2, 3, 4, 1)])
def test_kernel_broadcasts_the_mask_and_reads_q_where_it_lies(mask_shape: tuple[int, ...]) -> None:
    q, k, v, _ = _case(2, 3, 4, 40, 64, seed=7)
    mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(1)) < 0.7
    mask[..., :1] = True
    strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)  # rows of q apart, as the decoder's folded q
    _as_close_as_torch(torch.ops.nxdi_kernels.decode_attention(strided_q, k, v, mask), q, k, v, mask)


@needs_kernel
def test_a_row_that_sees_nothing_gives_zeros_and_hidden_slots_are_not_read() -> None:
    q, k, v, mask = _case(1, 2, 3, 20, 64, seed=3)
    mask[0, 0, 1] = False
    mask[..., 18:] = False  # slots 18 and 19: hidden from every row
    got = torch.ops.nxdi_kernels.decode_attention(q, k, v, mask)
    assert torch.equal(got[0, :, 1], torch.zeros(2, 64, dtype=torch.bfloat16))
    assert torch.equal(got[0, :, 1], F.scaled_dot_product_attention(q, k, v, mask)[0, :, 1])
    k[..., 18:, :], v[..., 18:, :] = float("nan"), float("inf")
    assert torch.equal(torch.ops.nxdi_kernels.decode_attention(q, k, v, mask), got)


@needs_kernel
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(1, 2, 3, 64)}, "must be bf16"),
        ({"mask": torch.zeros(1, 1, 3, 20).bfloat16()}, "mask must be bool"),
        ({"q": torch.zeros(1, 2, 3, 40).bfloat16()}, "k and v must be"),
        (
            {
                "q": torch.zeros(1, 2, 3, 40).bfloat16(),
                "k": torch.zeros(1, 2, 20, 40).bfloat16(),
                "v": torch.zeros(1, 2, 20, 40).bfloat16(),
            },
            "multiple of 16",
        ),
        ({"mask": torch.zeros(1, 1, 2, 20, dtype=torch.bool)}, "broadcast to"),
        ({"v": torch.zeros(1, 2, 21, 64).bfloat16()}, "k and v must be"),
    ],
)
def test_kernel_refuses_what_it_cannot_take(change: dict[str, Tensor], message: str) -> None:
    q, k, v, mask = _case(1, 2, 3, 20, 64)
    given = {"q": q, "k": k, "v": v, "mask": mask} | change
    with pytest.raises(RuntimeError, match=message):
        torch.ops.nxdi_kernels.decode_attention(given["q"], given["k"], given["v"], given["mask"])


class _Attentions(torch.nn.Module):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        plain = F.scaled_dot_product_attention(q, k, v, mask)
        scaled = F.scaled_dot_product_attention(q, k, v, mask, scale=0.5)  # left alone
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no mask: left alone
        return plain, scaled, causal


def _bound(dtype: torch.dtype, rows: int) -> tuple[fx.GraphModule, int, tuple[Tensor, ...], tuple[Tensor, ...]]:
    q, k, v, mask = _case(2, 2, rows, 24, 64, seed=5)
    return rewritten(_Attentions(), (q.to(dtype), k.to(dtype), v.to(dtype), mask), cpu_fusions.decode_attentions)


@needs_kernel
def test_the_rewrite_takes_bf16_decode_rows_only() -> None:
    gm, count, got, want = _bound(torch.bfloat16, 8)
    assert count == 1 and targets(gm).count(torch.ops.nxdi_kernels.decode_attention.default) == 1
    assert targets(gm).count(torch.ops.aten.scaled_dot_product_attention.default) == 2
    q, k, v, mask = _case(2, 2, 8, 24, 64, seed=5)
    _as_close_as_torch(got[0], q, k, v, mask)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    for dtype, rows in ((torch.float32, 8), (torch.bfloat16, cpu_fusions.DECODE_ATTENTION_MAX_ROWS + 1)):
        gm, count, _, _ = _bound(dtype, rows)
        assert count == 0 and torch.ops.nxdi_kernels.decode_attention.default not in targets(gm)


def test_without_the_kernels_nothing_is_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: False)
    _, count, got, want = _bound(torch.bfloat16, 8)
    assert count == 0 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
