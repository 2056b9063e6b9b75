"""Weight quantization schemes: symmetric int8 / fp8 values plus a float32 scale per group. Pure.

Theory of operation (NxD's `neuronx_distributed.quantization`, which NxDI's `quantized=True` uses):

- A weight is cut into groups; each group stores `scale = max|w| / divisor` and the values
  `q = w / scale`, clamped to the dtype's range (int8: rounded to nearest, ties to even; fp8: the
  cast rounds). `dequantize` is `q * scale`.
- Groups per `quantization_type`, for a linear weight [out, in]:
  `per_tensor_symmetric` one group, scale [1]; `per_channel_symmetric` one group per output row
  (channel axis 0), scale [out, 1]; `blockwise_symmetric` blocks of `block_size[i]` along
  `block_axis[i]`, every other axis per element, so scale is the weight shape with each block axis
  divided by its block size (e.g. axes (0, 1), sizes (128, 128): [out/128, in/128]).
- Divisors, as the reference computes them: int8 per-tensor 127.5 (torch's MinMaxObserver:
  (127 - -128) / 2, so the largest value lands on the clamp); int8 per-channel and blockwise 127
  (NxD's PerChannelAbsMaxObserver); f8e4m3 240, *not* the OCP e4m3fn 448, because Neuron's e4m3
  saturates at +/-240 (values are still stored as `torch.float8_e4m3fn`); f8e5m2 57344.
- All-zero groups: the scale is floored (int8: float32 eps, as torch's observers; fp8: 1e-5, as
  NxD's per-channel fp8 path), so nothing divides by zero. Deviation: NxD's fp8 *per-tensor* path
  has no floor and yields NaN for an all-zero weight; here it gets the 1e-5 floor too.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import TypeVar

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.errors import ConfigError, Problem


class QuantType(enum.Enum):
    """`neuron_config.quantization_type`, with the reference's strings."""

    PER_TENSOR_SYMMETRIC = "per_tensor_symmetric"
    PER_CHANNEL_SYMMETRIC = "per_channel_symmetric"
    BLOCKWISE_SYMMETRIC = "blockwise_symmetric"


class QuantDtype(enum.Enum):
    """`neuron_config.quantization_dtype`: what the quantized values are stored as."""

    INT8 = "int8"
    F8E4M3 = "f8e4m3"
    F8E5M2 = "f8e5m2"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPE[self]


class ScaleDtype(enum.Enum):
    """`neuron_config.quantization_scale_dtype`. Only f32; the reference's f8e8m0 is MX-only."""

    F32 = "f32"


E = TypeVar("E", bound=enum.Enum)


def _ints(xs: Iterable[int]) -> tuple[int, ...]:
    # A typed converter: mypy's attrs plugin cannot infer the element type through a bare `tuple`.
    return tuple(xs)


_TORCH_DTYPE = {
    QuantDtype.INT8: torch.int8,
    QuantDtype.F8E4M3: torch.float8_e4m3fn,
    QuantDtype.F8E5M2: torch.float8_e5m2,
}
_RANGE = {QuantDtype.INT8: (-128.0, 127.0), QuantDtype.F8E4M3: (-240.0, 240.0), QuantDtype.F8E5M2: (-57344.0, 57344.0)}
_SCALE_FLOOR = {QuantDtype.INT8: torch.finfo(torch.float32).eps, QuantDtype.F8E4M3: 1e-5, QuantDtype.F8E5M2: 1e-5}
_DTYPE_ALIASES = {"f8e4m3fn": QuantDtype.F8E4M3}


@attrs.frozen(kw_only=True)
class QuantScheme:
    """How every quantized weight of a model is stored. Build with `parse_quant_scheme`."""

    type: QuantType = QuantType.PER_TENSOR_SYMMETRIC
    """Grouping of the scales (see the module docstring)."""
    dtype: QuantDtype = QuantDtype.INT8
    """Storage dtype of the values."""
    scale_dtype: ScaleDtype = ScaleDtype.F32
    """Storage dtype of the scales."""
    block_axis: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    """Blockwise only: weight axes cut into blocks (negative counts from the end)."""
    block_size: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    """Blockwise only: block length along each `block_axis`, >= 1."""
    channel_axis: int = 0
    """Per-channel only: the axis with one scale per index; 0 (output rows) for linear weights."""

    @property
    def divisor(self) -> float:
        """`max|w|` of a group maps to this quantized value."""
        if self.dtype is QuantDtype.INT8:
            return 127.5 if self.type is QuantType.PER_TENSOR_SYMMETRIC else 127.0
        return _RANGE[self.dtype][1]


@attrs.frozen(eq=False, kw_only=True)
class QuantizedTensor:
    """A quantized weight as stored in the checkpoint: `<prefix>.weight` and `<prefix>.scale`."""

    values: Tensor
    """Same shape as the float weight, in `scheme.dtype.torch_dtype`."""
    scale: Tensor
    """float32, shaped by `scale_shape_for`."""

    @property
    def nbytes(self) -> int:
        """Bytes stored for values and scale together."""
        return sum(t.numel() * t.element_size() for t in (self.values, self.scale))


def parse_quant_scheme(
    *,
    quantization_type: str = "per_tensor_symmetric",
    quantization_dtype: str = "int8",
    quantization_scale_dtype: str = "f32",
    quantization_block_axis: Sequence[int] | None = None,
    quantization_block_size: Sequence[int] | None = None,
) -> Result[QuantScheme, ConfigError]:
    """A scheme from NeuronConfig's quantization kwargs (the reference's names and defaults).

    Returns:
        Success(QuantScheme), or Failure(ConfigError) listing every problem: unknown type, dtype or
        scale dtype; blockwise without block_axis/block_size, of different lengths, with repeated
        axes or sizes < 1. Block fields are ignored for other types, as the reference does.
    """
    problems: list[Problem] = []
    qtype = _choice(QuantType, quantization_type.lower(), "neuron_config.quantization_type", problems)
    name = quantization_dtype.lower()
    qdtype = _DTYPE_ALIASES.get(name) or _choice(QuantDtype, name, "neuron_config.quantization_dtype", problems)
    sdtype = _choice(ScaleDtype, quantization_scale_dtype.lower(), "neuron_config.quantization_scale_dtype", problems)
    axes, sizes = tuple(quantization_block_axis or ()), tuple(quantization_block_size or ())
    if qtype is QuantType.BLOCKWISE_SYMMETRIC:
        problems.extend(_block_problems(axes, sizes))
    else:
        axes, sizes = (), ()
    if problems or qtype is None or qdtype is None or sdtype is None:
        return Failure(ConfigError(problems=problems))
    return Success(QuantScheme(type=qtype, dtype=qdtype, scale_dtype=sdtype, block_axis=axes, block_size=sizes))


def _choice(enum_cls: type[E], raw: str, field: str, problems: list[Problem]) -> E | None:
    try:
        return enum_cls(raw)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        problems.append(Problem.of(field, raw, "is not supported", f"use one of {allowed}"))
        return None


def _block_problems(axes: tuple[int, ...], sizes: tuple[int, ...]) -> list[Problem]:
    out: list[Problem] = []
    fix = "set both, one size per axis, e.g. quantization_block_axis=[1], quantization_block_size=[128]"
    if not axes:
        out.append(Problem.missing("neuron_config.quantization_block_axis", fix))
    if not sizes:
        out.append(Problem.missing("neuron_config.quantization_block_size", fix))
    if axes and sizes and len(axes) != len(sizes):
        out.append(
            Problem.of("neuron_config.quantization_block_size", list(sizes), "needs one size per block axis", fix)
        )
    if len(set(axes)) != len(axes):
        out.append(
            Problem.of("neuron_config.quantization_block_axis", list(axes), "repeats an axis", "list each axis once")
        )
    if any(s < 1 for s in sizes):
        out.append(Problem.of("neuron_config.quantization_block_size", list(sizes), "has a size < 1", "use sizes >= 1"))
    return out


def group_sizes_for(
    scheme: QuantScheme, shape: Sequence[int], *, name: str = "weight"
) -> Result[tuple[int, ...], ConfigError]:
    """Length of one scale group along each axis of a weight of `shape`.

    Returns:
        Success(sizes), one per axis, each dividing its axis; or Failure(ConfigError) naming `name`
        when the weight is 0-d, the channel axis is out of range, a block axis is out of range, or
        a block size does not divide its axis (the reference allows a too-large block only on the
        TP-partitioned axis, after sharding; that case is refused here).
    """
    shape = tuple(shape)
    nd = len(shape)
    if nd == 0:
        return Failure(ConfigError.of(name, shape, "is 0-d and cannot be quantized", "quantize only weights"))
    if scheme.type is QuantType.PER_TENSOR_SYMMETRIC:
        return Success(shape)
    if scheme.type is QuantType.PER_CHANNEL_SYMMETRIC:
        if not -nd <= scheme.channel_axis < nd:
            return Failure(
                ConfigError.of(name, shape, f"has no channel axis {scheme.channel_axis}", "use channel_axis 0")
            )
        axis = scheme.channel_axis % nd
        return Success(tuple(1 if a == axis else n for a, n in enumerate(shape)))
    sizes = [1] * nd
    problems: list[Problem] = []
    for axis, size in zip(scheme.block_axis, scheme.block_size, strict=True):
        if not -nd <= axis < nd:
            problems.append(Problem.of(name, shape, f"has no block axis {axis}", f"use axes in [-{nd}, {nd})"))
        elif shape[axis] % size != 0:
            problems.append(
                Problem.of(
                    name,
                    shape,
                    f"axis {axis % nd} (length {shape[axis]}) is not divisible by block size {size}",
                    "choose a quantization_block_size that divides every quantized weight's axis",
                )
            )
        else:
            sizes[axis % nd] = size
    return Failure(ConfigError(problems=problems)) if problems else Success(tuple(sizes))


def scale_shape_for(
    scheme: QuantScheme, shape: Sequence[int], *, name: str = "weight"
) -> Result[tuple[int, ...], ConfigError]:
    """The stored scale shape for a weight of `shape`: [1], [out, 1] or the block grid.

    Returns:
        Success(shape), or the Failure of `group_sizes_for`.
    """
    if scheme.type is QuantType.PER_TENSOR_SYMMETRIC and len(shape) > 0:
        return Success((1,))
    return group_sizes_for(scheme, shape, name=name).map(lambda g: tuple(n // s for n, s in zip(shape, g, strict=True)))


def _grouped_shapes(shape: Sequence[int], groups: Sequence[int]) -> tuple[list[int], list[int]]:
    """[n0, g0, n1, g1, ...] for the values and [n0, 1, n1, 1, ...] for the scale."""
    values, scale = [], []
    for n, g in zip(shape, groups, strict=True):
        values += [n // g, g]
        scale += [n // g, 1]
    return values, scale


def quantize(w: Tensor, scheme: QuantScheme, *, name: str = "weight") -> Result[QuantizedTensor, ConfigError]:
    """Quantize one floating-point weight.

    Args:
        w: the float weight, any shape with >= 1 axis ([out, in] for a linear).
        scheme: how to group and store it.
        name: the tensor's checkpoint key, used in problems.

    Returns:
        Success(QuantizedTensor(values [*w.shape] in scheme's dtype, scale float32 per
        `scale_shape_for`)), or Failure(ConfigError) naming `name` when `w` is not floating point
        or the scheme's groups do not fit its shape (see `group_sizes_for`).
    """
    if not w.dtype.is_floating_point:
        return Failure(ConfigError.of(name, str(w.dtype), "is not a float tensor", "quantize float weights only"))
    return scale_shape_for(scheme, w.shape, name=name).bind(
        lambda scale_shape: group_sizes_for(scheme, w.shape, name=name).map(
            lambda groups: _quantize_groups(w, scheme, groups, scale_shape)
        )
    )


def _quantize_groups(
    w: Tensor, scheme: QuantScheme, groups: tuple[int, ...], scale_shape: tuple[int, ...]
) -> QuantizedTensor:
    v_shape, s_shape = _grouped_shapes(w.shape, groups)
    x = w.to(torch.float32).reshape(v_shape)  # [n0, g0, n1, g1, ...]
    amax = x.abs().amax(dim=tuple(range(1, len(v_shape), 2)), keepdim=True)  # [n0, 1, n1, 1, ...]
    scale = torch.clamp(amax / scheme.divisor, min=_SCALE_FLOOR[scheme.dtype])
    lo, hi = _RANGE[scheme.dtype]
    q = torch.clamp(x / scale, lo, hi)
    if scheme.dtype is QuantDtype.INT8:
        q = torch.round(q)  # ties to even, as torch.quantize_per_tensor/channel
    values = q.to(scheme.dtype.torch_dtype).reshape(w.shape)
    return QuantizedTensor(values=values, scale=scale.reshape(s_shape).reshape(scale_shape))


def scale_per_element(q: QuantizedTensor) -> Tensor:
    """The float32 scale of every element, shaped like `q.values`.

    The groups are read from the shapes, as NxD's blockwise dequantize does: a one-element scale
    ([1] or 0-d) covers the tensor; otherwise each axis's group length is
    `values.shape[a] // scale.shape[a]`. Inconsistent shapes are a programmer error (AssertionError):
    `q` must come from `quantize` or have passed `check_quantized_checkpoint`.
    """
    shape = tuple(q.values.shape)
    scale = q.scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(()).expand(shape)
    assert scale.dim() == len(shape), f"scale {tuple(scale.shape)} does not match values {shape}"
    assert all(n % s == 0 for n, s in zip(shape, scale.shape, strict=True)), "scale does not tile values"
    groups = tuple(n // s for n, s in zip(shape, scale.shape, strict=True))
    v_shape, s_shape = _grouped_shapes(shape, groups)
    return scale.reshape(s_shape).expand(v_shape).reshape(shape)  # [*values.shape]


def dequantize(q: QuantizedTensor, scheme: QuantScheme, dtype: torch.dtype = torch.float32) -> Tensor:
    """`values * scale` computed in float32, returned in `dtype`, same shape as `q.values`.

    `scheme` is not needed to read the groups (see `scale_per_element`); it is checked against the
    values' dtype, and a mismatch is a programmer error (AssertionError).
    """
    assert q.values.dtype == scheme.dtype.torch_dtype, f"values are {q.values.dtype}, scheme says {scheme.dtype.value}"
    return (q.values.to(torch.float32) * scale_per_element(q)).to(dtype)


_MANTISSA_BITS = {QuantDtype.F8E4M3: 3, QuantDtype.F8E5M2: 2}
_MIN_NORMAL_EXP = {QuantDtype.F8E4M3: -6, QuantDtype.F8E5M2: -14}


def fp8_error_bound(w: Tensor, scale: Tensor, dtype: QuantDtype = QuantDtype.F8E4M3) -> Tensor:
    """Per-element bound on |w - dequantize(quantize(w))| for an fp8 dtype with m mantissa bits.

    The cast rounds `x = w / scale` to nearest. For normal |x| (>= 2**e_min) the spacing is
    2**(floor(log2|x|) - m) <= |x| / 2**m, so the error is <= |x| / 2**(m+1); subnormal spacing is
    2**(e_min - m), error <= 2**(e_min - m - 1). For f8e4m3 (m=3, e_min=-6):
    |w - w'| <= max(|w| / 16, scale * 2**-10), plus float32 rounding of the divide and multiply
    (the 1e-5 relative slack). `scale` must broadcast against `w` (see `scale_per_element`).
    """
    m, e_min = _MANTISSA_BITS[dtype], _MIN_NORMAL_EXP[dtype]
    rel = w.abs() / 2.0 ** (m + 1)
    sub = scale * 2.0 ** (e_min - m - 1)
    return torch.maximum(rel, sub) * (1 + 1e-5)
