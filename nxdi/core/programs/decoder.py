"""The decoder program: Llama and every family that is Llama plus ModelSpec fields. Pure.

Covers RoPE (every scaling kind), GQA, tied embeddings, mixtures of experts (`nxdi.core.programs.moe`;
each expert split along its intermediate width, the experts over expert groups of ranks), sliding windows (`spec.sliding_window`, per
layer with `spec.full_attention_layers`), projection biases (`spec.qkv_bias`, `o_bias`,
`mlp_bias`), per-head q/k RMSNorm (`spec.qk_norm`), an explicit `spec.head_dim`, RMSNorm or
bias-free LayerNorm (`spec.norm`), clamped q/k/v (`spec.clip_qkv`), and Gemma's parts (`1 + w`
norms, norms around the attention and MLP outputs, scaled embeddings, a per-layer RoPE, an
attention scale, soft-capped logits), and the pre-Llama families' parts (LayerNorm with a bias,
before or after each block (`spec.post_layer_norm`), a plain MLP, learned positions, ALiBi,
partial rotary, a parallel residual with one norm or two, an embedding norm, an lm_head bias,
fp32 attention: see `ModelSpec`): every difference between the families it
runs is a field of the `ModelSpec`, decided when the program is traced, never from tensor values;
a family that does not ask for a feature runs no op for it. The weights come in one layout (fused
QKV), built from the family's weight table by `weights_from_slots`. Self-attention lives in
`nxdi.core.programs.attention`.

One step, context encoding or token generation alike (the shapes say which):
    h = embed[input_ids]                                   [B*S, E]
    (+ learned positions[position + offset]; then normed, with `spec.embed_norm`)
    per layer: h += o(attn(rope(q), cache <- rope(k), v))  then  h += down(act(gate h) * up h)
               (with the inputs normed; Gemma also norms both outputs before the residual adds;
               post-norm layers norm h after each add; a parallel residual adds both to the
               layer's input; a plain MLP is down(act(up h)); ALiBi biases the scores instead of RoPE)
    logits = lm_head(norm(h at last_index))                [B, 1, V] fp32 (or [B, S, V])
Keys/values are written into the cache view at each token's slot before attention reads it, so
the current token attends to itself; the mask allows slots `<= position` (within the sliding
window), which is causal attention inside a prompt and "everything cached so far" in decoding.

`forward_outputs` (what a compiled step runs) also returns, for a mixture of experts whose MoENeuronConfig asks for them
(`return_router_logits`, `return_expert_index`: `moe_settings.routing_outputs`) also returns every
layer's router logits and chosen experts for every token of the step, padding included. The router
is replicated, so every rank returns the same values, and under sequence parallelism the experts
see the gathered tokens, so these are always the whole [B*S] rows.

For EAGLE (`nxdi.core.programs.eagle`) a step can also return every token's final hidden state
(`hidden=True`) and start from given embeddings (`inputs_embeds`); a layer without `input_norm`
and weights without a final `norm` skip those norms (an EAGLE draft's).

Over 400 lines because it is the one forward pass every family and every step kind shares
(contiguous, block, token-tree and EAGLE steps): split, one pass would be read across files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nxdi.core.model_spec import MlpKind, ModelSpec, NormKind, PositionKind
from nxdi.core.planning.partition import Partition
from nxdi.core.programs import attention, inputs, layers, moe, moe_settings
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.linear import QuantizedWeight, Weight, linear
from nxdi.core.programs.token_tree import TreeInputs
from nxdi.core.weight_table import SCALE_SUFFIX, TKG_MLP_SLOT

HIDDEN = "hidden"
"""The extra output `forward_outputs(hidden=True)` adds: every token's final hidden state [B, S, E]."""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class GatedMLP:
    """`down(act(gate x) * up x)`: gate, up [F, E], down [E, F], optional biases."""

    gate: Weight
    up: Weight
    down: Weight
    gate_bias: Tensor | None = None
    up_bias: Tensor | None = None
    down_bias: Tensor | None = None


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class PlainMLP:
    """`down(act(up x))`: up [F, E], down [E, F], optional biases (GPT-2, OPT, BLOOM, GPT-J, GPT-NeoX)."""

    up: Weight
    down: Weight
    up_bias: Tensor | None = None
    down_bias: Tensor | None = None


MLP = GatedMLP | PlainMLP | moe.Experts
"""The feed-forward block of a layer, one case per `ModelSpec.mlp_kind` (a `match` in `_mlp`)."""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class Layer:
    """One decoder layer."""

    input_norm: Tensor | None
    """[E]; None: the attention reads the residual stream unnormed (an EAGLE draft's layers). With
    `spec.post_layer_norm`, the norm of the residual after the attention's add instead."""
    attn: attention.Attention
    post_norm: Tensor | None
    """[E] the norm of the MLP input (Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm;
    with `spec.post_layer_norm`, of the residual after the MLP's add); None with `spec.shared_layer_norm`."""
    mlp: MLP
    input_norm_bias: Tensor | None = None
    """[E] LayerNorm biases (`spec.norm_bias`)."""
    post_norm_bias: Tensor | None = None
    attn_out_norm: Tensor | None = None
    """[E] the norm of the attention output before the residual add (`spec.sandwich_norms`)."""
    mlp_out_norm: Tensor | None = None
    """[E] the norm of the MLP output before the residual add (`spec.sandwich_norms`)."""
    mlp_tkg: moe.Experts | None = None
    """Hybrid sharding: token generation's own layout of the experts (the router is `mlp`'s)."""

    def mlp_for(self, *, decode: bool) -> MLP:
        """The feed-forward weights a context-encoding or a token-generation (`decode`) step runs."""
        return self.mlp_tkg if decode and self.mlp_tkg is not None else self.mlp


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class DecoderWeights:
    """All weights of the decoder. `lm_head` may be the `embed` tensor itself (tied)."""

    embed: Tensor
    """[V, E]"""
    layers: tuple[Layer, ...]
    norm: Tensor | None
    """[E]; None: the lm_head reads the last layer's output unnormed (an EAGLE draft; `spec.final_norm` off)."""
    lm_head: Weight
    """[V, E]"""
    norm_bias: Tensor | None = None
    """[E] the final LayerNorm's bias."""
    lm_head_bias: Tensor | None = None
    """[V] (`spec.lm_head_bias`)."""
    embed_positions: Tensor | None = None
    """[P + offset, E] learned positions (`PositionKind.LEARNED`): position p reads row p + offset."""
    embed_norm: Tensor | None = None
    """[E] the LayerNorm after the token embeddings (`spec.embed_norm`)."""
    embed_norm_bias: Tensor | None = None


def _group(slots: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The slots under `prefix.`, by their remaining name."""
    return {k[len(prefix) + 1 :]: v for k, v in slots.items() if k.startswith(prefix + ".")}


def _mlp_weights(parts: Mapping[str, Any], spec: ModelSpec) -> MLP:
    match spec.mlp_kind:
        case MlpKind.GATED:
            return GatedMLP(**parts)
        case MlpKind.PLAIN:
            return PlainMLP(**parts)
        case MlpKind.MOE:
            return moe.Experts(**parts)
    raise ValueError(f"the decoder program has no {spec.mlp_kind.value} MLP (checked by programs.catalog)")


def _fold_quantized(slots: Mapping[str, Tensor]) -> dict[str, Any]:
    """Slots with a `<slot>.scale` companion (quantized linears) become one `QuantizedWeight`
    (typed Any: which fields may hold one is the weight table's `linear` flag, not a type)."""
    out: dict[str, Any] = {}
    for key, value in slots.items():
        if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in slots:
            continue
        scale = slots.get(key + SCALE_SUFFIX)
        out[key] = value if scale is None else QuantizedWeight(values=value, scale=scale)
    return out


def weights_from_slots(slots: Mapping[str, Tensor], *, spec: ModelSpec) -> DecoderWeights:
    """The weights value from slot paths (`WeightTable.slots`): `embed`, `layers.{i}.attn.qkv`, ...
    A quantized linear comes as its values at the slot and its scale at `<slot>.scale`.

    Raises:
        TypeError: a slot the table declares has no field here (a table and program out of step).
    """
    folded = _fold_quantized(slots)

    def layer(i: int) -> Layer:
        parts = _group(folded, f"layers.{i}")
        mlp = _group(parts, "mlp")
        tkg = _group(parts, TKG_MLP_SLOT)
        return Layer(
            input_norm=parts.get("input_norm"),
            attn=attention.Attention(**_group(parts, "attn")),
            post_norm=parts.get("post_norm"),
            input_norm_bias=parts.get("input_norm_bias"),
            post_norm_bias=parts.get("post_norm_bias"),
            mlp=_mlp_weights(mlp, spec),
            attn_out_norm=parts.get("attn_out_norm"),
            mlp_out_norm=parts.get("mlp_out_norm"),
            # the router (and its bias) is replicated: one copy serves both layouts
            mlp_tkg=moe.Experts(**{**mlp, **tkg}) if tkg else None,
        )

    return DecoderWeights(
        embed=folded["embed"],
        layers=tuple(layer(i) for i in range(spec.num_layers)),
        norm=folded.get("norm"),
        lm_head=folded["lm_head"],
        norm_bias=folded.get("norm_bias"),
        lm_head_bias=folded.get("lm_head_bias"),
        embed_positions=folded.get("embed_positions"),
        embed_norm=folded.get("embed_norm"),
        embed_norm_bias=folded.get("embed_norm_bias"),
    )


def _mlp(
    m: MLP,
    x: Tensor,
    spec: ModelSpec,
    part: Partition,
    coll: Collectives,
    *,
    decode: bool,
    token_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, moe.MoEOutput | None]:
    """The feed-forward block of normed x [N, E] on this rank's share of the intermediate width
    (`decode`: a token-generation step, which picks the MoE path by NxD's token-generation rule;
    `token_mask` [N] bool: the real tokens, the only ones a mixture of experts routes when set).
    Under expert parallelism every rank holds every token (x is replicated), runs its experts'
    share and the sum over ranks combines them: the dispatch is the replication, the combine the
    all-reduce the dense MLP does too.

    Returns the partial output [N, E] (to be summed over ranks), the bias to add after the sum
    (None with one rank, where it is applied inside the last linear, as transformers does), and a
    mixture of experts' routing (None for a dense MLP).
    """
    match m:
        case GatedMLP():
            after = m.down_bias if part.tp > 1 else None
            biases = (m.gate_bias, m.up_bias, m.down_bias if part.tp == 1 else None)
            return layers.gated_mlp(x, m.gate, m.up, m.down, activation=spec.activation, biases=biases), after, None
        case PlainMLP():
            after = m.down_bias if part.tp > 1 else None
            up = layers.ACTIVATION_FNS[spec.activation](linear(x, m.up, m.up_bias))
            return linear(up, m.down, m.down_bias if part.tp == 1 else None), after, None
        case moe.Experts():
            assert part.moe is not None, "a mixture of experts' partition carries its settings"
            options = moe_settings.moe_options(spec, part.moe)
            path = moe.choose_path(x.shape[0], spec.num_experts, options, token_generation=decode)
            experts, moe_tp = part.expert_layout(token_generation=decode)
            ep = experts < spec.num_experts  # expert groups: this rank's first expert follows its rank
            first = (coll.rank() // moe_tp) * experts if ep else 0
            routed = moe.forward(x, m, options, path=path, first_expert=first, token_mask=token_mask)
            return routed.hidden, None, routed


def _embed(w: DecoderWeights, ids: Tensor, spec: ModelSpec, part: Partition, coll: Collectives) -> Tensor:
    """Token embeddings [N, E] of ids [N] from this rank's share of the table."""
    if part.tp == 1:
        return F.embedding(ids, w.embed)
    if part.vocab_parallel:  # rows [V_r, E]: the owner of each id looks it up, the sum gathers them
        local = ids - coll.rank() * part.vocab
        owned = (local >= 0) & (local < part.vocab)
        rows = F.embedding(local.clamp(0, part.vocab - 1), w.embed) * owned[:, None].to(w.embed.dtype)
        return coll.all_reduce(rows)
    columns = coll.all_gather(F.embedding(ids, w.embed), -1)  # [N, E_r] per rank -> [N, E padded]
    return columns[:, : spec.hidden_size]


def token_embeddings(
    w: DecoderWeights, input_ids: Tensor, *, spec: ModelSpec, part: Partition | None = None, coll: Collectives = SINGLE
) -> Tensor:
    """The embeddings [B, S, E] a step starts from for input_ids [B, S] (scaled when `spec` asks),
    the whole hidden width on every rank: what `forward_outputs(inputs_embeds=...)` replaces."""
    part = Partition.single(spec) if part is None else part
    b, s = input_ids.shape
    return _scaled_embeddings(_embed(w, input_ids.reshape(-1), spec, part, coll), spec).view(b, s, -1)


def _norm(x: Tensor, weight: Tensor | None, spec: ModelSpec, bias: Tensor | None = None) -> Tensor:
    """The norm of x [N, E] as `spec` computes it: RMSNorm (Gemma's `1 + w` with `spec.norm_offset`)
    or LayerNorm, with a bias (GPT-2, OPT, ...) or without (DBRX)."""
    assert weight is not None, "the spec asks for a norm the weights lack"
    if spec.norm is NormKind.LAYER:
        return layers.layer_norm(x, weight, spec.norm_eps, bias)
    return layers.rms_norm(x, weight, spec.norm_eps, offset=spec.norm_offset)


def _final_norm(h: Tensor, w: DecoderWeights, spec: ModelSpec) -> Tensor:
    """h normed as the lm_head reads it; h itself for weights without a final norm (an EAGLE draft,
    OPT's post-norm variant)."""
    return h if w.norm is None else _norm(h, w.norm, spec, w.norm_bias)


def _positioned(embeds: Tensor, positions: Tensor, w: DecoderWeights, spec: ModelSpec) -> Tensor:
    """The layers' input [B, S, E]: embeddings plus learned positions (`PositionKind.LEARNED`; row
    `position + spec.position_offset`, clamped into the table for padding tokens, whose positions
    are arbitrary), then normed where `spec.embed_norm` asks (BLOOM); embeds itself otherwise."""
    if spec.position is PositionKind.LEARNED:
        assert w.embed_positions is not None, "learned positions need their table"
        rows = (positions + spec.position_offset).clamp(0, w.embed_positions.shape[0] - 1)
        embeds = embeds + F.embedding(rows, w.embed_positions)
    if spec.embed_norm:
        embeds = _norm(embeds, w.embed_norm, spec, w.embed_norm_bias)
    return embeds


def _scaled_embeddings(h: Tensor, spec: ModelSpec) -> Tensor:
    """h [N, E] times `spec.embed_scale` rounded to h's dtype first, as transformers' Gemma does (in
    bf16, sqrt(3072) = 55.43 becomes 55.5); h itself without a scale."""
    if spec.embed_scale is None:
        return h
    return h * torch.tensor(spec.embed_scale, dtype=h.dtype)


def _soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """`cap * tanh(logits / cap)` in the logits' dtype (transformers' order of ops); unchanged without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _reduce(partial: Tensor, bias: Tensor | None, coll: Collectives, part: Partition, *, b: int, sp: bool) -> Tensor:
    """Sum the ranks' partial outputs [N, E] (into this rank's sequence shard with `sp`), in
    `part.reduce_dtype` when set, then add the bias."""
    dtype = partial.dtype
    if part.reduce_dtype is not None:
        partial = partial.to(getattr(torch, part.reduce_dtype))
    if sp:
        out = coll.reduce_scatter(partial.view(b, -1, partial.shape[-1]), 1).reshape(-1, partial.shape[-1])
    else:
        out = coll.all_reduce(partial)
    out = out.to(dtype)
    return out if bias is None else out + bias


def _tokens(h: Tensor, index: Tensor) -> Tensor:
    """The rows of h [B*S, E] (or [B, S, E]) at the tokens `index` [B, R]: [B*R, E]."""
    b, r = index.shape
    return h.view(b, -1, h.shape[-1]).gather(1, index[:, :, None].expand(b, r, h.shape[-1])).reshape(b * r, -1)


def _gather_sequence(h: Tensor, coll: Collectives, *, b: int) -> Tensor:
    """A sequence-sharded [B*S/tp, E] back to the whole [B*S, E]."""
    return coll.all_gather(h.view(b, -1, h.shape[-1]), 1).reshape(-1, h.shape[-1])


def forward(
    w: DecoderWeights,
    cache: KVCache,
    x: StepInputs,
    *,
    spec: ModelSpec,
    part: Partition | None = None,
    coll: Collectives = SINGLE,
    all_logits: bool = False,
    blocks: BlockInputs | None = None,
    tree: TreeInputs | None = None,
) -> tuple[Tensor, KVCache]:
    """`forward_outputs` without the extra outputs: (logits, cache)."""
    logits, new, _ = forward_outputs(
        w, cache, x, spec=spec, part=part, coll=coll, all_logits=all_logits, blocks=blocks, tree=tree
    )
    return logits, new


def forward_outputs(
    w: DecoderWeights,
    cache: KVCache,
    x: StepInputs,
    *,
    spec: ModelSpec,
    part: Partition | None = None,
    coll: Collectives = SINGLE,
    all_logits: bool = False,
    blocks: BlockInputs | None = None,
    tree: TreeInputs | None = None,
    inputs_embeds: Tensor | None = None,
    hidden: bool = False,
) -> tuple[Tensor, KVCache, dict[str, Tensor]]:
    """One decoder step over the cache view `cache` (T slots), on one rank's shard.

    Args:
        w: the weights (this rank's shard under tensor parallelism).
        cache: L layers of [B, K_r, T, D]; T is the bucket length.
        x: input_ids/position_ids [B, S], last_index [B] (see `nxdi.core.programs.inputs`).
        spec: the architecture.
        part: what this rank holds (`Partition.single(spec)` when None: one rank).
        coll: the collectives connecting the ranks (`SINGLE` for one rank).
        all_logits: return logits of all S tokens instead of the last real one per row.
        blocks: with a block cache (`cache` is then L layers of [N+1, bs, K_r, D], see
            `nxdi.core.programs.block_kv`): where each token reads and writes; `x.last_index` is
            then unused (each segment's output token is `blocks.out_index`).
        tree: a token-tree step (`nxdi.core.programs.token_tree`): the S tokens hold contiguous
            slots (`x.position_ids`) but take their rotary positions from `tree.positions`, and
            attend to the cached prefix and the step's tokens `tree.mask` allows.
        inputs_embeds: [B, S, E] the layers' input instead of the tokens' embeddings (NxDI's
            `inputs_embeds`; an EAGLE draft's `fc` output); `x.input_ids` then only gives the shape.
        hidden: also return every token's final hidden state as `HIDDEN` [B, S, E] (after the
            final norm, the lm_head's input; padding tokens included): what an EAGLE draft reads (Medusa's heads read it at their tokens).

    Returns:
        logits [B, 1, V] fp32 (or [B, S, V] with `all_logits`; [B, R, V] with `blocks`, one per
        segment), the same on every rank, and the cache with this step's keys and values written
        at the tokens' slots; every other slot unchanged. Inputs are not mutated. Third, the extra
        outputs `moe_settings.routing_outputs(part)` names, by name (`moe_settings.ROUTER_LOGITS`
        [L, B*S, X] fp32, `EXPERT_INDEX` [L, B*S, k] int64; rows in [B, S] order, padding tokens
        included; empty when none is asked), then `HIDDEN` with `hidden`.
    """
    part = Partition.single(spec) if part is None else part
    b, s = x.input_ids.shape
    decode = s == 1  # a token-generation step (its MoE path and, under hybrid sharding, its experts)
    # context encoding only: a decode step has one token, and a speculation step (every token's
    # logits) runs without, as NxD's speculation model does (its k tokens need not divide over tp)
    sp = part.sequence_parallel and not decode and not all_logits
    if blocks is None:
        slots = inputs.write_slots(x)  # [B, S]
        rotary = slots if tree is None else tree.positions  # a tree's siblings share a position
        longest = (slots.gather(1, x.last_index[:, None]) if tree is None else rotary).max() + 1
        ropes = attention.rope_tables(rotary, longest, spec, w.embed.dtype)
        masks = attention.masks(slots, cache.length, spec, part, tree=tree)
        if spec.position is PositionKind.ALIBI:
            masks = attention.alibi_masks(masks, spec, part, coll, w.embed.dtype)
        positions = rotary
        out_index = x.last_index[:, None]  # [B, 1]
    else:
        assert part.kv_group == 1, "a block cache is not split over the sequence (flash decoding)"
        slots = x.position_ids.clamp(min=0)  # a padding token's position is any value
        ropes = attention.rope_tables(slots, torch.where(blocks.segment >= 0, slots, 0).max() + 1, spec, w.embed.dtype)
        masks = attention.block_masks(slots, blocks, int(cache.k[0].shape[1]), spec, part)
        positions = slots
        out_index = blocks.out_index  # [B, R]
    token_mask = None  # moe_mask_padded_tokens: padding takes no expert capacity and outputs zero
    if part.moe is not None and part.moe.moe_mask_padded_tokens:
        real = (
            torch.arange(s, device=slots.device)[None] <= x.last_index[:, None]
            if blocks is None
            else blocks.segment >= 0
        )
        token_mask = real.reshape(-1)
    embeds = (
        token_embeddings(w, x.input_ids, spec=spec, part=part, coll=coll) if inputs_embeds is None else inputs_embeds
    )
    embeds = _positioned(embeds, positions, w, spec)
    h = embeds.reshape(b * s, -1)  # [B*S, E]
    if sp:
        h = coll.scatter(h.view(b, s, -1), 1).reshape(-1, h.shape[-1])  # [B*S/tp, E]
    ks, vs = [], []
    wanted = moe_settings.routing_outputs(part)
    routed: list[moe.MoEOutput] = []
    # Past the last layer's keys and values, only the output tokens matter: its queries, attention
    # and MLP run on those alone (a context-encoding step of 128 tokens then does about 1/L less
    # work). Not where every token's output is read, nor where a token's result depends on the
    # others' (a mixture of experts' capacity) or the mask is not the folded boolean one.
    last = (
        len(w.layers) - 1
        if s > out_index.shape[1]
        and not (all_logits or hidden or wanted or sp or part.kv_group > 1)
        and tree is None
        and spec.position is not PositionKind.ALIBI
        and not isinstance(w.layers[-1].mlp, moe.Experts)
        else None
    )
    for i, (lw, mask, k_cache, v_cache) in enumerate(zip(w.layers, masks, cache.k, cache.v, strict=True)):
        pre = lw.input_norm is not None and not spec.post_layer_norm
        normed = _norm(h, lw.input_norm, spec, lw.input_norm_bias) if pre else h
        normed = _gather_sequence(normed, coll, b=b) if sp else normed
        a, k_cache, v_cache = attention.attend(
            lw.attn,
            normed,
            k_cache,
            v_cache,
            rope=ropes[i],
            mask=mask,
            window=spec.layer_window(i),
            slots=slots,
            spec=spec,
            part=part,
            coll=coll,
            blocks=blocks,
            keep=out_index if i == last else None,
        )
        if i == last:  # the residual stream and the MLP's input follow, at the output tokens
            h, normed = _tokens(h, out_index), _tokens(normed, out_index)
        a = _reduce(a, lw.attn.o_bias if part.tp > 1 else None, coll, part, b=b, sp=sp)
        if spec.parallel_residual:  # the MLP reads the layer's input too (normed by its own norm, or the same)
            if lw.post_norm is not None:
                normed = _norm(h, lw.post_norm, spec, lw.post_norm_bias)
                normed = _gather_sequence(normed, coll, b=b) if sp else normed
            h = h + a
        else:
            h = h + (_norm(a, lw.attn_out_norm, spec) if spec.sandwich_norms else a)
            if spec.post_layer_norm:
                h = _norm(h, lw.input_norm, spec, lw.input_norm_bias)
            normed = h if spec.post_layer_norm else _norm(h, lw.post_norm, spec, lw.post_norm_bias)
            normed = _gather_sequence(normed, coll, b=b) if sp else normed
        partial, bias, routing = _mlp(
            lw.mlp_for(decode=decode), normed, spec, part, coll, decode=decode, token_mask=token_mask
        )
        if wanted:
            assert routing is not None, "routing outputs come from a mixture of experts"
            routed.append(routing)
        m = _reduce(partial, bias, coll, part, b=b, sp=sp)
        h = h + (_norm(m, lw.mlp_out_norm, spec) if spec.sandwich_norms else m)
        if spec.post_layer_norm:
            h = _norm(h, lw.post_norm, spec, lw.post_norm_bias)
        ks.append(k_cache)
        vs.append(v_cache)
    h = (_gather_sequence(h, coll, b=b) if sp else h).view(b, -1, h.shape[-1])  # [B, S, E] ([B, R, E] pruned)
    states = _final_norm(h, w, spec) if hidden else None  # [B, S, E]: normed once, for both outputs
    head = h if states is None else states
    if not all_logits and last is None:
        head = _tokens(head, out_index).view(b, out_index.shape[1], -1)  # [B, R, E]
    logits = linear(
        head if states is not None else _final_norm(head, w, spec), w.lm_head, w.lm_head_bias
    )  # [B, S', V_r]
    if part.tp > 1:
        logits = coll.all_gather(logits, -1)[..., : spec.vocab_size]  # [B, S', V] on every rank
    logits = _soft_cap(logits, spec.final_logit_softcap).float()
    extras = moe_settings.stack_routing(routed, wanted)
    if states is not None:
        extras = {**extras, HIDDEN: states}
    return logits, KVCache(k=tuple(ks), v=tuple(vs)), extras
