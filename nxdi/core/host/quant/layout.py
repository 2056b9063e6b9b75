"""Quantized checkpoint layout: which keys hold quantized values and scales, and checks. Pure.

Rules (NxDI `save_quantized_state_dict` / NxD `quantize.convert`):
- A quantized linear `<prefix>` stores `<prefix>.weight` (values, in the quantization dtype, the
  float weight's shape) and `<prefix>.scale` (float32; [1], [out, 1] or the block grid, see
  `weights.scale_shape_for`). Bias, norms and embeddings stay as they are.
- Quantized by default: every linear projection, i.e. the sources of the weights the family's
  weight table marks `linear` (attention q/k/v/o or a fused QKV, the MLP's, and lm_head: NxD swaps
  every Column/RowParallelLinear, and lm_head is one). Embeddings and norms are never quantized.
  NxDI's causal-LM saver writes the base model's state dict (keys without the model prefix,
  `model.` for Llama) plus the lm_head module's (`lm_head.weight`, and `lm_head.scale` when it
  was quantized; a tied model's lm_head is written as its own weight).
- A weight stored transposed (GPT-2's Conv1D, `[in, out]`) keeps its stored layout, its values
  quantized per output channel (its columns); its scale is that of the `[out, in]` weight the
  program takes (`[out, 1]` per channel, the block grid of `[out, in]`), so every family's scale
  has one meaning. A weight stored with its rows in another order (a fused QKV head by head) is
  quantized row by row as stored: its scale rows follow its rows.
- `modules_to_not_convert` entries are *substrings* of the module path (the key without
  `.weight`): "layers.0.mlp" skips layers.0.mlp.{gate,up,down}_proj, and "lm_head" skips lm_head.
  As in the reference, "layers.1" also matches "layers.10...": write "layers.1." to be exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import torch
from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem
from nxdi.core.host.quant import weights
from nxdi.core.host.quant.weights import QuantScheme, QuantType
from nxdi.core.model_spec import ModelSpec
from nxdi.core.weight_plan import kept_in_float, module_of
from nxdi.core.weight_table import WeightTable, scale_name

_QUANT_DTYPES = {d.torch_dtype: d for d in weights.QuantDtype}


def _ints(xs: Iterable[int]) -> tuple[int, ...]:
    # Typed converters: mypy's attrs plugin cannot infer element types through a bare `tuple`.
    return tuple(xs)


def _strs(xs: Iterable[str]) -> tuple[str, ...]:
    return tuple(xs)


@attrs.frozen(kw_only=True)
class TensorMeta:
    """What a check needs to know about one stored tensor."""

    shape: tuple[int, ...] = attrs.field(converter=_ints)
    dtype: torch.dtype


@attrs.frozen(kw_only=True)
class QuantPlan:
    """Which weight keys of a checkpoint are quantized, and which linears were left in float."""

    quantized: tuple[str, ...] = attrs.field(converter=_strs)
    """`<prefix>.weight` keys holding quantized values (each with a `<prefix>.scale`)."""
    excluded: tuple[str, ...] = attrs.field(converter=_strs)
    """Linear `.weight` keys kept in float because modules_to_not_convert matched them."""
    transposed: frozenset[str] = frozenset()
    """Quantized keys stored `[in, out]`: their scale is the `[out, in]` weight's."""


def quantized_keys(
    linear: Iterable[str], modules_to_not_convert: Iterable[str] | None = None, *, transposed: Iterable[str] = ()
) -> QuantPlan:
    """Split a checkpoint's linear weights into quantized and excluded, sorted by key.

    Args:
        linear: the keys of the linear weights (`WeightTable.linear_sources`), without the model
            prefix (as NxDI's saver writes them).
        modules_to_not_convert: substrings of module paths to keep in float; None means none.
        transposed: the linear keys stored `[in, out]`.
    """
    skip = tuple(modules_to_not_convert or ())
    keys = sorted(set(linear))
    quantized = [k for k in keys if not kept_in_float(k, skip)]
    return QuantPlan(
        quantized=quantized,
        excluded=[k for k in keys if kept_in_float(k, skip)],
        transposed=frozenset(transposed) & frozenset(quantized),
    )


def table_keys(table: WeightTable, spec: ModelSpec, modules_to_not_convert: Iterable[str] | None = None) -> QuantPlan:
    """`quantized_keys` of the linear weights of a family's checkpoint (`table`, `spec`)."""
    linear = table.linear_sources(spec)
    return quantized_keys(linear, modules_to_not_convert, transposed=[k for k, s in linear.items() if s.transposed])


def metas_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
    """Shapes and dtypes of a state dict (the pure view a check needs)."""
    return {k: TensorMeta(shape=tuple(t.shape), dtype=t.dtype) for k, t in tensors.items()}


def implied_type(weight_shape: Sequence[int], scale_shape: Sequence[int]) -> QuantType | None:
    """The quantization_type a stored scale shape implies, or None when it fits none.

    One element -> per_tensor; [out, 1, ...] -> per_channel; same rank with every axis dividing
    the weight's -> blockwise.
    """
    w, s = tuple(weight_shape), tuple(scale_shape)
    if len(s) <= 1 and (s == () or s[0] == 1):
        return QuantType.PER_TENSOR_SYMMETRIC
    if len(s) != len(w) or any(n == 0 or m % n for m, n in zip(w, s, strict=True)):
        return None
    if s[0] == w[0] and all(n == 1 for n in s[1:]):
        return QuantType.PER_CHANNEL_SYMMETRIC
    return QuantType.BLOCKWISE_SYMMETRIC


def check_quantized_checkpoint(
    tensors: Mapping[str, TensorMeta], plan: QuantPlan, scheme: QuantScheme
) -> Result[QuantPlan, ConfigError]:
    """Check that a quantized checkpoint matches `plan` and `scheme`, before loading it.

    Args:
        tensors: shape and dtype of every stored tensor (`metas_of(state_dict)`).
        plan: the expected layout (`quantized_keys(names, modules_to_not_convert)`).
        scheme: the configured quantization.

    Returns:
        Success(plan), or Failure(ConfigError) with one Problem per fault, each naming the tensor:
        a quantized weight missing; its values not in the quantization dtype; its scale missing;
        a scale of the wrong shape (saying which quantization_type the shape implies, if any);
        an excluded linear stored in a quantized dtype.
    """
    problems: list[Problem] = []
    for key in plan.quantized:
        problems.extend(_check_one(tensors, key, scheme, transposed=key in plan.transposed))
    for key in plan.excluded:
        meta = tensors.get(key)
        if meta is not None and meta.dtype in _QUANT_DTYPES:
            problems.append(
                Problem.of(
                    key,
                    str(meta.dtype),
                    "is stored quantized but its module is in modules_to_not_convert",
                    "remove the matching entry from modules_to_not_convert, or re-save this weight in float",
                )
            )
    return Failure(ConfigError(problems=problems)) if problems else Success(plan)


def _check_one(tensors: Mapping[str, TensorMeta], key: str, scheme: QuantScheme, *, transposed: bool) -> list[Problem]:
    out: list[Problem] = []
    regen = "regenerate the quantized checkpoint with this config"
    meta = tensors.get(key)
    if meta is None:
        return [Problem.missing(key, f"{regen}, or add {module_of(key)!r} to modules_to_not_convert")]
    want = scheme.dtype.torch_dtype
    if meta.dtype != want:
        stored = _QUANT_DTYPES.get(meta.dtype)
        fix = f"set quantization_dtype={stored.value!r}" if stored else f"{regen}, or add it to modules_to_not_convert"
        out.append(
            Problem.of(key, str(meta.dtype), f"must be {want} for quantization_dtype={scheme.dtype.value!r}", fix)
        )
    skey = scale_name(key)
    smeta = tensors.get(skey)
    if smeta is None:
        out.append(Problem.missing(skey, f"{regen}; every quantized weight needs its scale"))
        return out
    shape = meta.shape[::-1] if transposed else meta.shape  # the [out, in] weight the scale is of
    match weights.scale_shape_for(scheme, shape, name=key):
        case Success(want) if not _shape_ok(scheme, smeta.shape, want):
            out.append(_scale_shape_problem(skey, shape, smeta.shape, want, scheme))
        case Failure(err):
            out.extend(err.problems)
    return out


def _shape_ok(scheme: QuantScheme, got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    # NxD's fp8 per-tensor saver stores a 0-d scale; its loader parameter is [1]. Accept both.
    return got == want or (scheme.type is QuantType.PER_TENSOR_SYMMETRIC and got == ())


def _scale_shape_problem(
    skey: str, w_shape: tuple[int, ...], got: tuple[int, ...], want: tuple[int, ...], scheme: QuantScheme
) -> Problem:
    implied = implied_type(w_shape, got)
    reason = f"must have shape {list(want)} for {scheme.type.value} of a {list(w_shape)} weight"
    if implied is not None and implied is not scheme.type:
        reason += f"; this shape implies quantization_type={implied.value!r}"
        fix = f"set quantization_type={implied.value!r} (and block settings to match), or regenerate the checkpoint"
    elif implied is QuantType.BLOCKWISE_SYMMETRIC:
        sizes = [m // n for m, n in zip(w_shape, got, strict=True)]
        fix = f"the stored blocks are {sizes} per axis: set quantization_block_axis/size to match"
    else:
        fix = "regenerate the quantized checkpoint with this config"
    return Problem.of(skey, list(got), reason, fix)


def quantize_state_dict(
    tensors: Mapping[str, torch.Tensor],
    scheme: QuantScheme,
    modules_to_not_convert: Iterable[str] | None = None,
    *,
    table: WeightTable,
    spec: ModelSpec,
) -> Result[dict[str, torch.Tensor], ConfigError]:
    """A Hugging Face causal-LM state dict of `spec`'s family (`table`) in NxDI's quantized
    checkpoint layout.

    The layout `save_quantized_state_dict` writes: the base model's keys without the table's model
    prefix plus `lm_head.*` (a tied model's lm_head is written as its own `lm_head.weight`, as the
    reference saves the lm_head module), every linear `table_keys` selects replaced by its values
    and a `.scale` (a transposed one quantized per output column, see the module docstring),
    everything else as given. `tensors` is not modified; a linear it lacks is left for the load-time
    check to name.

    Returns:
        Success(dict), or Failure(ConfigError) naming every weight the scheme cannot quantize
        (e.g. blocks that do not tile it).
    """
    prefix = table.model_prefix
    out = {k.removeprefix(prefix): t for k, t in tensors.items()}
    tied = table.tied_sources(spec)
    if tied is not None and tied[0] not in out and tied[1] in out:
        out[tied[0]] = out[tied[1]]
    plan = table_keys(table, spec, modules_to_not_convert)
    problems: list[Problem] = []
    for key in (k for k in plan.quantized if k in out):
        flip = key in plan.transposed
        match weights.quantize(out[key].T if flip else out[key], scheme, name=key):
            case Success(q):
                out[key] = q.values.T.contiguous() if flip else q.values
                out[scale_name(key)] = q.scale
            case Failure(err):
                problems.extend(err.problems)
    return Failure(ConfigError(problems=problems)) if problems else Success(out)
