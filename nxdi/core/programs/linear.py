"""Linear layers whose weight is a float tensor or a quantized one (values plus scales). Pure.

A quantized weight (`quantized=True`, see `nxdi.core.host.quant`) reaches a program as
`QuantizedWeight(values, scale)`: `values` [N, K] in int8 or float8 exactly as the quantized
checkpoint stores them, and one float scale per output row (per-tensor scales are expanded to rows
by the weight plan, so fused Q/K/V with three per-tensor scales is one weight) or, blockwise, one
per block. `linear` dequantizes as NxD does (values and scales multiplied in float32, then cast to
the activation dtype) and multiplies; the traced graph therefore holds the 1-byte values, and a
backend may replace the dequantize-then-multiply pattern by a fused kernel (the CPU backend does,
for int8 rows scales with bf16 activations: `nxdi.effects.backends.cpu_passes`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class QuantizedWeight:
    """A linear weight stored quantized."""

    values: Tensor
    """[N, K] int8, float8_e4m3fn or float8_e5m2."""
    scale: Tensor
    """[N] (one per output row) or [N / bn, K / bk] (one per block of a blockwise scheme), float."""


Weight = Tensor | QuantizedWeight
"""What a program's linear layer takes."""


def dequantize(w: QuantizedWeight, dtype: torch.dtype) -> Tensor:
    """The float weight [N, K] in `dtype`: `values * scale` computed in float32 (NxD's `scale_dequantize`)."""
    values, scale = w.values.to(torch.float32), w.scale.to(torch.float32)
    if scale.dim() == 1:
        return (values * scale[:, None]).to(dtype)
    bn, bk = values.shape[0] // scale.shape[0], values.shape[1] // scale.shape[1]
    blocks = values.view(scale.shape[0], bn, scale.shape[1], bk) * scale[:, None, :, None]
    return blocks.reshape(values.shape).to(dtype)


def linear(x: Tensor, w: Weight, bias: Tensor | None = None) -> Tensor:
    """`x @ w.T + bias` for x [..., K] and a float or quantized weight [N, K] -> [..., N]."""
    if isinstance(w, QuantizedWeight):
        w = dequantize(w, x.dtype)
    return F.linear(x, w, bias)
