"""Tensor side of weight plans: apply a `WeightStep` to tensors (copy, concatenate, stack, split, cast). Pure.

`nxdi.core.weight_plan` says what to do (no torch); this module does it to tensors it is given, without
mutating them. Reading tensors from files is `nxdi.effects.weight_loader`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core import weight_plan as weights
from nxdi.core.errors import CheckpointError, Problem

_FLOAT8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz") if hasattr(torch, n))


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` (`"bfloat16"` -> `torch.bfloat16`)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name")
    return dtype


def cast_float(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` in `dtype` when `t` is a non-float8 floating tensor; otherwise `t` itself."""
    if not t.is_floating_point() or t.dtype in _FLOAT8:
        return t
    return t.to(dtype)


class CastOverflow(ValueError):
    """A weight's cast to the model's dtype turned finite values into inf (a float32 or bfloat16
    weight past 65504 cast to float16). `overflow_problems` names the checkpoint tensors."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        super().__init__(f"{name}: finite values past {dtype}'s largest finite value would be cast to inf")


def _overflows(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether casting `t` to `dtype` makes a finite value inf, for a cast to float16 (65504) from a
    wider range, by one `aminmax` of `t`'s finite values: rounding is monotonic, so the cast overflows
    iff its extremes do. bfloat16's range ends one float32 step below float32's (3.39e38 against
    3.40e38), which no weight reaches; looking would cost a pass over every float32 checkpoint of a
    bfloat16 model."""
    if not dtype.is_floating_point or dtype in _FLOAT8 or not t.is_floating_point():
        return False
    if torch.finfo(dtype).max >= min(torch.finfo(t.dtype).max, torch.finfo(torch.bfloat16).max):
        return False
    if t.numel() == 0:
        return False
    lo, hi = torch.aminmax(t)
    if not (math.isfinite(lo) and math.isfinite(hi)):  # inf or NaN in the source itself: look past them
        finite = t[torch.isfinite(t)]
        if finite.numel() == 0:
            return False
        lo, hi = torch.aminmax(finite)
    return bool(torch.isinf(torch.stack((lo, hi)).to(dtype)).any())


def overflow_problems(sources: Mapping[str, Tensor], dtype: torch.dtype) -> tuple[Problem, ...]:
    """One problem per checkpoint tensor (key -> tensor) with finite values that a cast to `dtype`
    makes inf, naming its largest finite magnitude, the dtype's limit and the fix."""
    short = str(dtype).removeprefix("torch.")
    fix = "set torch_dtype to bfloat16 or float32 (the float32 range), or rescale the checkpoint"
    out = []
    for key, t in sources.items():
        if not _overflows(t, dtype):
            continue
        largest = float(t[torch.isfinite(t)].abs().max())
        why = (
            f"its largest finite magnitude is past {short}'s largest finite value {torch.finfo(dtype).max:.6g}: "
            f"cast to torch_dtype={short} it would be inf, and so would every logit it reaches"
        )
        out.append(Problem.of(key, largest, why, fix))
    return tuple(out)


def split_experts(t: Tensor, split: weights.SplitExperts) -> Tensor:
    """[X*F, E] -> [X, F, E] (a view of `t`), or [X, E, F] for TRANSPOSED rows (a copy, contiguous).

    Raises:
        ValueError: `t` is not 2-D or its rows do not divide into `split.experts` blocks.
    """
    if t.dim() != 2 or t.shape[0] % split.experts:
        raise ValueError(f"shape {tuple(t.shape)} does not hold {split.experts} experts' rows one above the other")
    out = t.reshape(split.experts, -1, t.shape[1])
    return out.transpose(1, 2).contiguous() if split.rows is weights.ExpertRows.TRANSPOSED else out


def apply_transform(t: Tensor, transform: weights.Transform) -> Tensor:
    """One transform of a step."""
    match transform:
        case weights.SplitExperts():
            return split_experts(t, transform)
        case weights.CastFloat(dtype=name):
            return cast_float(t, torch_dtype(name))
        case weights.Rows():
            return t.reshape(-1)
        case weights.Transpose():
            return t.t().contiguous()
    raise AssertionError(f"unknown transform {transform!r}")


def take(t: Tensor, take: weights.Take, *, offset: int = 0) -> Tensor:
    """`t`'s rows (along `take.dim`) at `take.indices`, zeros for None; `t` starts at source row `offset`
    (the reader read only `take.bounds()`). A new tensor; `t` is not modified."""
    rows = torch.tensor([0 if i is None else i - offset for i in take.indices], dtype=torch.int64)
    out = t.index_select(take.dim, rows)
    padding = [j for j, i in enumerate(take.indices) if i is None]
    if padding:
        out.index_fill_(take.dim, torch.tensor(padding, dtype=torch.int64), 0)
    return out


def apply_step(step: weights.WeightStep, sources: Sequence[Tensor], offsets: Sequence[int] = ()) -> Tensor:
    """The weight `step` makes from its source tensors (in `step.sources` order).

    `offsets[i]` is the first row of source i that `sources[i]` holds when the reader read only the
    range its Take needs (default: whole tensors). ALIAS steps are resolved by the caller, which
    already holds the aliased output.
    """
    assert step.combine is not weights.Combine.ALIAS, "an alias step reuses an earlier output"
    sources = [t.reshape(1) if t.dim() == 0 else t for t in sources]  # a 0-d per-tensor scale is [1]
    parts = [
        take(t, tk, offset=offsets[i] if offsets else 0) if (tk := step.take(i)) is not None else t
        for i, t in enumerate(sources)
    ]
    if step.combine is weights.Combine.STACK:
        out = torch.stack(parts)
    else:
        out = parts[0] if step.combine is weights.Combine.COPY else torch.cat(parts, dim=0)
    for t in step.transforms:
        if isinstance(t, weights.CastFloat) and _overflows(out, dtype := torch_dtype(t.dtype)):
            raise CastOverflow(step.name, dtype)
        try:
            out = apply_transform(out, t)
        except ValueError as e:  # shapes are checked before any read; a caller that skipped that still learns which
            raise ValueError(f"{step.name} (from {', '.join(step.sources)}): {e}") from e
    return out


def tensor_shapes(state_dict: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """Key -> shape, the input `weights.check_checkpoint` takes."""
    return {k: tuple(v.shape) for k, v in state_dict.items()}


def convert(plan: weights.WeightPlan, state_dict: Mapping[str, Tensor]) -> Result[dict[str, Tensor], CheckpointError]:
    """Apply `plan` to an in-memory checkpoint (keys as stored, e.g. `model.layers.0...`).

    Returns:
        `Success(dict)` of nxdi name -> tensor in `plan.names()` order (tied weights are one tensor
        under two names), or `Failure(CheckpointError)` listing every missing, unexpected or
        wrongly shaped key, or every weight whose cast would overflow (`CastOverflow`).
        `state_dict` is not modified.
    """
    match weights.check_checkpoint(plan, tensor_shapes(state_dict)):
        case Failure(err):
            return Failure(err)
        case Success(keys):
            out: dict[str, Tensor] = {}
            overflows: list[Problem] = []
            for step in plan.steps:
                if step.combine is weights.Combine.ALIAS:
                    if step.sources[0] in out:  # else its target overflowed: the result is a Failure
                        out[step.name] = out[step.sources[0]]
                    continue
                sources = {keys[s]: state_dict[keys[s]] for s in step.sources}
                try:
                    out[step.name] = apply_step(step, list(sources.values()))
                except CastOverflow as e:
                    overflows.extend(overflow_problems(sources, e.dtype))
            return Failure(CheckpointError(problems=tuple(overflows))) if overflows else Success(out)
    raise AssertionError("unreachable")
