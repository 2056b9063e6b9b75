"""Partitions: the shapes every rank's program holds under tensor parallelism. Pure.

A `Partition` is what a rank's tensor program needs to know about its shard: query and key/value
heads per rank (after GQA replication and zero padding, as the sharding plan lays them out), the
MLP width per rank, how the embedding and lm_head are split, and whether context encoding runs
sequence parallel. Every rank holds the same shapes, so one traced program serves every rank.
"""

from __future__ import annotations

import attrs
from returns.result import Result, Success

from nxdi.core import families
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.config.sub_specs import MoESpec
from nxdi.core.errors import ConfigError, Problem, problems_of, problems_result
from nxdi.core.model_spec import ModelSpec, PositionKind
from nxdi.core.planning import buckets, gqa, lora
from nxdi.core.planning.sharding import ShardPlan, check_sequence_parallel, round_up, shard_plan_for


@attrs.frozen(kw_only=True)
class Partition:
    """What every rank's program holds of the model under tensor parallelism (all ranks alike)."""

    tp: int = attrs.field(default=1, validator=attrs.validators.gt(0))
    q_heads: int = attrs.field(validator=attrs.validators.gt(0))
    """Query heads per rank, zero padding heads included."""
    kv_heads: int = attrs.field(validator=attrs.validators.gt(0))
    """Key/value heads per rank, replicas included."""
    intermediate: int = attrs.field(validator=attrs.validators.gt(0))
    """MLP width per rank: the intermediate size zero padded to a multiple of tp, over tp (in a
    mixture of experts, each expert's width over the moe_tp ranks of an expert group)."""
    hidden: int = attrs.field(validator=attrs.validators.gt(0))
    """Embedding columns per rank: the hidden size padded to a multiple of tp, over tp (split along
    hidden), or the whole hidden size with `vocab_parallel`."""
    vocab: int = attrs.field(validator=attrs.validators.gt(0))
    """lm_head rows per rank (the vocabulary padded to a multiple of tp, over tp); embedding rows too
    with `vocab_parallel`."""
    vocab_parallel: bool = False
    sequence_parallel: bool = False
    """Context encoding keeps norms and residuals on sequence shards (reduce-scatter / all-gather)."""
    reduce_dtype: str | None = None
    """The dtype the ranks' partial sums are reduced in (`rpl_reduce_dtype`; None: their own)."""
    kv_group: int = attrs.field(default=1, validator=attrs.validators.gt(0))
    """Flash decoding: g contiguous ranks share one KV head and each caches 1/g of the sequence
    (`nxdi.core.programs.flash_decoding`); 1 without."""
    moe: MoESpec | None = None
    """The MoE settings of a mixture-of-experts model; None for a dense one."""
    experts: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Experts per rank: all of them, or 1/moe_ep_degree under expert parallelism (rank r holds
    group `r // (tp / moe_ep_degree)`, see `sharding.expert_group_size`); 0 for a dense model."""
    tkg_experts: int | None = None
    """Experts per rank of token generation's own layout under hybrid sharding (the `experts_tkg`
    weights); None when token generation uses `experts`."""

    def expert_layout(self, *, token_generation: bool) -> tuple[int, int]:
        """(experts per rank, ranks splitting each expert's width: tp / ep degree) of context
        encoding or token generation (they differ under hybrid sharding)."""
        ep = self.moe.ep_degree(token_generation=token_generation) if self.moe is not None else 1
        experts = self.tkg_experts if token_generation and self.tkg_experts is not None else self.experts
        return experts, self.tp // ep

    def cache_slots(self, positions: int) -> int:
        """KV-cache slots a rank holds for `positions` positions: ceil(positions / kv_group)."""
        return -(-positions // self.kv_group)

    @classmethod
    def single(cls, model: ModelSpec, *, moe: MoESpec | None = None) -> Partition:
        """One rank holding everything (native GQA: no head replication or padding); a mixture of
        experts with `moe`'s settings (the defaults when None)."""
        return cls(
            q_heads=model.num_attention_heads,
            kv_heads=model.num_kv_heads,
            intermediate=model.intermediate_size,
            hidden=model.hidden_size,
            vocab=model.vocab_size,
            moe=_moe_settings(model, moe),
            experts=model.num_experts,
        )


def _moe_settings(model: ModelSpec, moe: MoESpec | None) -> MoESpec | None:
    """A mixture of experts' settings (the defaults when not given); None for a dense model."""
    return (moe or MoESpec()) if model.is_moe else None


def partition_of(
    plan: ShardPlan,
    model: ModelSpec,
    *,
    vocab_parallel: bool = False,
    sequence_parallel: bool = False,
    reduce_dtype: str | None = None,
    kv_group: int = 1,
    moe: MoESpec | None = None,
) -> Partition:
    """The per-rank shapes `plan` gives every rank (tp 1 gives `Partition.single`)."""
    if plan.tp == 1:
        return attrs.evolve(Partition.single(model, moe=moe), sequence_parallel=False, vocab_parallel=vocab_parallel)
    tp, c = plan.tp, plan.counts
    experts, rows = plan.experts_per_rank() or (0, round_up(model.intermediate_size, tp) // tp)
    tkg = plan.experts_per_rank(token_generation=True) if plan.hybrid else None
    return Partition(
        tp=tp,
        q_heads=c.q_per_rank,
        kv_heads=c.kv_per_rank,
        intermediate=rows,
        hidden=model.hidden_size if vocab_parallel else round_up(model.hidden_size, tp) // tp,
        vocab=round_up(model.vocab_size, tp) // tp,
        vocab_parallel=vocab_parallel,
        sequence_parallel=sequence_parallel,
        reduce_dtype=reduce_dtype,
        kv_group=kv_group,
        moe=_moe_settings(model, moe),
        experts=experts,
        tkg_experts=None if tkg is None else tkg[0],
    )


def partition_for(model: ModelSpec, spec: NeuronSpec) -> Result[Partition, ConfigError]:
    """The per-rank shapes of `model` under `spec` (tp_degree, vocab_parallel, sequence_parallel_enabled)."""
    return shard_plan_for(model, spec).map(
        lambda plan: partition_of(
            plan,
            model,
            vocab_parallel=spec.vocab_parallel,
            sequence_parallel=spec.sequence_parallel_enabled,
            moe=spec.moe,
        )
    )


def _flash_decoding_group(plan: ShardPlan, model: ModelSpec) -> Result[int, ConfigError]:
    """g, the ranks flash decoding splits each KV head's sequence over (the reference's
    num_cores_per_group), when the layout allows it on the CPU engine."""
    tp, q, kv = plan.tp, model.num_attention_heads, model.num_kv_heads

    def fits(g: int) -> Result[int, ConfigError]:
        if g * kv != tp or plan.counts.kv_per_rank != 1:
            why = (
                f"needs every rank to hold one replica of a KV head, shared by a group of {g} ranks: "
                f"tp_degree={tp} must be a multiple of num_key_value_heads={kv} and at most num_attention_heads={q}"
            )
            return problems_result(g, [Problem.of("flash_decoding_enabled", True, why, "disable flash decoding")])
        if g == 1:
            why = f"has nothing to split: each of the {tp} ranks holds its own KV head (num_key_value_heads={kv})"
            fix = "disable flash decoding, or use a tp_degree that is a multiple of num_key_value_heads"
            return problems_result(g, [Problem.of("flash_decoding_enabled", True, why, fix)])
        return Success(g)

    return gqa.flash_decoding_group(tp, q, kv).bind(fits)


def program_shard_plan(model: ModelSpec, spec: NeuronSpec) -> Result[ShardPlan, ConfigError]:
    """The sharding of the programs' weight layout under `spec`: Q, K and V always fused (the one
    layout the programs take, whatever `fused_qkv` says about the checkpoint)."""
    return shard_plan_for(model, attrs.evolve(spec, fused_qkv=True))


def check_partition(model: ModelSpec, spec: NeuronSpec) -> Result[Partition, ConfigError]:
    """The per-rank shapes the engine runs `model` with under `spec` (Q, K and V fused).

    Returns:
        `Failure` listing every reason the ranks cannot be laid out: head counts that do not shard
        over tp_degree, context buckets that sequence parallelism cannot split, a flash-decoding
        group the layout does not give, and a LoRA layout the model cannot take (`lora.layout_for`).
    """
    tp = spec.tp_degree
    plan = program_shard_plan(model, spec)
    sequence = (
        buckets.context_table_for(spec).bind(lambda t: check_sequence_parallel(tp, t.lengths))
        if spec.sequence_parallel_enabled and tp > 1
        else Success(0)
    )
    group = (
        plan.bind(lambda p: _flash_decoding_group(p, model)) if spec.flash_decoding_enabled and tp > 1 else Success(1)
    )
    adapters = lora.layout_for(model, spec.lora_config) if spec.lora_config is not None else Success(None)
    problems = (
        *problems_of(plan, sequence, group, adapters),
        *_moe_problems(model, spec),
        *_alibi_problems(model, spec),
        *_older_family_problems(model, spec),
    )
    if problems:
        return problems_result(Partition.single(model), problems)
    return Success(
        partition_of(
            plan.unwrap(),
            model,
            vocab_parallel=spec.vocab_parallel,
            sequence_parallel=spec.sequence_parallel_enabled,
            reduce_dtype=spec.rpl_reduce_dtype,
            kv_group=group.unwrap(),
            moe=spec.moe,
        )
    )


def _older_family_problems(model: ModelSpec, spec: NeuronSpec) -> list[Problem]:
    """EAGLE on a family whose record says a draft cannot be built from its layers (`FamilyRecord.eagle`;
    multi-LoRA serving is refused by `lora.layout_for`, from `FamilyRecord.lora`, in `check_partition`)."""
    record = families.by_model_type().get(model.model_type)
    if record is None or record.eagle:
        return []
    others = (
        ("enable_eagle_speculation", True, spec.enable_eagle_speculation, "False"),
        ("is_eagle_draft", True, spec.is_eagle_draft, "False"),
    )
    why = f"is not supported for {model.model_type} models on the CPU engine yet"
    return [Problem.of(name, value, why, f"set {name}={fix}") for name, value, on, fix in others if on]


def _alibi_problems(model: ModelSpec, spec: NeuronSpec) -> list[Problem]:
    """What ALiBi attention (BLOOM) cannot run with yet: its bias is built from the contiguous
    cache's slot order, per whole head, so not over a flash-decoding sequence shard, a block cache,
    a token tree or heads split unevenly over the ranks."""
    if model.position is not PositionKind.ALIBI:
        return []
    others = (
        ("flash_decoding_enabled", True, spec.flash_decoding_enabled, "False"),
        ("is_block_kv_layout", True, spec.is_block_kv_layout, "False"),
        ("token_tree_config", spec.token_tree_config, spec.token_tree_config is not None, "None"),
        ("tp_degree", spec.tp_degree, model.num_attention_heads % spec.tp_degree != 0, "a divisor of the heads"),
    )
    why = f"does not run with ALiBi attention ({model.model_type}) on the CPU engine yet"
    return [Problem.of(name, value, why, f"set {name}={fix}") for name, value, on, fix in others if on]


def _moe_problems(model: ModelSpec, spec: NeuronSpec) -> list[Problem]:
    """What a mixture of experts cannot run with: quantized weights (the experts would stay in
    float). The MoE degrees are checked with the config (`neuron_checks`), a moe_ep_degree that
    does not divide the experts by the sharding plan."""
    if not model.is_moe or not spec.quantized:
        return []
    why = "would leave the expert weights, most of a mixture of experts, in float: nxdi does not quantize experts yet"
    return [Problem.of("quantized", True, why, "set quantized=False")]
