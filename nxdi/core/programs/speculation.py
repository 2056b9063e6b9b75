"""Speculative decoding's verification step: which draft tokens the target accepts. Pure.

Theory of operation (Leviathan et al. 2023; Chen et al. 2023):
1. Setting. A draft model proposed k-1 tokens d_1..d_{k-1} per row, and the target ran one step
   over the k inputs [last, d_1, ..., d_{k-1}], so target position i scores the token after input
   i. A row emits between 1 and k tokens: an accepted prefix d_1..d_n, then one token of the
   target's own (a correction when n < k-1, the bonus token when n = k-1). Rows accept different
   counts, so the outputs keep static shapes: tokens [B, k] padded past each row's count, and
   counts [B] = n + 1. Nothing here branches on data, so the functions trace for XLA.
2. Greedy (`greedy_accept`): n counts the leading positions whose target argmax equals the draft
   token, and the last emitted token is the target's argmax at position n.
3. Sampling (`sample_accept`), on distributions p [B, k, V] (target) and q [B, k-1, V] (the
   draft's, each d_{i+1} drawn from q_i): d_{i+1} is accepted with probability
   min(1, p_i(d)/q_i(d)), tested as `u_i * q_i(d) < p_i(d)`. Multiplying instead of dividing
   means q(d) = 0 never divides by zero: it accepts when p(d) > 0 (the ratio is infinite) and
   rejects when p(d) = 0. At the first rejection j the token is drawn from
   norm(max(0, p_j - q_j)); after k-1 acceptances, from p_{k-1}. Each emitted token is then
   distributed exactly as the target alone would sample it. The residual is all zero only when
   p_j == q_j, where a rejection needs q_j(d) = 0 = p_j(d); the draw then falls back to p_j.
4. Randomness is an input: `uniforms` [B, k] in [0, 1), drawn by the caller from a seeded
   `torch.Generator`. Column i < k-1 tests d_{i+1}; column k-1 is the row's one final draw (a row
   draws exactly once, at its first rejection or for the bonus token).
5. Draws (`draw`) are inverse-CDF in vocabulary order and count `cdf <= u`, so a token of
   probability 0 (a flat step of the CDF) is never drawn: the residual is sparse.
   `sampling.sample` counts `cdf < u` instead, which is safe there because its first sorted
   candidate always has mass.
6. Distributions come from `probs`: the sampler's temperature / top-k / top-p
   (`sampling.filtered_probs`), scattered back to the whole vocabulary and normalised. At
   temperature 0 p is one-hot, and `sample_accept` gives `greedy_accept`'s result for any q.

Afterwards the target's cache is valid for the inputs last, d_1..d_n (counts of them, from the
step's first position): the next step feeds each row's last emitted token at its first position
plus its count, and overwrites the rejected drafts' entries from there on.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nxdi.core.programs import sampling

PAD = -1
"""Default filler for tokens past a row's count (not a vocabulary id)."""


def probs(logits: Tensor, params: Tensor, *, global_topk: int = 256) -> Tensor:
    """The sampler's distribution over the whole vocabulary, normalised: [B, ..., V] fp32.

    Args:
        logits: [B, ..., V], e.g. target logits [B, k, V] (any float dtype; computed in fp32).
        params: [B, 3] (top_k, top_p, temperature) per row, shared by every position of the row.
        global_topk: candidates before the per-row top-k. Pass the value the ordinary sampler
            uses, so speculation keeps its distribution (`sampling.sample` defaults to 256).

    Temperature 0 gives the one-hot argmax.
    """
    b, v = logits.shape[0], logits.shape[-1]
    n = math.prod(logits.shape[1:-1])  # positions per row (not reshape's -1: it fails when N = 0)
    rows = params[:, None, :].expand(b, n, params.shape[-1]).reshape(b * n, params.shape[-1])  # [B*N, 3]
    kept, ids = sampling.filtered_probs(logits.reshape(b * n, v), rows, global_topk=global_topk)  # [B*N, C]
    kept = kept / kept.sum(dim=-1, keepdim=True)  # > 0: the best candidate is always kept
    full = torch.zeros(b * n, v, dtype=kept.dtype, device=kept.device).scatter(1, ids, kept)
    return full.reshape(logits.shape)


def draw(dist: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draw per row: dist [..., V], uniforms [...] in [0, 1) -> token ids [...] int64.

    `dist` need not be normalised but must have positive mass. A token of probability 0 is never
    drawn. Uniforms are compared in their own precision (a float64 u just below 1 would round to
    1.0 in fp32 and select past the last token with mass).
    """
    cdf = torch.cumsum(dist, dim=-1)
    cdf = cdf / cdf[..., -1:]  # last entry exactly 1, so u < 1 always lands on a token
    index = (cdf <= uniforms[..., None]).sum(dim=-1)
    return index.clamp(max=dist.shape[-1] - 1)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) over the last dim, or p where that is all zero (p == q): [..., V]."""
    r = (p - q).clamp(min=0)
    mass = r.sum(dim=-1, keepdim=True)
    positive = mass > 0
    return torch.where(positive, r / torch.where(positive, mass, torch.ones_like(mass)), p)


def greedy_accept(target_logits: Tensor, draft: Tensor, *, pad: int = PAD) -> tuple[Tensor, Tensor]:
    """Greedy verification: the draft prefix the target's argmax agrees with, then its own token.

    Args:
        target_logits: [B, k, V]; position i scores the token after input i.
        draft: [B, k-1] int64, the proposed tokens d_1..d_{k-1}.
        pad: the filler past each row's count.

    Returns:
        tokens [B, k] int64 (d_1..d_n, the argmax at position n, then `pad`) and counts [B]
        int64 = n + 1, in 1..k.
    """
    best = sampling.greedy(target_logits)  # [B, k]
    n = _leading(best[:, :-1] == draft)  # [B]
    return _emit(draft, n, best.gather(1, n[:, None])[:, 0], pad)


def sample_accept(p: Tensor, q: Tensor, draft: Tensor, uniforms: Tensor, *, pad: int = PAD) -> tuple[Tensor, Tensor]:
    """Speculative sampling: emitted tokens are distributed as sampling the target alone.

    Args:
        p: [B, k, V] target distributions (from `probs`), position i after input i.
        q: [B, k-1, V] draft distributions; d_{i+1} was drawn from q_i.
        draft: [B, k-1] int64, the proposed tokens.
        uniforms: [B, k] in [0, 1): column i < k-1 tests d_{i+1}, column k-1 is the final draw.
        pad: the filler past each row's count.

    Returns:
        tokens [B, k] int64 and counts [B] int64 in 1..k, as `greedy_accept`. Never NaN, also when
        q(d) = 0 or p == q.
    """
    q = q.to(p.dtype)
    pd = p[:, :-1].gather(2, draft[..., None])[..., 0]  # [B, k-1], p_i(d_{i+1})
    qd = q.gather(2, draft[..., None])[..., 0]  # [B, k-1], q_i(d_{i+1})
    n = _leading(uniforms[:, :-1] * qd < pd)  # [B]
    # A zero draft distribution after the last position makes residual(p_{k-1}, 0) = p_{k-1}: the
    # bonus token needs no branch of its own. Only position n's residual is built.
    q_pad = torch.cat((q, torch.zeros_like(p[:, :1])), dim=1)  # [B, k, V]
    at = n[:, None, None].expand(-1, 1, p.shape[-1])  # [B, 1, V]
    dist = residual(p.gather(1, at), q_pad.gather(1, at))[:, 0]  # [B, V]
    return _emit(draft, n, draw(dist, uniforms[:, -1]), pad)


def _leading(ok: Tensor) -> Tensor:
    """The number of leading True entries per row: ok [B, k-1] bool -> [B] int64."""
    # Counted as the entries before the first False (a cumsum of the misses), not as a cumprod of
    # the hits: torch-xla 2.9 crashes lowering an integer cumprod (fused speculation lowers this).
    return ((~ok).long().cumsum(dim=1) == 0).sum(dim=1)


def _emit(draft: Tensor, n: Tensor, last: Tensor, pad: int) -> tuple[Tensor, Tensor]:
    """tokens [B, k]: draft[:, :n], then `last` [B], then `pad`; counts n + 1."""
    b, k = draft.shape[0], draft.shape[1] + 1
    slot = torch.arange(k, device=draft.device)[None, :]  # [1, k]
    padded = torch.cat((draft, draft.new_full((b, 1), pad)), dim=1)  # [B, k]
    after = torch.where(slot == n[:, None], last[:, None], torch.full_like(padded, pad))
    return torch.where(slot < n[:, None], padded, after), n + 1
