"""nxdi's fused SwiGLU over int8 and float8 weights and the CPU backend's rewrite to it.

- `int8_swiglu` / `fp8_swiglu` give `silu(linear(x, gate)) * linear(x, up)` over nxdi's quantized
  decode linears bit for bit: 1-4 rows, widths that are and are not multiples of the kernels'
  steps, row and blockwise scales; torch's silu on every finite bf16 value; a NaN kept.
- The rewrite turns that form (after `quantized_weight_linears`) into one call in bf16 only, and
  leaves a gate read elsewhere, a bias or fp32 alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from nxdi.core.programs.linear import QuantizedWeight, linear
from nxdi.effects.backends import cpu, cpu_fusions, cpu_passes, kernels
from nxdi.effects.backends.base import WeightSet

needs_kernel = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")
VALUES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _weights(n: int, k: int, values: torch.dtype, g: torch.Generator) -> Tensor:
    if values == torch.int8:
        return torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return (torch.randn(n, k, generator=g) * 4).to(values)


def _unfused(x: Tensor, wg: Tensor, sg: Tensor, wu: Tensor, su: Tensor) -> Tensor:
    kernel = cpu_passes._quantized_kernel(wg.dtype)
    return F.silu(kernel(x, wg, sg, None)) * kernel(x, wu, su, None)


def _fused(x: Tensor, wg: Tensor, sg: Tensor, wu: Tensor, su: Tensor) -> Tensor:
    op = torch.ops.nxdi_kernels.int8_swiglu if wg.dtype == torch.int8 else torch.ops.nxdi_kernels.fp8_swiglu
    return op(x, wg, sg, wu, su)


def _same_bits(got: Tensor, want: Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
# k 100: a masked last chunk; n 165: split over two threads at an odd row.
@pytest.mark.parametrize(("k", "n"), [(64, 37), (100, 165), (2048, 96)])
def test_kernel_gives_the_unfused_ops_bits(values: torch.dtype, m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * k + n)
    x = (2 * torch.randn(m, k, generator=g)).bfloat16()
    wg, wu = _weights(n, k, values, g), _weights(n, k, values, g)
    sg, su = torch.rand(n, generator=g) / 50, torch.rand(n, generator=g) / 50
    x[0, 0] = float("nan") if m == 4 else x[0, 0]  # a NaN row stays NaN
    _same_bits(_fused(x, wg, sg, wu, su), _unfused(x, wg, sg, wu, su))


@needs_kernel
@pytest.mark.parametrize("values", [torch.int8, torch.float8_e4m3fn])
def test_blockwise_scales_give_the_unfused_ops_bits(values: torch.dtype) -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 256, generator=g).bfloat16()
    wg, wu = _weights(64, 256, values, g), _weights(64, 256, values, g)
    sg, su = torch.rand(4, 2, generator=g) / 50, torch.rand(8, 4, generator=g) / 50  # two block grids
    _same_bits(_fused(x, wg, sg, wu, su), _unfused(x, wg, sg, wu, su))


@needs_kernel
def test_silu_is_torchs_on_every_finite_bf16_value() -> None:
    """An identity gate and up pass a finite x through exactly, so the output is bf16(silu(x)) * x,
    computed by torch the same way: all 65280 finite bf16 bit patterns, subnormals included. (A NaN
    or infinity in x reaches every output of a linear; the NaN row of the test above covers it.)"""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every[every.isfinite()]
    assert finite.numel() == 65280
    n = 4096
    eye, ones = torch.eye(n, dtype=torch.int8), torch.ones(n)
    for start in range(0, finite.numel(), n):
        x = torch.zeros(1, n, dtype=torch.bfloat16)
        part = finite[start : start + n]
        x[0, : part.numel()] = part
        _same_bits(_fused(x, eye, ones, eye, ones), F.silu(x) * x)


@needs_kernel
@pytest.mark.parametrize(
    ("x", "wu", "su", "message"),
    [
        (torch.zeros(1, 16), torch.zeros(8, 16, dtype=torch.int8), torch.ones(8), "x must be bf16"),
        (torch.zeros(5, 16).bfloat16(), torch.zeros(8, 16, dtype=torch.int8), torch.ones(8), "1 to 4 rows"),
        (torch.zeros(1, 16).bfloat16(), torch.zeros(9, 16, dtype=torch.int8), torch.ones(9), r"\[N, K\]"),
        (torch.zeros(1, 16).bfloat16(), torch.zeros(8, 16).to(torch.float8_e5m2), torch.ones(8), "one dtype"),
        (torch.zeros(1, 16).bfloat16(), torch.zeros(8, 16, dtype=torch.int8), torch.ones(7), "scale must be"),
    ],
)
def test_kernel_refuses_what_it_cannot_take(x: Tensor, wu: Tensor, su: Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.nxdi_kernels.int8_swiglu(x, torch.zeros(8, 16, dtype=torch.int8), torch.ones(8), wu, su)


class _Mlp(torch.nn.Module):
    """Llama's MLP over quantized weights; `other`: the gate also read elsewhere (left alone)."""

    def __init__(self, other: bool = False) -> None:
        super().__init__()
        self.other = other

    def forward(self, x: Tensor, wg: Tensor, sg: Tensor, wu: Tensor, su: Tensor) -> Tensor:
        gate = linear(x, QuantizedWeight(values=wg, scale=sg))
        y = F.silu(gate) * linear(x, QuantizedWeight(values=wu, scale=su))
        return y + gate if self.other else y


def _rewrite(dtype: torch.dtype, other: bool = False) -> tuple[int, list[object], Tensor, Tensor]:
    """(the rewrite's count, the graph's calls after it, its output, the output with only the linears
    rewritten) for the MLP over int8 weights and x of `dtype`."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 128, generator=g).to(dtype)
    weights = [_weights(48, 128, torch.int8, g), torch.rand(48, generator=g) / 50]
    weights += [_weights(48, 128, torch.int8, g), torch.rand(48, generator=g) / 50]
    gm = cpu._plain_module(torch.export.export(_Mlp(other), (x, *weights)).run_decompositions({}))
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"][1:]
    names = ["gate", "gate.scale", "up", "up.scale"]
    cpu_passes.quantized_weight_linears(gm, nodes, names, WeightSet(tensors=weights))
    gm.recompile()
    (want,) = gm(x, *weights)
    count = cpu_fusions.fused_swiglus(gm)
    gm.recompile()
    (got,) = gm(x, *weights)
    return count, [n.target for n in gm.graph.nodes if n.op == "call_function"], got, want


@needs_kernel
def test_the_rewrite_fuses_the_mlp_in_bf16_with_the_same_bits() -> None:
    count, calls, got, want = _rewrite(torch.bfloat16)
    assert count == 1 and calls.count(torch.ops.nxdi_kernels.int8_swiglu.default) == 1
    assert not {torch.ops.nxdi_kernels.int8_linear.default, torch.ops.aten.silu.default} & set(calls)
    _same_bits(got, want)


@needs_kernel
@pytest.mark.parametrize(("dtype", "other"), [(torch.float32, False), (torch.bfloat16, True)])
def test_the_rewrite_leaves_fp32_and_a_gate_read_elsewhere_alone(dtype: torch.dtype, other: bool) -> None:
    count, calls, got, want = _rewrite(dtype, other)
    assert count == 0 and calls.count(torch.ops.nxdi_kernels.int8_linear.default) == 2
    assert torch.equal(got, want)
