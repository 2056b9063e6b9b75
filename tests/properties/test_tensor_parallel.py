"""Tensor parallelism in the programs, with ranks as threads (tests/support/thread_ranks.py).

- every rank of a tp-way split (dense, or a mixture of experts with or without expert parallelism, hybrid sharding included) gives the logits of one rank holding everything, through a prefill
  and decode steps, whatever the head counts (GQA replication, zero-padded heads, MHA conversion),
  with the embedding split along hidden or vocabulary, with and without sequence parallelism, and
  with flash decoding (each rank caching 1/g of the sequence) wherever the layout allows it;
- every rank holds exactly the per-rank shapes the sharding plan (what `nxdi plan` reports) says;
- a rank plan reads every source row it needs and no other (its Takes cover the original rows).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdi.core.config.sub_specs import HybridShardingSpec, MoESpec
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import sharding
from nxdi.core.planning.partition import Partition, partition_of
from nxdi.core.planning.rank_weights import rank_plan
from nxdi.core.programs import inputs, kv_cache
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.testing.strategies.decoders import (
    cast_floats,
    decoder_specs,
    dense_specs,
    plan_of,
    program_of,
    random_state_dict,
    random_weights,
)
from tests.support.program_checks import DTYPE
from tests.support.program_checks import close as _close
from tests.support.thread_ranks import run_ranks

SEEDS = st.integers(0, 2**31 - 1)


@attrs.frozen
class TPCase:
    spec: ModelSpec
    tp: int
    vocab_parallel: bool
    sequence_parallel: bool
    moe_ep: int = 1
    """Expert groups (a mixture of experts: a divisor of tp and of the experts)."""
    tkg_ep: int | None = None
    """Hybrid sharding: token generation's expert groups, when they differ from `moe_ep`."""

    def shard(self) -> sharding.ShardPlan:
        return sharding.shard_plan(
            self.spec,
            tp=self.tp,
            fused_qkv=True,
            vocab_parallel=self.vocab_parallel,
            moe_ep=self.moe_ep,
            tkg_ep=self.tkg_ep,
        ).unwrap()

    def moe(self) -> MoESpec | None:
        if not self.spec.is_moe:
            return None
        if self.tkg_ep is None:
            return MoESpec(moe_tp_degree=self.tp // self.moe_ep, moe_ep_degree=self.moe_ep)
        degrees = (self.tp // self.moe_ep, self.moe_ep, self.tp // self.tkg_ep, self.tkg_ep)
        names = ("moe_cte_tp_degree", "moe_cte_ep_degree", "moe_tkg_tp_degree", "moe_tkg_ep_degree")
        return MoESpec(hybrid_sharding_config=HybridShardingSpec(**dict(zip(names, degrees, strict=True))))

    def partition(self) -> Partition:
        moe = self.moe()
        return partition_of(
            self.shard(),
            self.spec,
            vocab_parallel=self.vocab_parallel,
            sequence_parallel=self.sequence_parallel,
            moe=moe,
        )


@st.composite
def tp_cases(draw: st.DrawFn) -> TPCase:
    spec, tp = draw(decoder_specs()), draw(st.integers(2, 4))
    groups = [g for g in range(1, tp + 1) if tp % g == 0 and spec.is_moe and spec.num_experts % g == 0] or [1]
    moe_ep = draw(st.one_of(st.just(groups[-1]), st.sampled_from(groups)))  # the most expert groups, often
    tkg_ep = draw(st.sampled_from(groups))  # hybrid sharding when it differs
    return TPCase(spec, tp, draw(st.booleans()), draw(st.booleans()), moe_ep, tkg_ep if tkg_ep != moe_ep else None)


def _rank_weights(case: TPCase, seed: int) -> tuple[sharding.ShardPlan, list[Any]]:
    spec, tp, shard = case.spec, case.tp, case.shard()
    state = random_state_dict(spec, seed)
    program = program_of(spec)
    weights = []
    for rank in range(tp):
        tensors = weight_ops.convert(rank_plan(plan_of(spec), shard, rank).unwrap(), state).unwrap()
        weights.append(program.weights(cast_floats(tensors, DTYPE), spec=spec))
    return shard, weights


def _run(spec: ModelSpec, w: Any, part: Partition, coll: Collectives, toks: list[int], bucket: int) -> torch.Tensor:
    """Prefill `toks[:m]` in a `bucket` (a multiple of tp), then decode the rest; logits [steps, V]."""
    program = program_of(spec)
    m = len(toks) // 2
    length = part.cache_slots(bucket + len(toks))
    cache = kv_cache.empty_cache(spec, batch=1, length=length, dtype=DTYPE, heads=part.kv_heads)
    prompt = inputs.prompt_inputs([toks[:m]], length=bucket)
    logits, part_cache = program.forward(
        w, cache.prefix(part.cache_slots(bucket)), prompt, spec=spec, part=part, coll=coll
    )
    cache = cache.splice(part_cache)
    out = [logits[0, 0]]
    for p in range(m, len(toks)):
        x = inputs.token_inputs(torch.tensor([toks[p]]), torch.tensor([p]))
        logits, cache = program.forward(w, cache, x, spec=spec, part=part, coll=coll)
        out.append(logits[0, 0])
    return torch.stack(out)


@settings(deadline=None, max_examples=25)
@given(case=tp_cases(), seed=SEEDS, n=st.integers(2, 8))
def test_every_rank_gives_the_logits_of_one_rank(case: TPCase, seed: int, n: int) -> None:
    spec, tp = case.spec, case.tp
    toks = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    bucket = -(-n // tp) * tp  # sequence parallelism splits the context bucket over the ranks
    expected = _run(spec, random_weights(spec, seed, DTYPE), Partition.single(spec), SINGLE, toks, bucket)
    _, weights = _rank_weights(case, seed)
    part = case.partition()
    for got in run_ranks(tp, lambda rank, coll: _run(spec, weights[rank], part, coll, toks, bucket)):
        _close(got, expected)


@st.composite
def flash_decoding_cases(draw: st.DrawFn) -> tuple[ModelSpec, int]:
    """A spec and a tp where flash decoding applies: groups of g >= 2 ranks share each KV head."""
    kv = draw(st.integers(1, 2))
    tp = kv * draw(st.integers(2, 4 // kv))
    heads = kv * draw(st.integers(-(-tp // kv), 4))  # at least tp query heads
    spec = draw(dense_specs())
    return attrs.evolve(spec, num_kv_heads=kv, num_attention_heads=heads, hidden_size=heads * spec.head_dim), tp


@settings(deadline=None, max_examples=20)
@given(case=flash_decoding_cases(), seed=SEEDS, n=st.integers(3, 10))
def test_flash_decoding_gives_the_logits_of_one_rank(case: tuple[ModelSpec, int], seed: int, n: int) -> None:
    spec, tp = case
    toks = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    bucket = n + 1  # any length: the ranks of a group hold ceil(T / g) slots each
    expected = _run(spec, random_weights(spec, seed, DTYPE), Partition.single(spec), SINGLE, toks, bucket)
    shard, weights = _rank_weights(TPCase(spec, tp, vocab_parallel=False, sequence_parallel=False), seed)
    part = partition_of(shard, spec, kv_group=tp // spec.num_kv_heads)
    assert shard.counts.kv_per_rank == 1
    for got in run_ranks(tp, lambda rank, coll: _run(spec, weights[rank], part, coll, toks, bucket)):
        _close(got, expected)


@settings(deadline=None, max_examples=25)
@given(case=tp_cases(), seed=SEEDS)
def test_every_rank_holds_the_shapes_the_planner_reports(case: TPCase, seed: int) -> None:
    spec, tp, shard = case.spec, case.tp, case.shard()
    entries = {w.name: w for w in shard.weights}
    state = random_state_dict(spec, seed)
    for rank in range(tp):
        tensors = weight_ops.convert(rank_plan(plan_of(spec), shard, rank).unwrap(), state).unwrap()
        for name, t in tensors.items():
            pattern = name if not name.startswith("layers.") else "layers.{i}." + name.split(".", 2)[2]
            assert tuple(t.shape) == entries[pattern].rank_shape(rank), name


@given(case=tp_cases())
def test_the_ranks_together_read_every_source_row_and_nothing_else(case: TPCase) -> None:
    spec, tp, shard = case.spec, case.tp, case.shard()
    read: dict[tuple[str, int], set[int]] = {}
    keys: set[str] = set()  # every key some rank reads (expert parallelism: each expert by its group)
    for rank in range(tp):
        for step in rank_plan(plan_of(spec), shard, rank).unwrap().steps:
            for i, (key, shape) in enumerate(step.source_items()):
                keys.add(key)
                take = step.take(i)
                if take is None:
                    continue  # replicated: every rank reads it whole
                rows = {r for r in take.indices if r is not None}
                assert rows <= set(range(shape[take.dim])), f"{key}: reads rows outside the source"
                read.setdefault((key, take.dim), set()).update(rows)
    sources = plan_of(spec).source_shapes()
    assert keys >= set(sources), f"read by no rank: {sorted(set(sources) - keys)[:3]}"
    for (key, dim), rows in read.items():
        assert rows == set(range(sources[key][dim])), f"{key}: some rows are read by no rank"
