"""Padding a tensor to a target shape and cutting it back (NxDI's `modules.padding`). Pure.

Rules (the reference's):
- `pad_tensor(x, target_shape, pad_value)` pads every dimension at its end up to `target_shape`;
  a dimension already at least as large is left as it is (never cut). The pad value defaults to
  the tensor's largest value (NxDI does this because some compilers misbehave on 0 or 1 padding).
- It also returns `[[0, n] for n in x.shape]`, the slices that hold the original values, which
  `unpad_tensor` takes to cut the padded tensor (or anything computed from it) back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from nxdi.core.errors import ConfigError
from nxdi.shell.exceptions import exception_for

__all__ = ["pad_tensor", "pad_with_first_batchline", "unpad_tensor"]


def pad_tensor(
    unpadded_tensor: Tensor, target_shape: Sequence[int], pad_value: float | None = None
) -> tuple[Tensor, list[list[int]]]:
    """`unpadded_tensor` padded at the end of each dimension to `target_shape`.

    Args:
        unpadded_tensor: any shape, e.g. [B, S].
        target_shape: one size per dimension; sizes below the tensor's leave that dimension as is.
        pad_value: the fill value; None means the tensor's maximum (0 for an empty tensor).

    Returns:
        The padded tensor (same dtype and device) and the original index slices
        `[[0, n0], [0, n1], ...]` for `unpad_tensor`.

    Raises:
        IncompatibleConfigError: (a ValueError) `target_shape` has another number of dimensions
            than the tensor, or a negative size.
    """
    original = list(unpadded_tensor.shape)
    target = [int(n) for n in target_shape]
    if len(target) != len(original) or any(n < 0 for n in target):
        why = f"must give one size >= 0 for each of the tensor's {len(original)} dimensions (shape {original})"
        raise exception_for(ConfigError.of("target_shape", target, why), "Cannot pad tensor")
    if pad_value is None:
        pad_value = unpadded_tensor.max().item() if unpadded_tensor.numel() else 0
    padding: list[int] = []
    for current, wanted in zip(reversed(original), reversed(target), strict=True):
        padding.extend([0, max(wanted - current, 0)])  # F.pad lists the last dimension first
    padded = F.pad(unpadded_tensor, padding, mode="constant", value=pad_value)
    return padded, [[0, n] for n in original]


def unpad_tensor(padded_tensor: Tensor, original_idx_slices: Sequence[Sequence[int]]) -> Tensor:
    """The part of `padded_tensor` the slices `[[start, end], ...]` (from `pad_tensor`) select: a view.

    Raises:
        IncompatibleConfigError: more slices than the tensor has dimensions.
    """
    if len(original_idx_slices) > padded_tensor.dim():
        why = f"has {len(original_idx_slices)} slices for a tensor of {padded_tensor.dim()} dimensions"
        error = ConfigError.of("original_idx_slices", [list(s) for s in original_idx_slices], why)
        raise exception_for(error, "Cannot unpad tensor")
    return padded_tensor[tuple(slice(start, end) for start, end in original_idx_slices)]


def pad_with_first_batchline(unpadded_tensor: Tensor, target_shape: Sequence[int]) -> Tensor:
    """`unpadded_tensor` [B, ...] grown to `target_shape[0]` rows by repeating its first row after the originals.

    Raises:
        IncompatibleConfigError: the tensor has no rows, or more than `target_shape[0]`.
    """
    b, rows = unpadded_tensor.shape[0], int(target_shape[0])
    if b == 0 or rows < b:
        why = f"must be at least the tensor's {b} rows (and the tensor must have one)"
        raise exception_for(ConfigError.of("target_shape[0]", rows, why), "Cannot pad tensor")
    filler = unpadded_tensor[:1].expand(rows - b, *unpadded_tensor.shape[1:])
    return torch.cat([unpadded_tensor, filler], dim=0)
