"""The `[B, 3]` sampling_params tensor: build, check and normalize it (NxDI's sampling helpers).

NxDI's `modules.generation.sampling` names, for tensors: `prepare_sampling_params` builds the
`(top_k, top_p, temperature)` rows, `validate_sampling_params` checks them against the
on-device sampling config, `infer_sampling_params` makes temperature-0 rows greedy. The rules
are `nxdi.core.sampling_params`'s; this module converts tensors to rows and back and turns its
Failures into `IncompatibleConfigError` (a `ValueError`, as NxDI raises). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nxdi.core import sampling_params as sampling_params_core
from nxdi.core.errors import ConfigError
from nxdi.shell.causal_lm import prepare_sampling_params
from nxdi.shell.config import OnDeviceSamplingConfig
from nxdi.shell.exceptions import exception_for, unwrap

__all__ = ["infer_sampling_params", "prepare_sampling_params", "validate_sampling_params"]

DEFAULT_GLOBAL_TOPK = 256
"""`OnDeviceSamplingConfig.global_topk`'s default: the top-k limit when no config says otherwise."""


def _rows(params: Tensor) -> list[list[float]]:
    """`params` [B, 3] as rows of Python numbers.

    Raises:
        IncompatibleConfigError: `params` is not a 2-D tensor with 3 columns.
    """
    if not isinstance(params, Tensor) or params.dim() != 2 or params.shape[1] != 3:
        shape = tuple(params.shape) if isinstance(params, Tensor) else type(params).__name__
        why = "expected a tensor of shape (batch_size, 3): top_k, top_p, temperature per row"
        error = ConfigError.of("sampling_params", shape, why, "build it with prepare_sampling_params")
        raise exception_for(error, "Invalid sampling parameters")
    rows: list[list[float]] = params.tolist()
    return rows


def _global_topk(config: OnDeviceSamplingConfig | Mapping[str, Any] | None) -> int:
    """The top-k limit of an OnDeviceSamplingConfig, its dict form, or None (the default, 256)."""
    if config is None:
        return DEFAULT_GLOBAL_TOPK
    if isinstance(config, Mapping):
        return int(config.get("global_topk", DEFAULT_GLOBAL_TOPK))
    return int(config.global_topk)


def validate_sampling_params(
    params: Tensor, on_device_sampling_config: OnDeviceSamplingConfig | Mapping[str, Any] | None
) -> None:
    """Check every row of `params` [B, 3] (top_k, top_p, temperature), as NxDI does.

    top_k must be an integer, -1 or in `[0, global_topk]` (-1 and 0: the whole vocabulary); top_p in
    `(0, 1]`; temperature `>= 0`; temperature 0 (greedy) cannot go with top_k -1 or 0. The limit is
    the config's `global_topk` (a dict's `"global_topk"`; 256 when the config is None or lacks it).

    Raises:
        IncompatibleConfigError: (a ValueError) `params` is not [B, 3], or any value breaks a rule;
            every bad row and value is listed, each named `sampling_params[i].<field>`.
    """
    rows = _rows(params.to(torch.float32) if isinstance(params, Tensor) else params)  # NxDI checks in fp32
    unwrap(
        sampling_params_core.validate_sampling_params(rows, _global_topk(on_device_sampling_config)),
        "Invalid sampling parameters",
    )


def infer_sampling_params(params: Tensor) -> Tensor:
    """`params` [B, 3] with every temperature-0 row made greedy: top_k 1 and top_p 1 (temperature stays 0).

    Returns a new tensor of the same dtype and device; `params` is not modified (NxDI also writes
    the change into `params`; use the returned tensor, as NxDI's callers do).

    Raises:
        IncompatibleConfigError: `params` is not a [B, 3] tensor.
    """
    rows = sampling_params_core.infer_sampling_params([(k, p, t) for k, p, t in _rows(params)])
    return torch.tensor(rows, dtype=params.dtype, device=params.device).reshape(params.shape)
