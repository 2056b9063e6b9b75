"""The sampler program: greedy argmax, or top-k / top-p / temperature sampling per row. Pure.

Theory of operation (REFERENCE §7, with the Hugging Face top-p rule of §15):
1. Candidates: the `global_topk` largest logits per row, sorted (all V when 0 or >= V).
2. Per row, from `params` [B, 3] = (top_k, top_p, temperature): temperature 0 means greedy (top_k
   becomes 1); top_k <= 0 means no top-k limit; logits are divided by the temperature; candidates
   past top_k are dropped; top-p keeps the smallest prefix whose probability reaches top_p (the
   token that crosses top_p is kept, as in Hugging Face).
3. Draw: the candidate where the normalised cumulative probability first reaches the row's
   uniform `u` in [0, 1). `u` is an input drawn by the caller from a seeded `torch.Generator`;
   deterministic sampling passes 0.5. No global RNG is touched.
"""

from __future__ import annotations

import torch
from torch import Tensor


def greedy(logits: Tensor) -> Tensor:
    """argmax token per row: logits [B, V] -> [B] int64."""
    return torch.argmax(logits, dim=-1)


def candidates(logits: Tensor, *, global_topk: int) -> tuple[Tensor, Tensor]:
    """The `global_topk` largest logits per row, descending, and their token ids: both [B, C]."""
    v = logits.shape[-1]
    c = v if global_topk <= 0 else min(global_topk, v)
    values, ids = torch.topk(logits.float(), c, dim=-1, sorted=True)
    return values, ids


def filtered_probs(logits: Tensor, params: Tensor, *, global_topk: int) -> tuple[Tensor, Tensor]:
    """Probabilities over the candidates after temperature, top-k and top-p (zeros where dropped).

    Args:
        logits: [B, V] (any float dtype; computed in fp32).
        params: [B, 3] float (top_k, top_p, temperature) per row.
        global_topk: candidates kept before the per-row top-k (0: the whole vocabulary).

    Returns:
        probs [B, C] fp32, not renormalised (the kept mass), and token ids [B, C].
    """
    values, ids = candidates(logits, global_topk=global_topk)
    c = values.shape[-1]
    top_k, top_p, temperature = params.float().unbind(-1)  # each [B]
    greedy_row = temperature <= 0
    k = torch.where(top_k <= 0, torch.full_like(top_k, c), top_k.clamp(max=c))
    k = torch.where(greedy_row, torch.ones_like(k), k)
    t = torch.where(greedy_row, torch.ones_like(temperature), temperature)
    slot = torch.arange(c, device=logits.device)[None, :]  # [1, C]
    scaled = torch.where(slot < k[:, None], values / t[:, None], torch.full_like(values, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)  # [B, C]
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the better candidates
    keep = (before < top_p[:, None]) | (top_p[:, None] >= 1) | (slot == 0)
    return torch.where(keep, probs, torch.zeros_like(probs)), ids


def sample(logits: Tensor, params: Tensor, uniforms: Tensor, *, global_topk: int = 256) -> Tensor:
    """One token per row drawn from the filtered distribution: [B] int64.

    Args:
        logits: [B, V].
        params: [B, 3] (top_k, top_p, temperature).
        uniforms: [B] in [0, 1), one draw per row (0.5 for deterministic sampling).
        global_topk: candidates before the per-row top-k.
    """
    probs, ids = filtered_probs(logits, params, global_topk=global_topk)
    cdf = torch.cumsum(probs, dim=-1)
    cdf = cdf / cdf[:, -1:]  # [B, C], last entry exactly 1
    index = (cdf < uniforms[:, None].to(cdf.dtype)).sum(dim=-1).clamp(max=probs.shape[-1] - 1)  # [B]
    return ids.gather(1, index[:, None])[:, 0]


def select(logits: Tensor, params: Tensor, uniforms: Tensor, *, do_sample: bool, global_topk: int = 256) -> Tensor:
    """The on-device sampling output: `sample` when `do_sample`, else `greedy`. [B] int64."""
    if do_sample:
        return sample(logits, params, uniforms, global_topk=global_topk)
    return greedy(logits)
