"""Rank weight plans: the weight plan of one tensor-parallel rank, read slice by slice. Pure.

Theory of operation. The sharding plan (`sharding.ShardPlan`) says, for every weight, along which
dim it is split, how its padded layout is built from the original (GQA head replication and zero
padding, a padded intermediate or vocabulary size), and which spans of that layout each rank holds.
`rank_plan` turns this into a `Take` per source of every step of the model's weight plan: the
original indices the rank needs, in order, None for a zero row. The checkpoint reader then reads
only the range of rows a Take spans (`Take.bounds`), so a rank holds its shard and nothing more.

- A stacked step (one source per expert) takes the same rows or columns of every expert; so does
  a split one (DBRX's [X*F, E] experts: the rank's rows of F in every expert, one Take whose read
  spans nearly the whole tensor, since every expert holds a share). Under expert parallelism
  either reads only the experts of the rank's group.
- A fused step (Q, K and V concatenated) gets one Take per source: the rank's Q rows from q_proj,
  its K rows from k_proj, its V rows from v_proj, which concatenate into its `[Q_r; K_r; V_r]`.
- A tied lm_head stays an alias of the embedding only when both are split alike (vocab-parallel);
  otherwise the rank reads the embedding again, sliced as an lm_head.
- Under hybrid sharding (`ShardPlan.hybrid`) every experts step gets a twin (`tkg_twin`), token
  generation's layout of the same checkpoint tensors, sliced by its own sharding entry.
- Replicated weights (norms, row-parallel biases) are read whole by every rank.
- A quantized linear's scales follow its rows: split by output rows, a rank reads the scales of
  the rows it holds; split by input columns, it reads them all. Blockwise scales follow their
  blocks along the split dim, which a rank must hold whole.
"""

from __future__ import annotations

import re

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem
from nxdi.core.planning.sharding import ShardPlan, WeightShard
from nxdi.core.weight_plan import Combine, SplitExperts, Take, WeightPlan, WeightStep, transposes
from nxdi.core.weight_table import ExpertRows, scale_name, tkg_twin

_LAYER = re.compile(r"^layers\.\d+\.")


def _pattern(name: str) -> str:
    """`layers.3.mlp.up_proj.weight` -> `layers.{i}.mlp.up_proj.weight` (the sharding plan's names)."""
    return _LAYER.sub("layers.{i}.", name)


def _padded_indices(shard: WeightShard, rank: int) -> list[list[int | None]]:
    """Per span of `rank`, the original index of every padded index it holds (None: zero)."""
    assert shard.dim is not None
    size = shard.shape[shard.dim]
    layout = shard.remap.indices() if shard.remap is not None else tuple(range(size))
    return [list(layout[start:stop]) for start, stop in shard.rank_spans[rank]]


def _takes(step: WeightStep, shard: WeightShard, rank: int) -> tuple[Take, ...]:
    """One Take per source of `step`: its rows (along the split dim) that `rank` holds."""
    assert shard.dim is not None
    spans = _padded_indices(shard, rank)
    split = next((t for t in step.transforms if isinstance(t, SplitExperts)), None)
    if split is not None:
        own = _expert_span(shard, rank, split.experts)
        return (_expert_rows_take(step, split, shard, [i for span in spans for i in span], own),)
    if step.combine is Combine.STACK:  # the split dim counts the stacked expert dim; each expert is split alike
        assert shard.dim > 0, "experts are split inside each expert, not across them"
        every = Take(dim=shard.dim - 1, indices=[i for span in spans for i in span])
        return (every,) * len(step.sources)
    if len(step.sources) == 1:
        return (Take(dim=shard.dim, indices=[i for span in spans for i in span]),)
    # Fused: the shard's layout indexes the concatenation of the sources; span k lies in source k.
    offsets = [sum(s[shard.dim] for s in step.source_shapes[:k]) for k in range(len(step.sources))]
    takes = []
    for k, span in enumerate(spans):
        size = step.source_shapes[k][shard.dim]
        local = [None if i is None else i - offsets[k] for i in span]
        assert all(i is None or 0 <= i < size for i in local), "a fused span must lie in its own source"
        takes.append(Take(dim=shard.dim, indices=local))
    return tuple(takes)


def _in_source_order(step: WeightStep, takes: tuple[Take, ...]) -> tuple[Take, ...]:
    """A rank's Takes (indices of the program's layout) as indices of the stored sources: through
    the step's own Takes (a source ordering its rows otherwise, `RowOrder`), and along the other dim
    of a source stored transposed (GPT-2's Conv1D: the program's rows are its columns)."""
    if transposes(step):
        takes = tuple(attrs.evolve(t, dim=1 - t.dim) for t in takes)
    out = []
    for k, take in enumerate(takes):
        base = step.take(k)
        if base is not None:
            assert base.dim == take.dim, "a source's row order and the rank's split are along one dim"
            take = Take(dim=take.dim, indices=[None if i is None else base.indices[i] for i in take.indices])
        out.append(take)
    return tuple(out)


def _expert_span(shard: WeightShard, rank: int, experts: int) -> range:
    """The experts `rank` holds of an experts weight: its group's under expert parallelism, else all."""
    return range(*shard.expert_spans[rank]) if shard.expert_spans is not None else range(experts)


def _own_experts(step: WeightStep, shard: WeightShard, rank: int) -> WeightStep:
    """An experts step reading only the experts `rank` holds under expert parallelism (all without):
    a stacked step keeps those experts' sources, a split one (DBRX) splits out only their rows."""
    if shard.expert_spans is None:
        return step
    own = _expert_span(shard, rank, len(step.sources))
    if any(isinstance(t, SplitExperts) for t in step.transforms):  # its Take already picked the rows
        fewer = tuple(attrs.evolve(t, experts=len(own)) if isinstance(t, SplitExperts) else t for t in step.transforms)
        return attrs.evolve(step, transforms=fewer)
    assert step.combine is Combine.STACK, "only experts weights are split across experts"
    takes = step.takes[own.start : own.stop] if step.takes else ()
    return attrs.evolve(
        step,
        sources=step.sources[own.start : own.stop],
        source_shapes=step.source_shapes[own.start : own.stop],
        takes=takes,
    )


def _expert_rows_take(
    step: WeightStep, split: SplitExperts, shard: WeightShard, rows: list[int | None], own: range
) -> Take:
    """The Take of one [X*F, E] source holding every expert (DBRX): the rank's `rows` of F (padded
    layout, None for zero padding) in each of its experts `own`, expert by expert, so that they split
    into the rank's [X_r, F_r, E] (or [X_r, E, F_r]). Expert x's row f is source row x*F + f."""
    f_dim = 2 if split.rows is ExpertRows.TRANSPOSED else 1
    assert shard.dim == f_dim, "experts are split inside each expert, along F"
    f = step.source_shapes[0][0] // split.experts
    return Take(dim=0, indices=[None if i is None else x * f + i for x in own for i in rows])


def _scale_takes(
    step: WeightStep, values: WeightStep, shard: WeightShard, rank: int, block: tuple[int, int] | None
) -> Result[WeightStep, Problem]:
    """A quantized linear's scale step, reading the scales of the part of `values` that `rank` holds.

    One scale per row (`block` None): split along its output rows (dim 0), the rank's scales are
    those of its rows (a per-tensor scale, repeated over the rows by the plan's own Take, stays
    repeated); split along its input (dim 1) or replicated, every rank holds every row, so every
    scale. Blockwise (`block` = (rows, columns) per scale): the rank's rows or columns along the
    split dim must be whole blocks (zero padding whole blocks of it), and it reads their scales.

    Returns:
        Failure naming `quantization_block_size` when the rank's share cuts a block.
    """
    if shard.dim is None or (block is None and shard.dim != 0):
        return Success(step)
    size = 1 if block is None else block[shard.dim]
    takes = []
    for k, cells in enumerate(_takes(values, shard, rank)):
        base = step.take(k)  # the scale rows of a source stored in another row order (one per row)
        assert base is None or shard.dim == 0, f"{values.name}: a row-reordered weight (fused QKV) is split by rows"
        blocks = _blocks(cells.indices, size)
        if blocks is None:
            axis = "rows" if shard.dim == 0 else "columns"
            why = (
                f"cuts blocks of {values.name}: rank {rank} holds {len(cells.indices)} of its {axis}, "
                f"which are not whole blocks of {size}"
            )
            fix = "choose a block size that divides each rank's share, or another tp_degree"
            return Failure(Problem.of("quantization_block_size", list(block or ()), why, fix))
        picked = blocks if base is None else [None if b is None else base.indices[b] for b in blocks]
        takes.append(Take(dim=shard.dim, indices=picked))
    return Success(attrs.evolve(step, takes=tuple(takes)))


def _blocks(indices: tuple[int | None, ...], size: int) -> list[int | None] | None:
    """The block index of each run of `size` indices (None for a run of zero padding), or None
    when a run is not one whole block (`size` consecutive indices from a multiple of `size`)."""
    if len(indices) % size:
        return None
    out: list[int | None] = []
    for start in range(0, len(indices), size):
        run = indices[start : start + size]
        if all(i is None for i in run):
            out.append(None)
            continue
        first = run[0]
        if first is None or first % size or list(run) != list(range(first, first + size)):
            return None
        out.append(first // size)
    return out


def _same_split(a: WeightShard, b: WeightShard) -> bool:
    return (a.dim, a.rank_spans, a.remap) == (b.dim, b.rank_spans, b.remap)


def rank_plan(plan: WeightPlan, shard: ShardPlan, rank: int) -> Result[WeightPlan, ConfigError]:
    """The weight plan of `rank`: every step of `plan` reading only the rank's slice of its sources.

    Returns:
        `Success(WeightPlan)` whose step shapes are the rank's shapes, or `Failure` when `rank` is
        out of range or a step has no entry in the sharding plan (the two describe different models).
    """
    if not 0 <= rank < shard.tp:
        return Failure(ConfigError.of("rank", rank, f"must lie in 0..{shard.tp - 1}"))
    if shard.hybrid:
        twins = tuple(attrs.evolve(s, name=t) for s in plan.steps if (t := tkg_twin(s.name)) is not None)
        plan = attrs.evolve(plan, steps=(*plan.steps, *twins))
    table = {w.name: w for w in shard.weights}
    values_of = {scale_name(s.name): s for s in plan.steps if s.quantized}
    missing = [s.name for s in plan.steps if _pattern(s.name) not in table and s.name not in values_of]
    if missing:
        why = "has no entry in the sharding plan"
        return Failure(ConfigError(problems=tuple(Problem.of(n, "<missing>", why) for n in missing)))
    by_name = {s.name: s for s in plan.steps}
    block = None if plan.quant is None else plan.quant.scale_block()
    steps, problems = [], []
    for step in plan.steps:
        if (values := values_of.get(step.name)) is not None:
            match _scale_takes(step, values, table[_pattern(values.name)], rank, block):
                case Success(scales):
                    steps.append(scales)
                case Failure(problem):
                    problems.append(problem)
            continue
        entry = table[_pattern(step.name)]
        if step.combine is Combine.ALIAS:
            target = by_name[step.sources[0]]
            if _same_split(entry, table[_pattern(target.name)]):
                steps.append(step)
                continue
            # Split differently from the tensor it aliases: read that tensor's source again, as this weight.
            step = attrs.evolve(step, sources=target.sources, combine=Combine.COPY, transforms=target.transforms)
        if entry.dim is not None:
            step = attrs.evolve(step, takes=_in_source_order(step, _takes(step, entry, rank)))
        steps.append(_own_experts(step, entry, rank))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    # The model's keys this rank does not read (other expert groups' experts) stay known, unused.
    read = {k for s in steps if s.combine is not Combine.ALIAS for k in s.sources}
    optional = (plan.optional | plan.read_keys()) - read
    return Success(attrs.evolve(plan, steps=tuple(steps), optional=optional))


def block_problems(plan: WeightPlan, shard: ShardPlan) -> tuple[Problem, ...]:
    """Every blockwise scale block some rank's share cuts (the first such rank's list; nothing for
    other schemes, which have no blocks to cut). What a model checks before it starts its ranks."""
    if plan.quant is None or plan.quant.scale_block() is None or shard.tp == 1:
        return ()
    for rank in range(shard.tp):
        ranked = rank_plan(plan, shard, rank)
        if isinstance(ranked, Failure):
            return ranked.failure().problems
    return ()
