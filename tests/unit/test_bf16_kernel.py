"""nxdi's bf16 decode linear kernel and the CPU backend's rewrite to it.

- The kernel equals F.linear computed in float64, up to the bf16 rounding of its output, for 1-4
  rows (1-16 on CPUs with AMX, where 2-16 rows run on the tiles), on this CPU's path and on the path
  of CPUs without AVX512-BF16 (bf16 widened to fp32, `bf16_linear_widened`), widths that are and are not
  multiples of its 32-wide step, output counts that are not multiples of its row blocks, with and
  without a bias; it refuses what it cannot take, and takes 16 rows exactly where the CPU has AMX.
- The rewrite sends bf16 decode linears (<= `kernels.bf16_max_rows(K)` rows) to the kernel on the
  weight as stored, leaves larger ones to oneDNN's prepacked GEMM (packing only weights those read)
  on CPUs with AVX512-BF16 and, on CPUs without it, sends them to the kernel in chunks of 4 rows or
  (from `WIDEN_MIN_ROWS`) to the fp32 GEMM on the weight widened block by block, packing nothing;
  it leaves fp32 alone and does nothing where the kernel cannot run; results stay equal to the pure
  graph's, and the chunked and widened linears equal float64 up to the bf16 rounding of the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx

from nxdi.effects.backends import cpu_passes, kernels
from nxdi.effects.backends.base import WeightSet

needs_kernel = pytest.mark.skipif(
    not kernels.bf16_supported(),
    reason=f"nxdi's bf16 kernel cannot run here: {kernels.why_not()}",
)


def _case(m: int, k: int, n: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=g).bfloat16(),
        torch.randn(n, k, generator=g).bfloat16(),
        torch.randn(n, generator=g).bfloat16(),
    )


def _within_output_rounding(got: Tensor, want: Tensor) -> None:
    """`want` (float64) rounded to bf16 is at most half a bf16 step away; fp32 summation adds a
    little more, so allow one step (2**-8 relative) plus a floor for outputs near zero."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    floor = 1e-5 * want.abs().max().item()
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + floor).all()


def _op(path: str, k: int = 32) -> tuple[Any, int]:
    """The kernel op of a path ("here": this CPU's; "widened": that of CPUs without AVX512-BF16)
    and its row limit at width `k`."""
    if path == "here":
        return torch.ops.nxdi_kernels.bf16_linear, kernels.bf16_max_rows(k)
    return torch.ops.nxdi_kernels.bf16_linear_widened, 4


@needs_kernel
@pytest.mark.parametrize("path", ["here", "widened"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("k", [32, 100, 2048])
@pytest.mark.parametrize("with_bias", [False, True])
# n: 37 rows: one group of blocks read 4 rows apart (32 rows at 1-2 rows of x, 16 at 3-4) and a
# tail of adjacent rows; with AMX two tiles of 16 and a tail of five. 301: split over two threads
# at an odd row, each part read in groups, then blocks of adjacent rows, then single rows.
@pytest.mark.parametrize("n", [37, 301])
def test_kernel_equals_linear_up_to_the_outputs_rounding(path: str, m: int, k: int, with_bias: bool, n: int) -> None:
    x, w, bias = _case(m, k, n)
    b = bias if with_bias else None
    op, limit = _op(path, k)
    if m > limit:  # 5 and 16 rows need AMX and a width the tiles take
        with pytest.raises(RuntimeError, match=f"1 to {limit} rows"):
            op(x, w, b)
        return
    got = op(x, w, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    _within_output_rounding(got, want)


def _has_amx() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.is_file() else []
    return "amx_bf16" in flags and "amx_tile" in flags


@needs_kernel
def test_sixteen_rows_exactly_where_the_cpu_has_amx() -> None:
    """A failed AMX check would silently fall back to 4 rows (slower batches): the row limit
    follows the CPU's flags, and widths the tiles cannot take stay at 4."""
    assert kernels.bf16_max_rows(2048) == (16 if _has_amx() else 4)
    assert kernels.bf16_max_rows(100) == 4


@needs_kernel
@pytest.mark.parametrize("path", ["here", "widened"])
@pytest.mark.parametrize("m", [1, 4])
def test_kernel_is_not_a_copy_of_another_row(path: str, m: int) -> None:
    """Every output depends on its own weight row: changing row 13 changes output 13 only
    (one row on vdpbf16ps or widened; four on the AMX tiles where the CPU has them)."""
    op, _ = _op(path)
    x, w, _ = _case(m, 256, 40)
    before = op(x, w)
    w[13] = -w[13]
    after = op(x, w)
    changed = (before != after).nonzero()[:, 1].unique().tolist()
    assert changed == [13]


@needs_kernel
@pytest.mark.parametrize(
    ("x", "w", "message"),
    [
        (torch.zeros(5, 100).bfloat16(), torch.zeros(8, 100).bfloat16(), "1 to 4 rows"),
        (torch.zeros(17, 64).bfloat16(), torch.zeros(8, 64).bfloat16(), "1 to (4|16) rows"),
        (torch.zeros(1, 64), torch.zeros(8, 64).bfloat16(), "must be bf16"),
        (torch.zeros(1, 64).bfloat16(), torch.zeros(64, 8).bfloat16().T, "contiguous"),
        (torch.zeros(1, 32).bfloat16(), torch.zeros(8, 64).bfloat16(), r"x \[M, K\] and w \[N, K\]"),
    ],
)
def test_kernel_refuses_what_it_cannot_take(x: Tensor, w: Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.nxdi_kernels.bf16_linear(x, w)


class _Mlp(torch.nn.Module):
    def forward(self, x: Tensor, up: Tensor, down: Tensor, bias: Tensor) -> Tensor:
        return F.linear(F.silu(F.linear(x, up, bias)), down)


def _rewrite(
    shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16
) -> tuple[fx.GraphModule, Tensor, Tensor, WeightSet]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, 64, generator=g).to(dtype)
    weights = [torch.randn(96, 64, generator=g).to(dtype), torch.randn(64, 96, generator=g).to(dtype)]
    weights.append(torch.randn(96, generator=g).to(dtype))
    gm = torch.export.export(_Mlp(), (x, *weights)).run_decompositions({}).module()
    want = gm(x, *weights)
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"][1:]
    ws = WeightSet(tensors=weights)
    cpu_passes.bf16_weight_linears(gm, nodes, ws)
    cpu_passes.prepack_linears(gm, nodes, ["up", "down", "bias"], ws, cpu_passes.packable_dtypes())
    gm.recompile()
    return gm, gm(x, *weights), want, ws


def _targets(gm: fx.GraphModule) -> set[object]:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@needs_kernel
@pytest.mark.parametrize("shape", [(1,), (3,), (1, 1), (3, 1), (-1,)])
def test_decode_rows_run_the_kernel_and_pack_nothing(shape: tuple[int, ...]) -> None:
    if shape == (-1,):  # the most rows the kernel takes here: 16 with AMX, else 4
        shape = (kernels.bf16_max_rows(64),)
    gm, got, want, ws = _rewrite(shape)
    kernel = torch.ops.nxdi_kernels.bf16_linear.default if len(shape) == 1 else cpu_passes.streamed_bf16_linear
    assert kernel in _targets(gm) and torch.ops.aten.linear.default not in _targets(gm)
    assert not ws.derived  # no oneDNN copy for weights only decode linears read
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


@needs_kernel
def test_larger_linears_keep_onednn_where_the_cpu_has_avx512_bf16_and_fp32_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels, "bf16_native", lambda: True)
    gm, got, want, ws = _rewrite((kernels.bf16_max_rows(64) + 1,))
    assert torch.ops.nxdi_kernels.bf16_linear.default not in _targets(gm)
    if torch.bfloat16 in cpu_passes.packable_dtypes():
        assert set(ws.derived) == {"onednn:up", "onednn:down"}
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    gm, _, _, _ = _rewrite((1,), torch.float32)
    assert torch.ops.nxdi_kernels.bf16_linear.default not in _targets(gm)


def test_without_the_kernel_nothing_is_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "bf16_supported", lambda: False)
    gm, got, want, _ = _rewrite((1,))
    assert torch.ops.nxdi_kernels.bf16_linear.default not in _targets(gm)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize(
    ("rows", "route"),
    [
        (5, cpu_passes.chunked_bf16_linear),
        (cpu_passes.WIDEN_MIN_ROWS - 1, cpu_passes.chunked_bf16_linear),
        (cpu_passes.WIDEN_MIN_ROWS, cpu_passes.widened_bf16_linear),
    ],
)
def test_without_avx512_bf16_larger_linears_run_chunked_or_widened_and_pack_nothing(
    monkeypatch: pytest.MonkeyPatch, rows: int, route: object
) -> None:
    monkeypatch.setattr(kernels, "bf16_native", lambda: False)
    gm, got, want, ws = _rewrite((rows,))
    assert route in _targets(gm) and torch.ops.aten.linear.default not in _targets(gm)
    assert not ws.derived  # no oneDNN copy: oneDNN's bf16 GEMM is slow on these CPUs
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("linear", [cpu_passes.chunked_bf16_linear, cpu_passes.widened_bf16_linear])
@pytest.mark.parametrize("shape", [(5,), (33,), (2, 40)])
@pytest.mark.parametrize(("k", "n"), [(100, 37), (64, 600)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_and_widened_linears_equal_linear_up_to_the_outputs_rounding(
    linear: Any, shape: tuple[int, ...], k: int, n: int, with_bias: bool
) -> None:
    # n = 600: more than two blocks of WIDEN_BLOCK_ROWS weight rows, the last one partial
    rows = 1
    for d in shape:
        rows *= d
    x, w, bias = _case(rows, k, n)
    b = bias if with_bias else None
    got = linear(x.view(*shape, k), w, b)
    assert got.shape == (*shape, n)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    _within_output_rounding(got.reshape(rows, n), want)
