"""Routing near-ties of a mixture of experts: where bf16 may rightly pick other experts than fp32.

A token whose k-th and (k+1)-th router logits (k = experts per token) lie closer than bf16 can
tell apart is routed by rounding: nxdi in bf16 may take the other expert (transformers in bf16
may too, or not, by chance), and that token's logits then differ from the fp32 golden by far more
than bf16 noise. An accuracy check of an MoE family compares every other position at the
reference's tolerances and accepts a failure only at such a token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

NEAR_TIE = 2.0**-7
"""A router-logit gap below one bf16 step at magnitudes 1 to 2 (where these routers' logits lie)."""


def routing_margins(model: Any, ids: Tensor, mask: Tensor, k: int) -> Tensor:
    """[B, T]: per token of `ids` (run through the fp32 transformers `model` with `mask`), the
    smallest gap over layers between its k-th and (k+1)-th router logit."""
    routers = [m for n, m in model.named_modules() if n.endswith((".mlp.gate", ".ffn.router"))]
    assert routers, "no router modules found"
    gaps: list[Tensor] = []

    def hook(module: Any, args: tuple[Tensor, ...]) -> None:
        weight = module.weight if hasattr(module, "weight") else module.layer.weight
        logits = args[0].float().reshape(-1, weight.shape[-1]) @ weight.float().T  # [B*T, X]
        top = logits.topk(k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).reshape(ids.shape))

    handles = [r.register_forward_pre_hook(hook) for r in routers]
    try:
        with torch.no_grad():
            model.float()(ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    assert len(gaps) == len(routers)
    return torch.stack(gaps).min(dim=0).values


def near_ties(model: Any, sequences: Tensor, prompt_mask: Tensor, k: int) -> set[tuple[int, int]]:
    """(row, position) of the checked positions (position i: the logits after the prompt's last
    token and i generated ones) whose token is routed at a near-tie. `sequences` [B, W + N] are the
    left-padded prompts [B, W] (`prompt_mask`) followed by the golden tokens."""
    width = prompt_mask.shape[1]
    mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, width:])], dim=1)
    margins = routing_margins(model, sequences, mask, k)
    return {
        (row, t - (width - 1))
        for row in range(sequences.shape[0])
        for t in range(width - 1, sequences.shape[1])
        if margins[row, t] < NEAR_TIE
    }
