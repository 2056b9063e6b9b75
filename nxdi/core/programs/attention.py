"""Self-attention of the decoder program: the fused-QKV attention block, its masks and RoPE tables. Pure.

`attend` runs one layer's attention over this rank's heads against a contiguous cache view, a
flash-decoding sequence shard (`nxdi.core.programs.flash_decoding`) or a block cache
(`nxdi.core.programs.block_kv`); `masks` / `block_masks` build each layer's mask once per distinct
sliding window; `rope_tables` each layer's cos/sin tables, once per distinct RoPE (Gemma 3's
sliding-window layers have their own).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from nxdi.core.model_spec import ModelSpec, PositionKind, RopeSpec
from nxdi.core.planning.partition import Partition
from nxdi.core.programs import block_kv, flash_decoding, kv_cache, layers, token_tree
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.core.programs.collectives import Collectives
from nxdi.core.programs.linear import Weight, linear
from nxdi.core.programs.token_tree import TreeInputs


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class Attention:
    """Self-attention weights of one layer. Linear weights are [out, in]; absent optional parts are None."""

    qkv: Weight
    """[(H + 2K) * D, E]: Q, K and V projections fused (the one layout; the weight plan fuses)."""
    o: Weight
    """[E, H * D]"""
    qkv_bias: Tensor | None = None
    o_bias: Tensor | None = None
    q_norm: Tensor | None = None
    """[D] per-head RMSNorm of q and k before RoPE (`spec.qk_norm`; with `spec.norm_offset`, scaled by 1 + w)."""
    k_norm: Tensor | None = None


def attend(
    w: Attention,
    x: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    rope: tuple[Tensor, Tensor] | None,
    mask: Tensor | None,
    window: int | None,
    slots: Tensor,
    spec: ModelSpec,
    part: Partition,
    coll: Collectives,
    blocks: BlockInputs | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Self-attention over this rank's heads of normed x [N, E] (N = B*S).

    `keep` [B, R] (not with flash decoding): the tokens whose output is
    wanted. Every token's keys and values are still written; the queries, the attention and the
    o_proj run for those R tokens only, and the output is [B*R, E] in `keep`'s order.

    Returns this rank's partial output [N, E] (summed over ranks, plus the o_proj bias when there
    are several, it is the attention output) and the written k/v caches [B, K_r, T, D] (with flash
    decoding, this rank's share of the sequence: [B, 1, T_l, D]).
    """
    b, s = slots.shape
    h, kh, d = part.q_heads, part.kv_heads, spec.head_dim
    qkv = linear(x, w.qkv, w.qkv_bias)  # [N, (H_r + 2 K_r) * D]
    if spec.clip_qkv is not None:  # DBRX clamps q, k and v together, before RoPE (transformers' order)
        qkv = qkv.clamp(-spec.clip_qkv, spec.clip_qkv)
    qkv = qkv.view(b, s, h + 2 * kh, d)
    v = qkv[:, :, h + kh :]
    if rope is None:  # positions enter elsewhere (learned, ALiBi)
        q, k = qkv[:, :, :h], qkv[:, :, h : h + kh]
    elif spec.rotary_dim is not None:  # partial rotary: the first rotary_dim dims of each head turn
        qk = qkv[:, :, : h + kh]
        r = spec.rotary_dims
        qk = torch.cat((layers.apply_rope(qk[..., :r], *rope), qk[..., r:]), dim=-1)
        q, k = qk[:, :, :h], qk[:, :, h:]
    elif spec.qk_norm:
        assert w.q_norm is not None and w.k_norm is not None, "qk_norm needs q_norm and k_norm weights"
        q = layers.rms_norm(qkv[:, :, :h], w.q_norm, spec.norm_eps, offset=spec.norm_offset)
        k = layers.rms_norm(qkv[:, :, h : h + kh], w.k_norm, spec.norm_eps, offset=spec.norm_offset)
        q, k = layers.apply_rope(q, *rope), layers.apply_rope(k, *rope)
    else:  # q and k heads roped together: the same elementwise ops, half the calls
        qk = layers.apply_rope(qkv[:, :, : h + kh], *rope)
        q, k = qk[:, :, :h], qk[:, :, h:]
    dtype = q.dtype
    if keep is not None:
        assert part.kv_group == 1 and mask is not None, "keep: a step with a folded mask"
        q = q.gather(1, keep[:, :, None, None].expand(b, keep.shape[1], h, d))
        mask = _kept_rows(mask, keep, h // kh)
    # scores, softmax and mix in fp32 (GPT-J); the cache is read as fp32
    q = layers.at_least_fp32(q) if spec.attention_upcast else q
    if blocks is not None:
        assert mask is not None, "a block step has a mask per layer"
        o, k_cache, v_cache = _block_attention(q, k, v, k_cache, v_cache, mask, blocks, scale=spec.attention_scale)
    elif part.kv_group > 1:
        o, k_cache, v_cache = flash_decoding.attend(
            q,
            k,
            v,
            k_cache,
            v_cache,
            slots=slots,
            window=window,
            group=part.kv_group,
            coll=coll,
            scale=spec.attention_scale,
        )
    else:
        assert mask is not None, "without flash decoding every layer has a mask"
        k_cache = kv_cache.write(k_cache, k.transpose(1, 2), slots)
        v_cache = kv_cache.write(v_cache, v.transpose(1, 2), slots)
        o = layers.attend(q, k_cache, v_cache, mask, scale=spec.attention_scale)  # [B, S, H_r*D]
    o = o.to(dtype)
    bias = w.o_bias if part.tp == 1 else None  # with ranks, the bias is added once, after the sum
    return linear(o.view(-1, h * d), w.o, bias), k_cache, v_cache  # this rank's share of [N, E]


def _kept_rows(mask: Tensor, keep: Tensor, groups: int) -> Tensor:
    """The rows of a folded mask [B, 1, G*S, T] (`layers.fold_mask`) of the tokens `keep` [B, R]: [B, 1, G*R, T]."""
    b, _, gs, t = mask.shape
    r = keep.shape[1]
    rows = keep[:, None, None, :, None].expand(b, 1, groups, r, t)
    return mask.reshape(b, 1, groups, gs // groups, t).gather(3, rows).reshape(b, 1, groups * r, t)


def _block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    mask: Tensor,
    blocks: BlockInputs,
    *,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of q [B, S, H, D] over the segments' cached prefixes and this step's k, v [B, S, K, D];
    then the step's keys and values written at their slots. Returns [B, S, H*D] and the caches.

    This step's keys pass through the cache dtype (a float8 cache's saturating cast included), as
    they would if they were read back from the cache, so a block step computes what a contiguous one does."""
    ks, vs = kv_cache.store(k, k_cache.dtype), kv_cache.store(v, v_cache.dtype)
    keys = torch.cat((block_kv.gather(k_cache, blocks.block_table), ks.transpose(1, 2)), dim=2)
    values = torch.cat((block_kv.gather(v_cache, blocks.block_table), vs.transpose(1, 2)), dim=2)
    o = layers.attend(q, keys, values, mask, scale=scale)
    return o, block_kv.write(k_cache, ks, blocks.slot_mapping), block_kv.write(v_cache, vs, blocks.slot_mapping)


def masks(
    slots: Tensor, length: int, spec: ModelSpec, part: Partition, *, tree: TreeInputs | None = None
) -> list[Tensor | None]:
    """Each layer's attention mask [B, 1, G*S, T]; layers with the same window share one tensor.
    None with flash decoding, which masks by the positions each rank holds. With `tree` (a token-tree
    step, `token_tree.visible`) a token sees the cached prefix and the step's tokens the tree allows."""
    if part.kv_group > 1:
        assert tree is None, "flash decoding does not run token trees (checked by the configuration)"
        return [None] * spec.num_layers
    groups = part.q_heads // part.kv_heads
    built: dict[int | None, Tensor] = {}
    out: list[Tensor | None] = []
    for i in range(spec.num_layers):
        window = spec.layer_window(i)
        if window not in built:
            seen = (
                layers.visible_mask(slots, length, window=window)
                if tree is None
                else token_tree.visible(slots, tree, length, window=window)
            )
            built[window] = layers.fold_mask(seen, groups)
        out.append(built[window])
    return out


def alibi_slopes(heads: int) -> Tensor:
    """[heads] fp32: BLOOM's ALiBi slopes, a geometric sequence for the largest power of two of heads
    and, past it, every other slope of the sequence twice as long (the ALiBi paper's rule)."""
    closest = 2 ** math.floor(math.log2(heads))

    def powers(base: float, exponents: range) -> Tensor:  # in fp32, as BLOOM computes them
        return torch.pow(torch.tensor(base, dtype=torch.float32), torch.tensor(exponents, dtype=torch.int32))

    slopes = powers(2 ** (-(2 ** -(math.log2(closest) - 3))), range(1, closest + 1))
    if closest == heads:
        return slopes
    extra = powers(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), range(1, 1 + 2 * min(closest, heads - closest), 2))
    return torch.cat((slopes, extra))


def alibi_masks(
    masks: list[Tensor | None], spec: ModelSpec, part: Partition, coll: Collectives, dtype: torch.dtype
) -> list[Tensor | None]:
    """The layers' boolean masks [B, 1, S, T] as ALiBi's additive ones [B, H_r, S, T] in `dtype`:
    `slope(head) * t` for a visible slot t (slot t holds position t: softmax ignores the query's own
    offset), -inf elsewhere. Every query head has its own kv head (MHA), so masks are not folded.
    Under tensor parallelism rank r holds heads r*H_r .. r*H_r + H_r - 1 (the heads divide tp,
    which the configuration checks)."""
    device = next(m.device for m in masks if m is not None)  # constants made where the step runs (XLA)
    slopes = alibi_slopes(spec.num_attention_heads).to(device)
    if part.tp > 1:
        own = coll.rank().to(device) * part.q_heads + torch.arange(part.q_heads, device=device)
        slopes = slopes.index_select(0, own)
    built: dict[int, Tensor] = {}
    out: list[Tensor | None] = []
    for m in masks:
        assert m is not None, "ALiBi runs without flash decoding (checked by the configuration)"
        if id(m) not in built:
            t = torch.arange(m.shape[-1], dtype=torch.float32, device=device)
            bias = (slopes[:, None] * t)[None, :, None, :].to(dtype)  # [1, H_r, 1, T]
            built[id(m)] = torch.where(m, bias, float("-inf"))
        out.append(built[id(m)])
    return out


def block_masks(
    positions: Tensor, blocks: BlockInputs, block_size: int, spec: ModelSpec, part: Partition
) -> list[Tensor | None]:
    """Each layer's mask over `[prefixes | this step]` [B, 1, G*S, R*P + S]; one per distinct window."""
    groups = part.q_heads // part.kv_heads
    built: dict[int | None, Tensor] = {}
    for i in range(spec.num_layers):
        window = spec.layer_window(i)
        if window not in built:
            seen = block_kv.visible(positions, blocks, block_size=block_size, window=window)
            built[window] = layers.fold_mask(seen, groups)
    return [built[spec.layer_window(i)] for i in range(spec.num_layers)]


def rope_tables(
    positions: Tensor, seq_len: Tensor, spec: ModelSpec, dtype: torch.dtype
) -> list[tuple[Tensor, Tensor] | None]:
    """Each layer's cos and `layers.signed_sin` [B, S, 1, R] at `positions` [B, S] (R: the rotated
    dims, `spec.rotary_dims`); layers with the same RoPE (`spec.layer_rope`) share one pair; None for
    every layer of a model without RoPE. `seq_len`: the longest real sequence (dynamic NTK)."""
    if spec.position is not PositionKind.ROPE:
        return [None] * spec.num_layers
    built: dict[RopeSpec, tuple[Tensor, Tensor]] = {}
    out: list[tuple[Tensor, Tensor] | None] = []
    for i in range(spec.num_layers):
        rope = spec.layer_rope(i)
        assert rope is not None, "a rotary model has a RoPE"
        if rope not in built:
            cos, sin = layers.rope_cos_sin(
                rope,
                positions,
                head_dim=spec.rotary_dims,
                max_positions=spec.max_position_embeddings,
                dtype=dtype,
                seq_len=seq_len,
            )
            built[rope] = (cos[:, :, None], layers.signed_sin(sin)[:, :, None])
        out.append(built[rope])
    return out
