"""Flash decoding: the KV cache of one KV head split over the sequence among the ranks that share it. Pure.

Under tensor parallelism with GQA replication, the `g` ranks of a group (contiguous ranks
`r - r % g .. r - r % g + g - 1`) all hold the same single KV head. Without flash decoding each of
them caches the whole sequence; with it each caches 1/g of it, so the KV memory per rank is divided
by g (`Partition.kv_group`):

- Position p lives on the group's rank `p % g`, at local slot `p // g`; a rank's local slot j holds
  position `j * g + r % g`. A cache view of a T-slot bucket is the first `ceil(T / g)` local slots.
- Context encoding (S tokens from position 0): each rank computes the prompt's keys and values for
  its head anyway, so it attends as usual over a temporary whole-sequence cache and then keeps its
  own positions.
- Token generation: each rank scores the queries of the whole group (all-gathered) against its
  positions only, giving per head a partial output, its softmax max and its sum; the partials of
  the group are gathered and merged with the usual log-sum-exp rescaling, each rank keeping its own
  heads. Only the owner of the new token's position writes it; the others rewrite the slot's old
  value, so no garbage slot is needed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nxdi.core.programs import kv_cache, layers
from nxdi.core.programs.collectives import Collectives


def local_slots(positions: int, group: int) -> int:
    """Local cache slots a rank needs for `positions` positions shared by `group` ranks."""
    return -(-positions // group)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    slots: Tensor,
    window: int | None,
    group: int,
    coll: Collectives,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of this rank's query heads with the group's KV cache split over the sequence.

    Args:
        q: [B, S, H_r, D] this rank's roped queries; k, v: [B, S, 1, D] its KV head's new keys/values.
        k_cache, v_cache: [B, 1, T_l, D] this rank's share of the cache view (T_l local slots).
        slots: [B, S] positions the new tokens are written at.
        window: the layer's sliding window, or None.
        group: g, the ranks sharing the KV head.
        scale: the scores' scale (`ModelSpec.attention_scale`); None: 1/sqrt(D).

    Returns:
        The attention output [B, S, H_r*D] and the updated local caches.
    """
    index = coll.rank() % group  # this rank's place in its group
    if q.shape[1] > 1:
        return _context(q, k, v, k_cache, v_cache, slots=slots, window=window, group=group, index=index, scale=scale)
    return _decode(
        q, k, v, k_cache, v_cache, slots=slots, window=window, group=group, index=index, coll=coll, scale=scale
    )


def _held(local: int, group: int, index: Tensor) -> Tensor:
    """[T_l] the positions this rank's local slots hold."""
    return torch.arange(local, device=index.device) * group + index


def _context(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    slots: Tensor,
    window: int | None,
    group: int,
    index: Tensor,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    b, _, h, d = q.shape
    local = k_cache.shape[2]
    whole = local * group  # >= the bucket: every position any rank of the group holds
    shape = (b, k_cache.shape[1], whole, d)
    full_k = kv_cache.write(k_cache.new_zeros(shape), k.transpose(1, 2), slots)
    full_v = kv_cache.write(v_cache.new_zeros(shape), v.transpose(1, 2), slots)
    mask = layers.fold_mask(layers.visible_mask(slots, whole, window=window), h // k_cache.shape[1])
    o = layers.attend(q, full_k, full_v, mask, scale=scale)
    held = _held(local, group, index)
    return o, full_k.index_select(2, held), full_v.index_select(2, held)


def _decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    slots: Tensor,
    window: int | None,
    group: int,
    index: Tensor,
    coll: Collectives,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    b, _, h, d = q.shape
    local = k_cache.shape[2]
    owner = (slots % group) == index  # [B, 1]
    where = slots // group  # [B, 1] the local slot of the new position (on its owner)
    k_cache = _write_owned(k_cache, k.transpose(1, 2), where, owner)
    v_cache = _write_owned(v_cache, v.transpose(1, 2), where, owner)

    first = coll.rank() - index  # the group's first rank
    heads = torch.arange(group * h, device=q.device) + first * h
    queries = layers.at_least_fp32(coll.all_gather(q, 2).index_select(2, heads)[:, 0])  # [B, g*H_r, D]
    keys, values = layers.at_least_fp32(k_cache[:, 0]), layers.at_least_fp32(v_cache[:, 0])  # [B, T_l, D]
    scores = torch.einsum("bhd,btd->bht", queries, keys)
    scores = scores / math.sqrt(d) if scale is None else scores * scale
    held = _held(local, group, index)[None, None, :]  # [1, 1, T_l]
    p = slots[:, :, None]  # [B, 1, 1]
    visible = held <= p
    if window is not None:
        visible = visible & (p - held < window)
    # Hidden slots score the lowest finite value (not -inf), so a rank holding no visible slot
    # gets finite partials that the mask zeroes; it then contributes nothing to the merge.
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    top = scores.amax(-1, keepdim=True)  # [B, g*H_r, 1]
    weights = torch.exp(scores - top) * visible
    partial = torch.cat((weights @ values, top, weights.sum(-1, keepdim=True)), dim=-1)  # [B, g*H_r, D+2]

    members = torch.arange(group, device=q.device) + first
    gathered = coll.all_gather(partial[None], 0).index_select(0, members)  # [g, B, g*H_r, D+2]
    mine = gathered.index_select(2, torch.arange(h, device=q.device) + index * h)  # [g, B, H_r, D+2]
    out, tops, sums = mine[..., :d], mine[..., d : d + 1], mine[..., d + 1 :]
    rescale = torch.exp(tops - tops.amax(0, keepdim=True))  # [g, B, H_r, 1]
    o = (rescale * out).sum(0) / (rescale * sums).sum(0)  # [B, H_r, D]
    return o.to(q.dtype).reshape(b, 1, h * d), k_cache, v_cache


def _write_owned(cache: Tensor, new: Tensor, where: Tensor, owner: Tensor) -> Tensor:
    """`cache` [B, K, T_l, D] with `new` [B, K, 1, D] written at local slot `where` [B, 1] of the
    rows whose token this rank owns; the other rows rewrite the slot's old value."""
    b, kh, _, d = new.shape
    index = where[:, None, :, None].expand(b, kh, 1, d)
    old = kv_cache.gather(cache, 2, index)
    keep = owner[:, None, :, None]
    return kv_cache.scatter(cache, 2, index, torch.where(keep, kv_cache.store(new, cache.dtype), old))
