"""Tensor-parallel sharding plans: every weight's rule and per-rank slice, and which TP degrees work. Pure.

Rules:
- Weights are named as NxD Inference names a Llama checkpoint after conversion (`layers.{i}.self_attn.q_proj.weight`,
  `embed_tokens.weight`, `lm_head.weight`, ...); every family is described with those logical names and
  the state-dict transforms map checkpoint keys onto them. Entries with `per_layer` stand for every layer.
- Linear weights are `[out, in]`. COLUMN_PARALLEL splits dim 0 (q/k/v, gate/up, lm_head's vocab),
  ROW_PARALLEL splits dim 1 (o_proj, down_proj) and is followed by an all-reduce, VOCAB_PARALLEL splits
  the embedding's vocab rows, REPLICATED keeps a full copy per rank (norms, row-parallel biases, router).
  Without `vocab_parallel` the embedding is split along its hidden dim (dim 1, COLUMN_PARALLEL).
- Slices are given in the *padded* layout: first the `remap` (GQA head padding/replication of q/k/v/o,
  zero padding of an intermediate or vocab size that tp does not divide) builds the padded tensor, then
  rank r takes `rank_spans[r]` along `dim`. With `fused_qkv`, rank r holds `[Q_r; K_r; V_r]`, three spans.

(Over 400 lines: every weight kind's rule (attention's GQA remaps, the MLP and both expert layouts,
norms, embeddings) is one table that the rank plans, the partition and the memory planner read;
the platform's TP-degree checks at the end are the next thing to move out if it grows.)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import ConfigError, Problem
from nxdi.core.model_spec import ModelSpec, NormKind, PositionKind
from nxdi.core.planning import gqa
from nxdi.core.platform import INSTANCES, PLATFORMS, Platform

Span = tuple[int, int]
"""Half-open `[start, stop)` range of indices along a weight's split dim."""


class ShardRule(enum.Enum):
    COLUMN_PARALLEL = "column_parallel"
    ROW_PARALLEL = "row_parallel"
    REPLICATED = "replicated"
    VOCAB_PARALLEL = "vocab_parallel"


@attrs.frozen(kw_only=True)
class Remap:
    """Builds the padded layout along `dim` from blocks of `block` indices of the original tensor."""

    dim: int
    block: int
    """Indices per block: head_dim for head remaps, 1 for plain zero padding."""
    sources: tuple[int | None, ...]
    """For every block of the padded layout, the original block it copies, or None for zeros."""

    def indices(self) -> tuple[int | None, ...]:
        """Per padded index along `dim`, the original index, or None for a zero."""
        b = self.block
        return tuple(None if s is None else s * b + j for s in self.sources for j in range(b))


def _tail(dim: int, size: int, padded: int) -> Remap | None:
    return None if padded == size else Remap(dim=dim, block=1, sources=(*range(size), *([None] * (padded - size))))


@attrs.frozen(kw_only=True)
class WeightShard:
    """One weight (or one per layer), how it is padded and which slice each rank holds."""

    name: str
    per_layer: bool
    rule: ShardRule
    shape: tuple[int, ...]
    """Shape in the (converted) checkpoint."""
    padded_shape: tuple[int, ...]
    dim: int | None
    """The split dim; None when replicated."""
    rank_spans: tuple[tuple[Span, ...], ...]
    """Per rank, the spans along `dim` of the padded layout it holds (one span, or three for fused QKV)."""
    remap: Remap | None = None
    expert_spans: tuple[Span, ...] | None = None
    """Expert parallelism: per rank, the experts (along dim 0 of an experts weight) it holds; None: all."""

    def rank_shape(self, rank: int = 0) -> tuple[int, ...]:
        shape = self.padded_shape
        if self.dim is not None:
            n = sum(stop - start for start, stop in self.rank_spans[rank])
            shape = tuple(n if d == self.dim else s for d, s in enumerate(shape))
        if self.expert_spans is not None:
            start, stop = self.expert_spans[rank]
            shape = (stop - start, *shape[1:])
        return shape

    def rank_numel(self, rank: int = 0) -> int:
        out = 1
        for s in self.rank_shape(rank):
            out *= s
        return out


def _even_spans(size: int, tp: int, offset: int = 0) -> tuple[Span, ...]:
    step = size // tp
    return tuple((offset + r * step, offset + (r + 1) * step) for r in range(tp))


def _split(
    name: str,
    rule: ShardRule,
    shape: tuple[int, ...],
    dim: int,
    tp: int,
    *,
    per_layer: bool = True,
    padded: int | None = None,
    remap: Remap | None = None,
) -> WeightShard:
    size = shape[dim] if padded is None else padded
    padded_shape = tuple(size if d == dim else s for d, s in enumerate(shape))
    spans = tuple((s,) for s in _even_spans(size, tp))
    remap = remap if remap is not None else _tail(dim, shape[dim], size)
    return WeightShard(
        name=name,
        per_layer=per_layer,
        rule=rule,
        shape=shape,
        padded_shape=padded_shape,
        dim=dim,
        rank_spans=spans,
        remap=remap,
    )


def _copy(name: str, shape: tuple[int, ...], tp: int, *, per_layer: bool = True) -> WeightShard:
    spans = ((0, shape[0]),)
    return WeightShard(
        name=name,
        per_layer=per_layer,
        rule=ShardRule.REPLICATED,
        shape=shape,
        padded_shape=shape,
        dim=None,
        rank_spans=(spans,) * tp,
    )


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _attention(model: ModelSpec, layout: gqa.HeadLayout, *, fused_qkv: bool) -> list[WeightShard]:
    """q/k/v/o weights (+ biases) of one layer, with the GQA remap on their head dim."""
    c, d, e, tp = layout.counts, model.head_dim, model.hidden_size, layout.counts.tp
    a = "layers.{i}.self_attn"
    out: list[WeightShard] = []
    suffixes = ("weight", "bias") if model.qkv_bias else ("weight",)
    for sfx in suffixes:
        tail = (e,) if sfx == "weight" else ()
        out.extend([_fused_qkv(f"{a}.Wqkv.{sfx}", layout, tail, d)] if fused_qkv else _qkv(a, sfx, layout, tail, d))
    o_map = Remap(dim=1, block=d, sources=layout.q_sources)
    out.append(
        _split(f"{a}.o_proj.weight", ShardRule.ROW_PARALLEL, (e, c.q * d), 1, tp, padded=c.q_padded * d, remap=o_map)
    )
    if model.o_bias:
        out.append(_copy(f"{a}.o_proj.bias", (e,), tp))
    if model.qk_norm:
        out.extend(_copy(f"{a}.{n}.weight", (d,), tp) for n in ("q_norm", "k_norm"))
    return out


def _qkv(prefix: str, sfx: str, layout: gqa.HeadLayout, tail: tuple[int, ...], d: int) -> list[WeightShard]:
    """Separate q/k/v projections (`{prefix}.q_proj.{sfx}`, ...), remapped along their head dim."""
    c, col = layout.counts, ShardRule.COLUMN_PARALLEL
    q_map = Remap(dim=0, block=d, sources=layout.q_sources)
    kv_map = Remap(dim=0, block=d, sources=layout.kv_sources)
    return [
        _split(f"{prefix}.q_proj.{sfx}", col, (c.q * d, *tail), 0, c.tp, padded=c.q_padded * d, remap=q_map),
        *(
            _split(f"{prefix}.{p}.{sfx}", col, (c.kv * d, *tail), 0, c.tp, padded=c.kv_padded * d, remap=kv_map)
            for p in ("k_proj", "v_proj")
        ),
    ]


def _fused_qkv(name: str, layout: gqa.HeadLayout, tail: tuple[int, ...], d: int) -> WeightShard:
    """`[Q; K; V]` fused along dim 0; rank r holds `[Q_r; K_r; V_r]` of the padded segments."""
    c = layout.counts
    k0, v0 = c.q, c.q + c.kv  # source blocks of K and V inside the fused checkpoint tensor
    sources = (
        *layout.q_sources,
        *(None if s is None else k0 + s for s in layout.kv_sources),
        *(None if s is None else v0 + s for s in layout.kv_sources),
    )
    qn, kn = c.q_padded * d, c.kv_padded * d
    spans = tuple(zip(_even_spans(qn, c.tp), _even_spans(kn, c.tp, qn), _even_spans(kn, c.tp, qn + kn), strict=True))
    return WeightShard(
        name=name,
        per_layer=True,
        rule=ShardRule.COLUMN_PARALLEL,
        shape=((c.q + 2 * c.kv) * d, *tail),
        padded_shape=(qn + 2 * kn, *tail),
        dim=0,
        rank_spans=spans,
        remap=Remap(dim=0, block=d, sources=sources),
    )


def expert_group_size(tp: int, moe_ep: int) -> int:
    """moe_tp, the ranks of one expert group: rank r holds expert group `r // moe_tp` (of `moe_ep`)
    and, inside each of its experts, intermediate slice `r % moe_tp` (NxD's layout: the ranks of one
    expert group are contiguous). `moe_ep` divides tp (`shard_plan` checks)."""
    return tp // moe_ep


def _experts(
    name: str, rule: ShardRule, shape: tuple[int, ...], dim: int | None, tp: int, moe_ep: int, padded: int
) -> WeightShard:
    """An experts weight [X, ...]: split along `dim` (the intermediate width) over the moe_tp ranks of
    each expert group, and along the experts over the `moe_ep` groups (None: replicated inside a group)."""
    moe_tp = expert_group_size(tp, moe_ep)
    if dim is None:
        shard = _copy(name, shape, tp)
    else:
        inner = _split(name, rule, shape, dim, moe_tp, padded=padded)
        shard = attrs.evolve(inner, rank_spans=tuple(inner.rank_spans[r % moe_tp] for r in range(tp)))
    if moe_ep == 1:
        return shard
    groups = _even_spans(shape[0], moe_ep)
    return attrs.evolve(shard, expert_spans=tuple(groups[r // moe_tp] for r in range(tp)))


def _experts_of(model: ModelSpec, tp: int, moe_ep: int, group: str) -> list[WeightShard]:
    """One layer's experts weights named under `group` (`experts`, or `experts_tkg` for hybrid
    sharding's token-generation copy), split over `moe_ep` groups of tp / moe_ep ranks, each
    expert's intermediate size zero padded to a multiple of the group's ranks."""
    e, f, n = model.hidden_size, model.intermediate_size, model.num_experts
    fe = round_up(f, expert_group_size(tp, moe_ep))
    m = f"layers.{{i}}.mlp.{group}"
    col, row = ShardRule.COLUMN_PARALLEL, ShardRule.ROW_PARALLEL
    ins = ("gate_proj", "up_proj") if model.gated_mlp else ("up_proj",)
    out = [_experts(f"{m}.{p}.weight", col, (n, f, e), 1, tp, moe_ep, fe) for p in ins]
    if model.mlp_bias:
        out += [_experts(f"{m}.{p}.bias", col, (n, f), 1, tp, moe_ep, fe) for p in ins]
        out.append(_experts(f"{m}.down_proj.bias", ShardRule.REPLICATED, (n, e), None, tp, moe_ep, e))
    return [*out, _experts(f"{m}.down_proj.weight", row, (n, e, f), 2, tp, moe_ep, fe)]


def _mlp(model: ModelSpec, tp: int, moe_ep: int = 1, tkg_ep: int | None = None) -> list[WeightShard]:
    """The MLP of one layer; the intermediate size is zero padded to a multiple of tp (of moe_tp in
    a mixture of experts, whose experts are split over `moe_ep` groups of ranks; with `tkg_ep`,
    every rank also holds the token-generation copy `experts_tkg`, split over `tkg_ep` groups)."""
    e, f = model.hidden_size, model.intermediate_size
    fp = round_up(f, tp)
    m = "layers.{i}.mlp"
    col, row = ShardRule.COLUMN_PARALLEL, ShardRule.ROW_PARALLEL
    ins = ("gate_proj", "up_proj") if model.gated_mlp else ("up_proj",)
    if model.is_moe:
        out = [_copy(f"{m}.router.weight", (model.num_experts, e), tp), *_experts_of(model, tp, moe_ep, "experts")]
        return out if tkg_ep is None else [*out, *_experts_of(model, tp, tkg_ep, "experts_tkg")]
    out = [_split(f"{m}.{p}.weight", col, (f, e), 0, tp, padded=fp) for p in ins]
    if model.mlp_bias:
        out += [_split(f"{m}.{p}.bias", col, (f,), 0, tp, padded=fp) for p in ins]
        out.append(_copy(f"{m}.down_proj.bias", (e,), tp))
    return [*out, _split(f"{m}.down_proj.weight", row, (e, f), 1, tp, padded=fp)]


def _norms(model: ModelSpec, tp: int) -> list[WeightShard]:
    e = model.hidden_size
    kinds = ("weight", "bias") if model.norm is NormKind.LAYER and model.norm_bias else ("weight",)
    names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    if model.sandwich_norms:  # Gemma: the MLP's input and output have norms of their own
        names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    if model.shared_layer_norm:  # GPT-J: attention and MLP read one norm
        names = ("input_layernorm",)
    layer = [_copy(f"layers.{{i}}.{n}.{k}", (e,), tp) for n in names for k in kinds]
    tops = (("norm",) if model.final_norm else ()) + (("embed_norm",) if model.embed_norm else ())
    return [*layer, *(_copy(f"{n}.{k}", (e,), tp, per_layer=False) for n in tops for k in kinds)]


def _embeddings(model: ModelSpec, tp: int, *, vocab_parallel: bool) -> list[WeightShard]:
    e, v = model.hidden_size, model.vocab_size
    vp = round_up(v, tp)
    if vocab_parallel:
        embed = _split("embed_tokens.weight", ShardRule.VOCAB_PARALLEL, (v, e), 0, tp, per_layer=False, padded=vp)
    else:
        embed = _split(
            "embed_tokens.weight", ShardRule.COLUMN_PARALLEL, (v, e), 1, tp, per_layer=False, padded=round_up(e, tp)
        )
    out = [embed, _split("lm_head.weight", ShardRule.COLUMN_PARALLEL, (v, e), 0, tp, per_layer=False, padded=vp)]
    if model.lm_head_bias:
        out.append(_split("lm_head.bias", ShardRule.COLUMN_PARALLEL, (v,), 0, tp, per_layer=False, padded=vp))
    if model.position is PositionKind.LEARNED:
        rows = model.max_position_embeddings + model.position_offset
        out.append(_copy("embed_positions.weight", (rows, e), tp, per_layer=False))
    return out


@attrs.frozen(kw_only=True)
class ShardPlan:
    """How a model is split over `tp` ranks."""

    tp: int
    counts: gqa.HeadCounts
    layout: gqa.HeadLayout
    num_layers: int
    weights: tuple[WeightShard, ...]
    notes: tuple[str, ...] = ()
    """Warnings for the shell (strategy fallbacks, padding)."""

    @property
    def strategy(self) -> gqa.GQAStrategy:
        return self.counts.strategy

    def rank_params(self, rank: int = 0) -> int:
        """Parameters held by one rank (every layer counted)."""
        return sum(w.rank_numel(rank) * (self.num_layers if w.per_layer else 1) for w in self.weights)

    def weight(self, name: str) -> WeightShard:
        return next(w for w in self.weights if w.name == name)

    def experts_per_rank(self, rank: int = 0, *, token_generation: bool = False) -> tuple[int, int] | None:
        """(experts, intermediate rows of each) that `rank` holds of a mixture of experts, in token
        generation's layout when asked and hybrid sharding gives it one; None when dense."""
        names = {w.name: w for w in self.weights}
        up = names.get("layers.{i}.mlp.experts.up_proj.weight")
        if up is None:
            return None
        if token_generation:
            up = names.get("layers.{i}.mlp.experts_tkg.up_proj.weight", up)
        experts, rows, _ = up.rank_shape(rank)
        return experts, rows

    @property
    def hybrid(self) -> bool:
        """Whether every rank also holds a token-generation layout of the experts (`experts_tkg`)."""
        return any(w.name.startswith("layers.{i}.mlp.experts_tkg.") for w in self.weights)


def shard_plan(
    model: ModelSpec,
    *,
    tp: int,
    strategy: gqa.GQAStrategy | None = None,
    fused_qkv: bool = False,
    vocab_parallel: bool = False,
    moe_ep: int = 1,
    tkg_ep: int | None = None,
) -> Result[ShardPlan, ConfigError]:
    """The weight table of `model` over `tp` ranks, with the GQA strategy the reference would use;
    a mixture of experts' experts split over `moe_ep` groups of tp / moe_ep ranks (`expert_group_size`),
    and, with `tkg_ep` (hybrid sharding), a second copy for token generation over `tkg_ep` groups.

    Returns:
        `Failure` when tp is not positive, the head counts are inconsistent (see
        `gqa.shardable_head_counts`) or `moe_ep` (`tkg_ep`) does not divide both tp and the experts;
        platform limits are checked by `check_tp_degree`.
    """
    if tp < 1:
        return Failure(ConfigError.of("tp_degree", tp, "must be a positive integer"))
    degrees: tuple[tuple[str, int], ...] = (("moe_ep_degree", moe_ep),)
    if tkg_ep is not None:  # hybrid sharding: the user set these two under hybrid_sharding_config
        degrees = (
            ("hybrid_sharding_config.moe_cte_ep_degree", moe_ep),
            ("hybrid_sharding_config.moe_tkg_ep_degree", tkg_ep),
        )
    bad = [(name, ep) for name, ep in degrees if ep != 1 and (not model.is_moe or tp % ep or model.num_experts % ep)]
    if bad:
        why = f"must divide tp_degree={tp} and the model's {model.num_experts} experts"
        fix = "use a common divisor, or 1"
        return Failure(ConfigError(problems=tuple(Problem.of(name, ep, why, fix) for name, ep in bad)))
    chosen, notes = gqa.determine_strategy(tp, model.num_kv_heads, strategy, q=model.num_attention_heads)
    return gqa.shardable_head_counts(tp, model.num_attention_heads, model.num_kv_heads, chosen).map(
        lambda counts: _assemble(
            model, counts, notes, fused_qkv=fused_qkv, vocab_parallel=vocab_parallel, moe_ep=moe_ep, tkg_ep=tkg_ep
        )
    )


def _assemble(
    model: ModelSpec,
    counts: gqa.HeadCounts,
    notes: tuple[str, ...],
    *,
    fused_qkv: bool,
    vocab_parallel: bool,
    moe_ep: int,
    tkg_ep: int | None,
) -> ShardPlan:
    layout = gqa.head_layout(counts)
    tp = counts.tp
    weights = (
        *_attention(model, layout, fused_qkv=fused_qkv),
        *_mlp(model, tp, moe_ep, tkg_ep),
        *_norms(model, tp),
        *_embeddings(model, tp, vocab_parallel=vocab_parallel),
    )
    extra: list[str] = []
    if counts.q_padded != counts.q:
        extra.append(f"{counts.q_padded - counts.q} zero Q heads pad num_attention_heads={counts.q} for tp_degree={tp}")
    moe_tp = expert_group_size(tp, moe_ep)
    if model.intermediate_size % moe_tp:
        ranks = f"tp_degree={tp}" if moe_ep == 1 else f"the {moe_tp} ranks of each expert group"
        extra.append(f"intermediate_size={model.intermediate_size} is zero padded to a multiple of {ranks}")
    return ShardPlan(
        tp=tp, counts=counts, layout=layout, num_layers=model.num_layers, weights=weights, notes=(*notes, *extra)
    )


def valid_tp_degrees(platform: Platform, lnc: int, *, instance: str | None = None) -> tuple[int, ...]:
    """TP degrees the Neuron runtime supports on `platform` at `lnc`, capped by the instance's logical cores."""
    degrees = PLATFORMS[platform].tp_degrees(lnc)
    known = INSTANCES.get(instance) if instance is not None else None
    if known is None:
        return degrees
    return tuple(t for t in degrees if t <= known.logical_cores(lnc))


def check_tp_degree(tp: int, *, platform: Platform, lnc: int, instance: str | None = None) -> Result[int, ConfigError]:
    """Fail unless `tp` is a TP degree the runtime supports on `platform`/`lnc` (and fits the instance).

    Returns:
        `Failure` listing an unsupported LNC, an unsupported degree (with the valid ones as the fix), and
        a degree above the instance's logical core count.
    """
    problems: list[Problem] = []
    spec = PLATFORMS[platform]
    if not spec.tp_degrees(lnc):
        known = sorted(spec.valid_tp_degrees)
        problems.append(Problem.of("logical_nc_config", lnc, f"is not supported on {platform.value}", f"use {known}"))
    elif tp not in spec.tp_degrees(lnc):
        problems.append(
            Problem.of(
                "tp_degree",
                tp,
                f"is not supported on {platform.value} at LNC={lnc}",
                f"use one of {list(spec.tp_degrees(lnc))}",
            )
        )
    known_instance = INSTANCES.get(instance) if instance is not None else None
    if known_instance is not None and tp > known_instance.logical_cores(lnc):
        cores = known_instance.logical_cores(lnc)
        problems.append(
            Problem.of(
                "tp_degree",
                tp,
                f"exceeds the {cores} logical cores of {instance} at LNC={lnc}",
                f"use at most {cores}, or a larger instance",
            )
        )
    return Failure(ConfigError(problems=tuple(problems))) if problems else Success(tp)


def check_sequence_parallel(tp: int, context_buckets: Sequence[int]) -> Result[int, ConfigError]:
    """Sequence parallelism splits every context-encoding bucket over tp ranks: each must divide evenly.

    Returns:
        `Failure` (field `sequence_parallel_enabled`) naming every bucket that tp does not divide.
    """
    odd = [b for b in context_buckets if b % tp]
    if not odd:
        return Success(tp)
    return Failure(
        ConfigError.of(
            "sequence_parallel_enabled",
            True,
            f"context-encoding buckets {odd} are not divisible by tp_degree={tp}",
            f"use buckets that are multiples of {tp}, or disable sequence parallelism",
        )
    )


def shard_plan_for(model: ModelSpec, spec: NeuronSpec) -> Result[ShardPlan, ConfigError]:
    """The sharding plan of `model` under `spec` (tp_degree, fused_qkv, vocab_parallel, the expert
    layouts of `MoESpec.ep_degree`: a token-generation copy when hybrid sharding makes them differ)."""
    moe = spec.moe if model.is_moe else None
    return shard_plan(
        model,
        tp=spec.tp_degree,
        fused_qkv=spec.fused_qkv,
        vocab_parallel=spec.vocab_parallel,
        moe_ep=1 if moe is None else moe.ep_degree(token_generation=False),
        tkg_ep=moe.ep_degree(token_generation=True) if moe is not None and moe.hybrid else None,
    )
