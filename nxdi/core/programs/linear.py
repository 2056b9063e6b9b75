"""Linear layers whose weight is a float tensor or a quantized one (values plus scales). Pure.

A quantized weight (`quantized=True`, see `nxdi.core.host.quant`) reaches a program as
`QuantizedWeight(values, scale)`: `values` [N, K] in int8 or float8 exactly as the quantized
checkpoint stores them, and one float scale per output row (per-tensor scales are expanded to rows
by the weight plan, so fused Q/K/V with three per-tensor scales is one weight) or, blockwise, one
per block. `linear` dequantizes as NxD does (values and scales multiplied in float32, then cast to
the activation dtype) and multiplies; the traced graph therefore holds the 1-byte values, and a
backend may replace the dequantize-then-multiply pattern by a fused kernel (the CPU backend does,
for int8 rows scales with bf16 activations: `nxdi.effects.backends.cpu_passes`).

A linear layer that carries LoRA adapters (`nxdi.core.programs.lora`) reaches `linear` as a
`LoraLinear`: its base weight plus each batch row's own adapter matrices, already selected for
the step, so one batched product adds every row's adapter at once.
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


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class LoraLinear:
    """A base weight plus one LoRA adapter per batch row: `y = x W^T + B_b (A_b x)` for row b.

    The output may be made of parts (the fused QKV projection's Q, K and V rows), each with its own
    B or none: part j's B reads rank rows j*R..(j+1)*R of A among the parts that have one."""

    base: Tensor | QuantizedWeight
    """[N, K] the layer's own weight."""
    a: Tensor
    """[B, R * m, K] each row's A, m parts' side by side (its scaling folded in; ranks zero-padded to R)."""
    b: tuple[Tensor | None, ...]
    """Per output part, [B, N_j, R] each row's B (zero columns past its rank), or None: no adapter
    on that part, which gets zeros."""
    widths: tuple[int, ...]
    """N_j of every part (they sum to N)."""


Weight = Tensor | QuantizedWeight | LoraLinear
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
    """`x @ w.T + bias` for x [..., K] and a float or quantized weight [N, K] -> [..., N].

    With a `LoraLinear`, x's leading dims flatten to [B, S] rows of the adapters' batch B (x [B*S, K]
    as the decoder passes it, or [B, S, K]), and each row adds its adapter's `B (A x)`."""
    if isinstance(w, LoraLinear):
        return linear(x, w.base, bias) + _lora_delta(x, w)
    if isinstance(w, QuantizedWeight):
        w = dequantize(w, x.dtype)
    return F.linear(x, w, bias)


def _lora_delta(x: Tensor, w: LoraLinear) -> Tensor:
    """Every row's `B (A x)` [..., N] for x [..., K] (leading dims B*S or [B, S])."""
    b = w.a.shape[0]
    rows = x.reshape(b, -1, x.shape[-1])  # [B, S, K]
    low = torch.bmm(rows, w.a.transpose(1, 2))  # [B, S, R * m]
    chunks = iter(low.split(low.shape[-1] // sum(part is not None for part in w.b), dim=-1))  # m of [B, S, R]
    parts = [
        torch.bmm(next(chunks), part.transpose(1, 2)) if part is not None else low.new_zeros(b, low.shape[1], width)
        for part, width in zip(w.b, w.widths, strict=True)
    ]  # [B, S, N_j] each
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [B, S, N]
    return delta.reshape(*x.shape[:-1], delta.shape[-1])
