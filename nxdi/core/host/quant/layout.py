"""Quantized checkpoint layout: which keys hold quantized values and scales, and checks. Pure.

Rules (NxDI `save_quantized_state_dict` / NxD `quantize.convert`):
- A quantized linear `<prefix>` stores `<prefix>.weight` (values, in the quantization dtype, the
  float weight's shape) and `<prefix>.scale` (float32; [1], [out, 1] or the block grid, see
  `weights.scale_shape_for`). Bias, norms and embeddings stay as they are.
- Quantized by default: every linear projection, i.e. attention q/k/v/o (or fused Wqkv), MLP
  gate/up/down, and lm_head (NxD swaps every Column/RowParallelLinear, and lm_head is one).
  Embeddings and norms are never quantized. NxDI's causal-LM saver writes the base model's state
  dict (keys without `model.`) plus the lm_head module's (`lm_head.weight`, and `lm_head.scale`
  when it was quantized; a tied model's lm_head is written as its own weight).
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
from nxdi.core.weight_plan import kept_in_float, module_of
from nxdi.core.weight_table import scale_name

LINEAR_LEAVES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "Wqkv", "gate_proj", "up_proj", "down_proj", "lm_head"}
)
"""Last module-path component of the linears that are quantized unless excluded."""

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


def is_linear_weight(key: str) -> bool:
    """True for `<...>.<leaf>.weight` with leaf one of `LINEAR_LEAVES`."""
    parts = key.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_LEAVES


def quantized_keys(names: Iterable[str], modules_to_not_convert: Iterable[str] | None = None) -> QuantPlan:
    """Split a checkpoint's linear weights into quantized and excluded, sorted by key.

    Args:
        names: checkpoint keys, without a `model.` prefix (as NxDI's saver writes them).
        modules_to_not_convert: substrings of module paths to keep in float; None means none.
    """
    skip = tuple(modules_to_not_convert or ())
    linear = sorted(k for k in set(names) if is_linear_weight(k))
    return QuantPlan(
        quantized=[k for k in linear if not kept_in_float(k, skip)],
        excluded=[k for k in linear if kept_in_float(k, skip)],
    )


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
        problems.extend(_check_one(tensors, key, scheme))
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


def _check_one(tensors: Mapping[str, TensorMeta], key: str, scheme: QuantScheme) -> list[Problem]:
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
    match weights.scale_shape_for(scheme, meta.shape, name=key):
        case Success(want) if not _shape_ok(scheme, smeta.shape, want):
            out.append(_scale_shape_problem(skey, meta.shape, smeta.shape, want, scheme))
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
    tie_word_embeddings: bool = False,
    model_prefix: str = "model.",
) -> Result[dict[str, torch.Tensor], ConfigError]:
    """A Hugging Face causal-LM state dict in NxDI's quantized checkpoint layout.

    The layout `save_quantized_state_dict` writes: the base model's keys without `model_prefix`
    plus `lm_head.*` (a tied model's lm_head is written as its own `lm_head.weight`, as the
    reference saves the lm_head module), every linear `quantized_keys` selects replaced by its
    values and a `.scale`, everything else as given. `tensors` is not modified.

    Returns:
        Success(dict), or Failure(ConfigError) naming every weight the scheme cannot quantize
        (e.g. blocks that do not tile it).
    """
    out = {k.removeprefix(model_prefix): t for k, t in tensors.items()}
    if tie_word_embeddings and "lm_head.weight" not in out and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    problems: list[Problem] = []
    for key in quantized_keys(out, modules_to_not_convert).quantized:
        match weights.quantize(out[key], scheme, name=key):
            case Success(q):
                out[key], out[scale_name(key)] = q.values, q.scale
            case Failure(err):
                problems.extend(err.problems)
    return Failure(ConfigError(problems=problems)) if problems else Success(out)
