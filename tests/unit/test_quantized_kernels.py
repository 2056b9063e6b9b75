"""nxdi's quantized linear kernels (int8 and float8 weights) and the CPU backend's rewrite.

- The kernels equal dequantize-then-multiply (fp32 exactly up to summation order; bf16 up to the
  output's rounding) for 1-4 rows, widths that are and are not multiples of their vector step,
  with and without a bias; for float8_e4m3fn and float8_e5m2 every one of the 256 codes
  (subnormals, NaN, e5m2's inf) reads as torch's cast reads it, flush-denormal mode or not.
- Blockwise scales (a grid of blocks whose widths are whole multiples of a kernel's chunk) run the
  same kernels, each chunk times its block's scale; narrower blocks stay on the pure graph.
- The rewrite sends a decode linear (<= 4 rows) to nxdi's kernel, 5-8 rows to torch's (row-scaled
  int8, bf16 x) or to nxdi's on chunks of 4 rows (the rest), and leaves prefill-sized linears
  dequantizing, by nxdi's one-pass `weight_dequantize` (the pure dequantize's bits, then the same
  GEMM: equal results; on CPUs without AVX512-BF16 a bf16 weight then takes the bf16 routes,
  chunked kernel or widened fp32 GEMM, within bf16 rounding); without the kernels (an unsupported
  CPU) it falls back to torch's, and the results stay equal to the pure graph's."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, fx

from nxdi.core.programs.linear import QuantizedWeight, dequantize, linear
from nxdi.effects.backends import cpu, cpu_passes, kernels
from nxdi.effects.backends.base import WeightSet

needs_kernel = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _case(
    m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0, values: torch.dtype = torch.int8
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    if values == torch.int8:
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    else:  # spread over the format's range, subnormals included
        w = (torch.randn(n, k, generator=g) * 10 ** torch.randint(-3, 3, (n, 1), generator=g)).to(values)
    return x, w, torch.rand(n, generator=g) / 100, torch.randn(n, generator=g)


@needs_kernel
@pytest.mark.parametrize("values", [torch.int8, *FLOAT8])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1, 64, 100, 2048])
@pytest.mark.parametrize("with_bias", [False, True])
# n: 37 rows: one group of rows read 4 apart, then blocks of adjacent rows, then single rows; 165:
# split over two threads at an odd row, each part read in groups from where it starts.
@pytest.mark.parametrize("n", [37, 165])
def test_kernel_equals_dequantize_then_multiply(values: torch.dtype, m: int, k: int, with_bias: bool, n: int) -> None:
    x, w, scale, bias = _case(m, k, n, torch.float32, values=values)
    b = bias if with_bias else None
    got = cpu_passes._quantized_kernel(values)(x, w, scale, b)
    want = x.double() @ (w.double() * scale.double()[:, None]).T + (0 if b is None else b.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("values", FLOAT8)
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_every_float8_code_reads_as_torchs_cast(values: torch.dtype, flush_denormal: bool) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(values).view(8, 32)
    want = codes.float()
    try:
        torch.set_flush_denormal(flush_denormal)  # the conversion ignores it: subnormals stay values
        dequantized = torch.ops.nxdi_kernels.weight_dequantize(codes, torch.ones(8), torch.float32)
        # One-hot rows of x pick each code out through the linear kernel too.
        picked = torch.ops.nxdi_kernels.fp8_linear(torch.eye(32)[:4], codes, torch.ones(8), None)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(dequantized.isnan(), want.isnan()) and want.isnan().any()
    assert torch.equal(dequantized.nan_to_num(), want.nan_to_num())
    finite = want.isfinite().all(1)  # in other rows 0 x NaN (or inf) makes every output NaN
    assert torch.equal(picked.T[finite], want[finite, :4]) and picked.T[~finite].isnan().all()
    assert want[0, 1] != 0 and dequantized[0, 1] == want[0, 1]  # the smallest subnormal


@needs_kernel
def test_kernel_bf16_rounds_only_the_output() -> None:
    x, w, scale, _ = _case(2, 2048, 300, torch.bfloat16)
    got = torch.ops.nxdi_kernels.int8_linear(x, w, scale, None)
    want = (x.double() @ (w.double() * scale.double()[:, None]).T).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want.double()).abs() <= want.double().abs() * 2**-8 + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("values", [torch.int8, *FLOAT8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [7, 100, 2048])
def test_16_bit_x_is_widened_exactly_and_any_scale_or_bias_dtype_is_read(
    values: torch.dtype, dtype: torch.dtype, k: int
) -> None:
    # The kernel widens a 16-bit x itself (no torch conversion): the same bits as an fp32 x of the
    # same values, rounded once at the output; a strided x, a float64 scale and a 16-bit bias too.
    x, w, scale, bias = _case(3, 2 * k, 70, dtype, values=values)
    x, w = x[:, ::2], w[:, ::2].contiguous()
    b = bias.to(dtype)
    got = cpu_passes._quantized_kernel(values)(x, w, scale.double(), b)
    want = cpu_passes._quantized_kernel(values)(x.float(), w, scale, b.float()).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)


class _Linear(torch.nn.Module):
    def forward(self, x: Tensor, values: Tensor, scale: Tensor) -> Tensor:
        return linear(x, QuantizedWeight(values=values, scale=scale))


def _graph(
    rows: int, dtype: torch.dtype, values: torch.dtype, block: tuple[int, int] | None = None
) -> tuple[fx.GraphModule, list[Tensor], Tensor]:
    x, w, scale, _ = _case(rows, 128, 48, dtype, values=values)
    if block is not None:  # blockwise: one scale per block of block[0] rows x block[1] columns
        scale = torch.rand(48 // block[0], 128 // block[1], generator=torch.Generator().manual_seed(1)) / 100
    ep = torch.export.export(_Linear(), (x, w, scale)).run_decompositions({})
    gm = cpu._plain_module(ep)  # the graph the backend rewrites
    gm.recompile()  # its flat calling convention from the first call
    return gm, [w, scale], x


def _close(got: Tensor, want: Tensor, rel: float) -> None:
    """Within `rel` of the largest output: the pure graph rounds the dequantized weight to bf16 and
    the kernels do not, so near-zero outputs may differ by that much, not by a relative error."""
    assert got.dtype == want.dtype
    assert (got.double() - want.double()).abs().max() <= rel * want.double().abs().max()


def _rewrite(
    rows: int, dtype: torch.dtype, values: torch.dtype = torch.int8, block: tuple[int, int] | None = None
) -> tuple[set[object], Tensor, Tensor]:
    gm, weights, x = _graph(rows, dtype, values, block)
    (want,) = gm(x, *weights)
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cpu_passes.quantized_weight_linears(gm, nodes[1:3], ["w", "w.scale"], WeightSet(tensors=weights))
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    (got,) = gm(x, *weights)
    return targets, got, want


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_rows_run_nxdis_kernel(dtype: torch.dtype) -> None:
    targets, got, want = _rewrite(1, dtype)
    assert torch.ops.nxdi_kernels.int8_linear.default in targets and torch.ops.aten.linear.default not in targets
    _close(got, want, 2**-7 if dtype == torch.bfloat16 else 1e-5)


def test_rows_beyond_the_kernel_take_torchs_or_stay_dequantized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "bf16_native", lambda: True)  # a CPU with AVX512-BF16: oneDNN's GEMM
    targets, got, want = _rewrite(cpu_passes.KERNEL_MAX_ROWS + 1, torch.bfloat16)
    assert cpu_passes.int8_linear in targets
    _close(got, want, 2**-7)
    targets, _, _ = _rewrite(16, torch.bfloat16)
    assert torch.ops.aten.linear.default in targets  # prefill-sized: dequantize, then oneDNN


@needs_kernel
@pytest.mark.parametrize("values", FLOAT8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float8_decode_rows_run_nxdis_kernel(values: torch.dtype, dtype: torch.dtype) -> None:
    for rows in (1, cpu_passes.KERNEL_MAX_ROWS):
        targets, got, want = _rewrite(rows, dtype, values)
        assert torch.ops.nxdi_kernels.fp8_linear.default in targets and torch.ops.aten.linear.default not in targets
        _close(got, want, 2**-7 if dtype == torch.bfloat16 else 1e-5)
    # torch's kernel is int8-only: up to INT8_MAX_ROWS rows run nxdi's on chunks of rows, then dequantize.
    for rows in (cpu_passes.KERNEL_MAX_ROWS + 1, cpu_passes.INT8_MAX_ROWS):
        targets, got, want = _rewrite(rows, dtype, values)
        assert cpu_passes.chunked_quantized_linear in targets
        _close(got, want, 2**-7 if dtype == torch.bfloat16 else 1e-5)
    targets, _, _ = _rewrite(cpu_passes.INT8_MAX_ROWS + 1, dtype, values)
    assert torch.ops.nxdi_kernels.weight_dequantize.default in targets


@needs_kernel
@pytest.mark.parametrize("values", [torch.int8, *FLOAT8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prefill_rows_dequantize_in_one_pass_to_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, values: torch.dtype, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(kernels, "bf16_native", lambda: True)  # the GEMM stays torch's
    targets, got, want = _rewrite(16, dtype, values)
    assert torch.ops.nxdi_kernels.weight_dequantize.default in targets and torch.ops.aten.linear.default in targets
    assert torch.ops.aten.mul.Tensor not in targets  # torch's three-op dequantize is gone
    assert torch.equal(got, want)  # the same weight bits into the same GEMM


@needs_kernel
@pytest.mark.parametrize("values", [torch.int8, *FLOAT8])
@pytest.mark.parametrize(("rows", "route"), [(16, "chunked_bf16_linear"), (40, "widened_bf16_linear")])
def test_without_avx512_bf16_a_dequantized_bf16_prefill_takes_the_bf16_routes(
    monkeypatch: pytest.MonkeyPatch, values: torch.dtype, rows: int, route: str
) -> None:
    """oneDNN's bf16 GEMM is slow on those CPUs: the one-pass bf16 weight goes where
    `bf16_weight_linears` sends a bf16 weight of that many rows."""
    monkeypatch.setattr(kernels, "bf16_native", lambda: False)
    targets, got, want = _rewrite(rows, torch.bfloat16, values)
    assert torch.ops.nxdi_kernels.weight_dequantize.default in targets and getattr(cpu_passes, route) in targets
    assert torch.ops.aten.linear.default not in targets and torch.ops.aten.mul.Tensor not in targets
    _close(got, want, 2**-7)


@needs_kernel
@pytest.mark.parametrize("values", [torch.int8, *FLOAT8])
def test_blockwise_weights_run_the_kernels_when_blocks_fit_their_chunks(
    monkeypatch: pytest.MonkeyPatch, values: torch.dtype
) -> None:
    monkeypatch.setattr(kernels, "bf16_native", lambda: True)  # prefill's GEMM stays torch's
    for block in [(1, 32), (8, 64), (16, 128)]:
        for rows in (1, 3):
            targets, got, want = _rewrite(rows, torch.float32, values, block)
            assert cpu_passes._quantized_kernel(values).default in targets, block
            assert torch.ops.aten.mul.Tensor not in targets
            _close(got, want, 1e-5)
        targets, got, want = _rewrite(7, torch.bfloat16, values, block)  # two chunks: 4 rows and 3
        assert cpu_passes.chunked_quantized_linear in targets
        _close(got, want, 2**-7)
        targets, got, want = _rewrite(16, torch.bfloat16, values, block)  # prefill: the same bits
        assert torch.ops.nxdi_kernels.weight_dequantize.default in targets and torch.equal(got, want)
    # Blocks narrower than a kernel's chunk stay dequantized by torch's ops (the pure graph).
    targets, got, want = _rewrite(1, torch.float32, values, (8, 16))
    assert torch.ops.aten.mul.Tensor in targets and torch.ops.aten.linear.default in targets
    assert torch.equal(got, want)


@needs_kernel
def test_kernels_refuse_blocks_that_straddle_their_chunks() -> None:
    values = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"scale must be \[N\], or \[N / bn, K / bk\] with bk a multiple of 32"):
        torch.ops.nxdi_kernels.fp8_linear(torch.randn(1, 128), values, torch.rand(8, 8), None)
    with pytest.raises(RuntimeError, match="scale must be"):
        torch.ops.nxdi_kernels.weight_dequantize(values, torch.rand(64, 3), torch.float32)


@needs_kernel
@pytest.mark.parametrize("values", [torch.int8, *FLOAT8])
@pytest.mark.parametrize("block", [(1, 32), (8, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_blockwise_kernel_equals_dequantize_then_multiply(values: torch.dtype, block: tuple[int, int], m: int) -> None:
    x, w, _, bias = _case(m, 256, 48, torch.float32, values=values)
    scale = torch.rand(48 // block[0], 256 // block[1]) / 100
    weight = dequantize(QuantizedWeight(values=w, scale=scale), torch.float64)
    want = x.double() @ weight.T + bias.double()
    got = cpu_passes._quantized_kernel(values)(x, w, scale, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    dequantized = torch.ops.nxdi_kernels.weight_dequantize(w, scale, torch.bfloat16)
    assert torch.equal(dequantized, dequantize(QuantizedWeight(values=w, scale=scale), torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("values_dtype", [torch.int8, *FLOAT8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 15, 16, 33, 2048])
def test_dequantize_kernel_gives_the_pure_dequantizes_bits(
    values_dtype: torch.dtype, dtype: torch.dtype, scale_dtype: torch.dtype, k: int
) -> None:
    g = torch.Generator().manual_seed(k)
    values = torch.randint(0, 256, (37, k), generator=g, dtype=torch.uint8).view(torch.int8).view(values_dtype)
    # Scales across float16's range (its largest products overflow to inf, as torch's cast does),
    # a zero, and a NaN, which stays a NaN.
    scale = (torch.randn(37, generator=g) * 10 ** torch.randint(-6, 4, (37,), generator=g)).to(scale_dtype)
    scale[3], scale[5] = 0.0, float("nan")
    want = (values.float() * scale.float()[:, None]).to(dtype)
    got = torch.ops.nxdi_kernels.weight_dequantize(values, scale, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and want[5].isnan().all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_without_the_kernel_decode_falls_back_to_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: False)
    targets, got, want = _rewrite(1, torch.bfloat16)
    assert cpu_passes.int8_linear in targets and cpu_passes.streamed_quantized_linear not in targets
    _close(got, want, 2**-7)
    targets, _, _ = _rewrite(1, torch.float32)  # torch's kernel is bf16-only: fp32 stays dequantized
    assert torch.ops.aten.linear.default in targets


def test_an_unusable_library_is_reported_once_not_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_loaded", None)  # both restored after the test
    monkeypatch.setattr(kernels, "_why_not", None)
    monkeypatch.setattr(kernels, "_try_load", lambda: (False, "no compiler"))
    with pytest.warns(UserWarning, match="nxdi's CPU kernels are not used: no compiler; decode linears use torch's"):
        assert kernels.load() is False
    assert kernels.why_not() == "no compiler"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.load() is False  # cached: no second warning
