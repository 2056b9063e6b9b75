"""Partitions: the shapes every rank's program holds under tensor parallelism. Pure.

A `Partition` is what a rank's tensor program needs to know about its shard: query and key/value
heads per rank (after GQA replication and zero padding, as the sharding plan lays them out), the
MLP width per rank, how the embedding and lm_head are split, and whether context encoding runs
sequence parallel. Every rank holds the same shapes, so one traced program serves every rank.
"""

from __future__ import annotations

import attrs
from returns.result import Result

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import ConfigError
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning.sharding import ShardPlan, round_up, shard_plan_for


@attrs.frozen(kw_only=True)
class Partition:
    """What every rank's program holds of the model under tensor parallelism (all ranks alike)."""

    tp: int = attrs.field(default=1, validator=attrs.validators.gt(0))
    q_heads: int = attrs.field(validator=attrs.validators.gt(0))
    """Query heads per rank, zero padding heads included."""
    kv_heads: int = attrs.field(validator=attrs.validators.gt(0))
    """Key/value heads per rank, replicas included."""
    intermediate: int = attrs.field(validator=attrs.validators.gt(0))
    """MLP width per rank: the intermediate size zero padded to a multiple of tp, over tp."""
    hidden: int = attrs.field(validator=attrs.validators.gt(0))
    """Embedding columns per rank: the hidden size padded to a multiple of tp, over tp (split along
    hidden), or the whole hidden size with `vocab_parallel`."""
    vocab: int = attrs.field(validator=attrs.validators.gt(0))
    """lm_head rows per rank (the vocabulary padded to a multiple of tp, over tp); embedding rows too
    with `vocab_parallel`."""
    vocab_parallel: bool = False
    sequence_parallel: bool = False
    """Context encoding keeps norms and residuals on sequence shards (reduce-scatter / all-gather)."""

    @classmethod
    def single(cls, model: ModelSpec) -> Partition:
        """One rank holding everything (native GQA: no head replication or padding)."""
        return cls(
            q_heads=model.num_attention_heads,
            kv_heads=model.num_kv_heads,
            intermediate=model.intermediate_size,
            hidden=model.hidden_size,
            vocab=model.vocab_size,
        )


def partition_of(
    plan: ShardPlan, model: ModelSpec, *, vocab_parallel: bool = False, sequence_parallel: bool = False
) -> Partition:
    """The per-rank shapes `plan` gives every rank (tp 1 gives `Partition.single`)."""
    if plan.tp == 1:
        return attrs.evolve(Partition.single(model), sequence_parallel=False, vocab_parallel=vocab_parallel)
    tp, c = plan.tp, plan.counts
    return Partition(
        tp=tp,
        q_heads=c.q_per_rank,
        kv_heads=c.kv_per_rank,
        intermediate=round_up(model.intermediate_size, tp) // tp,
        hidden=model.hidden_size if vocab_parallel else round_up(model.hidden_size, tp) // tp,
        vocab=round_up(model.vocab_size, tp) // tp,
        vocab_parallel=vocab_parallel,
        sequence_parallel=sequence_parallel,
    )


def partition_for(model: ModelSpec, spec: NeuronSpec) -> Result[Partition, ConfigError]:
    """The per-rank shapes of `model` under `spec` (tp_degree, vocab_parallel, sequence_parallel_enabled)."""
    return shard_plan_for(model, spec).map(
        lambda plan: partition_of(
            plan, model, vocab_parallel=spec.vocab_parallel, sequence_parallel=spec.sequence_parallel_enabled
        )
    )
