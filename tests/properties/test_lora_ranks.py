"""Properties of how tensor-parallel ranks hold the stacked LoRA adapters (`nxdi.core.planning.lora_ranks`).

On tiny random specs at tp 1, 2, 3 and 4, either layout, with and without `lora_shard_linear_layer`:
- every rank's slices have the same shapes (one program serves every rank);
- a split plain matrix's chunks, in rank order, are its indices then zero padding (what a step's
  all-gather puts back, cut to `gathers`' size);
- a matrix that follows the base layer's split holds, over all ranks, every one of its rows
  (columns) and only those; a duplicated plain matrix is whole on every rank;
- `bytes_per_slot` is the bytes of `rank_shapes` over the slots, and with one rank the adapter size
  the planner counts (`lora.adapter_size`).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Success

from nxdi.core.config.sub_specs import LoraSpec
from nxdi.core.planning import lora as lora_plan
from nxdi.core.planning import lora_ranks, sharding
from nxdi.testing.strategies.decoders import LLAMA_SHAPED, dense_specs


@st.composite
def cases(draw: st.DrawFn) -> tuple[lora_plan.LoraLayout, sharding.ShardPlan, bool]:
    model = draw(dense_specs(model_types=LLAMA_SHAPED))
    modules = draw(st.sets(st.sampled_from(lora_plan.KNOWN_MODULES), min_size=1))
    spec = LoraSpec(
        max_loras=draw(st.integers(1, 3)),
        max_lora_rank=draw(st.integers(1, 4)),
        target_modules=tuple(sorted(modules)),
        lora_memory_transpose=draw(st.booleans()),
    )
    layout = lora_plan.layout_for(model, spec).unwrap()
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    plan = sharding.shard_plan(model, tp=tp, fused_qkv=draw(st.booleans()))
    if not isinstance(plan, Success):  # heads this tp cannot split: the planner refuses them
        tp, plan = 1, sharding.shard_plan(model, tp=1)
    return layout, plan.unwrap(), draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(cases())
def test_ranks_hold_equal_shapes_and_together_every_index(
    case: tuple[lora_plan.LoraLayout, sharding.ShardPlan, bool],
) -> None:
    layout, plan, shard = case
    shapes = layout.shapes()
    ranks = [lora_ranks.rank_takes(layout, plan, r, shard_linear=shard) for r in range(plan.tp)]
    gathered = lora_ranks.gathers(layout, plan, shard_linear=shard)
    assert set(gathered) <= set(shapes) and (not gathered or (shard and plan.tp > 1))
    for name, shape in shapes.items():
        takes = [r[name] for r in ranks]
        if all(t is None for t in takes):  # a duplicated plain matrix
            assert name not in gathered and (not shard or plan.tp == 1)
            continue
        assert all(t is not None and t.dim == takes[0].dim for t in takes), name  # type: ignore[union-attr]
        assert len({len(t.indices) for t in takes if t is not None}) == 1, name
        every = [i for t in takes if t is not None for i in t.indices]
        dim = takes[0].dim  # type: ignore[union-attr]
        real = [i for i in every if i is not None]
        assert set(real) == set(range(shape[dim])), name
        if name in gathered:  # chunks in rank order, then zero padding
            assert gathered[name] == shape[dim]
            assert every == [*range(shape[dim]), *[None] * (len(every) - shape[dim])], name


@settings(max_examples=60, deadline=None)
@given(cases())
def test_bytes_per_slot_are_the_rank_shapes_and_at_one_rank_the_planned_size(
    case: tuple[lora_plan.LoraLayout, sharding.ShardPlan, bool],
) -> None:
    layout, plan, shard = case
    held = lora_ranks.rank_shapes(layout, plan, shard_linear=shard)
    per_slot = sum(a * b for _, a, b in held.values())
    assert all(s == layout.slots for s, _, _ in held.values())
    assert lora_ranks.bytes_per_slot(layout, plan, shard_linear=shard, dtype_bytes=2) == 2 * per_slot
    if plan.tp == 1:
        size = lora_plan.adapter_size(layout.model, rank=layout.rank, target_modules=layout.modules, dtype="bfloat16")
        assert size.unwrap().total_bytes == 2 * per_slot
