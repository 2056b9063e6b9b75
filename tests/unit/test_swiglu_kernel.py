"""nxdi's fused SwiGLU over bf16, int8 and float8 weights and the CPU backend's rewrite to it.

- `int8_swiglu` / `fp8_swiglu` give `silu(linear(x, gate)) * linear(x, up)` over nxdi's quantized
  decode linears bit for bit: 1-4 rows, widths that are and are not multiples of the kernels'
  steps, row and blockwise scales; torch's silu on every finite bf16 value; a NaN kept.
- `bf16_swiglu` (and its widened path) likewise over nxdi's bf16 decode linear.
- The rewrite turns that form (after `quantized_weight_linears` or `bf16_weight_linears`) into
  one call in bf16 only, and leaves a gate read elsewhere, a bias or fp32 alone.
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
@pytest.mark.parametrize("widened", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "n"), [(64, 37), (100, 165), (2048, 200)])
def test_bf16_kernel_gives_the_unfused_ops_bits(widened: bool, m: int, k: int, n: int) -> None:
    ops = torch.ops.nxdi_kernels
    fused, kernel = (
        (ops.bf16_swiglu_widened, ops.bf16_linear_widened) if widened else (ops.bf16_swiglu, ops.bf16_linear)
    )
    g = torch.Generator().manual_seed(m * k + n)
    x = (2 * torch.randn(m, k, generator=g)).bfloat16()
    wg, wu = (torch.randn(n, k, generator=g) / 8).bfloat16(), (torch.randn(n, k, generator=g) / 8).bfloat16()
    x[0, 0] = float("nan") if m == 4 else x[0, 0]
    _same_bits(fused(x, wg, wu), F.silu(kernel(x, wg, None)) * kernel(x, wu, None))


@needs_kernel
def test_bf16_kernel_gives_the_unfused_ops_bits_at_every_row_count_it_takes() -> None:
    """Up to `bf16_max_rows` (16 where the CPU has AMX: the tile path's linears, then the SwiGLU)."""
    g = torch.Generator().manual_seed(5)
    wg, wu = torch.randn(80, 64, generator=g).bfloat16(), torch.randn(80, 64, generator=g).bfloat16()
    for m in range(1, kernels.bf16_max_rows(64) + 1):
        x = torch.randn(m, 64, generator=g).bfloat16()
        linear_ = torch.ops.nxdi_kernels.bf16_linear
        _same_bits(torch.ops.nxdi_kernels.bf16_swiglu(x, wg, wu), F.silu(linear_(x, wg, None)) * linear_(x, wu, None))


@needs_kernel
@pytest.mark.parametrize(
    ("x", "wu", "message"),
    [
        (torch.zeros(1, 16), torch.zeros(8, 16).bfloat16(), "x and w must be bf16"),
        (torch.zeros(17, 16).bfloat16(), torch.zeros(8, 16).bfloat16(), "1 to (4|16) rows"),
        (torch.zeros(1, 16).bfloat16(), torch.zeros(9, 16).bfloat16(), "one shape"),
        (torch.zeros(1, 16).bfloat16(), torch.zeros(16, 8).bfloat16().T, "w must be contiguous"),
    ],
)
def test_bf16_kernel_refuses_what_it_cannot_take(x: Tensor, wu: Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.nxdi_kernels.bf16_swiglu(x, torch.zeros(8, 16).bfloat16(), wu)


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
    """Llama's MLP over quantized (weights and scales) or bf16 weights; `other`: the gate also read
    elsewhere (left alone)."""

    def __init__(self, other: bool = False) -> None:
        super().__init__()
        self.other = other

    def forward(self, x: Tensor, *weights: Tensor) -> Tensor:
        if len(weights) == 4:
            wg, sg, wu, su = weights
            gate, up = linear(x, QuantizedWeight(values=wg, scale=sg)), linear(x, QuantizedWeight(values=wu, scale=su))
        else:
            gate, up = linear(x, weights[0]), linear(x, weights[1])
        y = F.silu(gate) * up
        return y + gate if self.other else y


def _rewrite(
    dtype: torch.dtype, other: bool = False, values: torch.dtype = torch.int8
) -> tuple[int, list[object], Tensor, Tensor]:
    """(the rewrite's count, the graph's calls after it, its output, the output with only the linears
    rewritten) for the MLP over `values` weights (int8 or bf16) and x of `dtype`."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 128, generator=g).to(dtype)
    if values == torch.int8:
        weights = [_weights(48, 128, torch.int8, g), torch.rand(48, generator=g) / 50]
        weights += [_weights(48, 128, torch.int8, g), torch.rand(48, generator=g) / 50]
    else:
        weights = [torch.randn(48, 128, generator=g).to(values), torch.randn(48, 128, generator=g).to(values)]
    gm = cpu._plain_module(torch.export.export(_Mlp(other), (x, *weights)).run_decompositions({}))
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"][1:]
    if values == torch.int8:
        names = ["gate", "gate.scale", "up", "up.scale"]
        cpu_passes.quantized_weight_linears(gm, nodes, names, WeightSet(tensors=weights))
    else:
        cpu_passes.bf16_weight_linears(gm, nodes, WeightSet(tensors=weights))
    gm.recompile()
    (want,) = gm(x, *weights)
    count = cpu_fusions.fused_swiglus(gm)
    gm.recompile()
    (got,) = gm(x, *weights)
    return count, [n.target for n in gm.graph.nodes if n.op == "call_function"], got, want


@needs_kernel
@pytest.mark.parametrize(
    ("values", "op", "linear_op"),
    [
        (torch.int8, torch.ops.nxdi_kernels.int8_swiglu.default, torch.ops.nxdi_kernels.int8_linear.default),
        (torch.bfloat16, torch.ops.nxdi_kernels.bf16_swiglu.default, torch.ops.nxdi_kernels.bf16_linear.default),
    ],
)
def test_the_rewrite_fuses_the_mlp_in_bf16_with_the_same_bits(
    values: torch.dtype, op: object, linear_op: object
) -> None:
    count, calls, got, want = _rewrite(torch.bfloat16, values=values)
    assert count == 1 and calls.count(op) == 1
    assert not {linear_op, torch.ops.aten.silu.default} & set(calls)
    _same_bits(got, want)


@needs_kernel
@pytest.mark.parametrize(
    ("dtype", "other", "values"),
    [(torch.float32, False, torch.int8), (torch.bfloat16, True, torch.int8), (torch.bfloat16, True, torch.bfloat16)],
)
def test_the_rewrite_leaves_fp32_and_a_gate_read_elsewhere_alone(
    dtype: torch.dtype, other: bool, values: torch.dtype
) -> None:
    count, calls, got, want = _rewrite(dtype, other, values)
    linear_op = (
        torch.ops.nxdi_kernels.int8_linear.default
        if values == torch.int8
        else torch.ops.nxdi_kernels.bf16_linear.default
    )
    assert count == 0 and calls.count(linear_op) == 2
    assert torch.equal(got, want)
