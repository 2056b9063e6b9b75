"""Multi-LoRA under tensor parallelism: which slice of every stacked adapter tensor a rank holds. Pure.

Theory of operation (the layout `nxdi.core.planning.lora` counts for capacity):
- A LoRA adapter on a linear `W [out, in]` is `A [r, in]` and `B [out, r]`. One of the two follows
  the base layer's tensor-parallel split exactly as the base weight does (GQA head replication and
  zero padding included): B's rows for a column-parallel base (the fused QKV, gate, up), A's
  columns for a row-parallel one (o, down). So each rank computes its share of the base output
  plus its share of the adapter's, with no collective of its own: a column-parallel rank adds
  `B_r (A x)` to its output rows; a row-parallel rank adds `B (A_r x_r)` to its partial sum, which
  the base layer's all-reduce (or reduce-scatter) then sums with the other ranks' (B is linear).
- The other matrix (A of a column-parallel base, B of a row-parallel one) is "plain".
  `lora_shard_linear_layer=False` keeps it whole on every rank. `True` splits it in equal chunks
  (zero padded to a multiple of tp) along the dim the product reads in full (A's `in`, B's `out`):
  a rank holds 1/tp of it, and a step all-gathers the rows' selected chunks back (`gathers`).
- Slices are `Take`s on the stacked tensors `[S, a, b]` (`LoraLayout.shapes()`, slot dim 0 never
  split), so the reader applies them as it applies the base weights' (`weight_ops.take`). Every
  rank's slices have the same shapes: one program serves every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from nxdi.core.planning import lora as lora_plan
from nxdi.core.planning.lora import TARGET_OF, LoraLayout
from nxdi.core.planning.sharding import ShardPlan, WeightShard
from nxdi.core.weight_plan import Take

T = TypeVar("T")

_ATTN = "layers.{i}.self_attn"
_MLP = "layers.{i}.mlp"
_BASE = {
    "o_proj": f"{_ATTN}.o_proj.weight",
    "gate_proj": f"{_MLP}.gate_proj.weight",
    "up_proj": f"{_MLP}.up_proj.weight",
    "down_proj": f"{_MLP}.down_proj.weight",
}
"""The program's base weight each non-QKV target module follows (Q, K and V follow the fused `Wqkv`)."""


def _row_parallel(module: str) -> bool:
    return module in lora_plan.ROW_PARALLEL_MODULES


def _base_shard(plan: ShardPlan, module: str) -> tuple[WeightShard, int | None]:
    """The base weight `module` follows, and which part of each rank's spans is the module's: Q, K
    or V's index in a fused `Wqkv` (one span per part), None when the weight is the module's own."""
    if TARGET_OF[module] == "qkv" and any(w.name == f"{_ATTN}.Wqkv.weight" for w in plan.weights):
        return plan.weight(f"{_ATTN}.Wqkv.weight"), lora_plan.QKV_MODULES.index(module)
    if TARGET_OF[module] == "qkv":  # a plan of separate Q, K, V
        return plan.weight(f"{_ATTN}.{module}.weight"), None
    return plan.weight(_BASE[module]), None


def _base_indices(layout: LoraLayout, plan: ShardPlan, module: str, rank: int) -> list[int | None]:
    """The original indices (None: zero padding) of `module`'s base output rows (column-parallel)
    or input columns (row-parallel) that `rank` holds."""
    shard, part = _base_shard(plan, module)
    if part is None:
        (span,) = _spans(shard, rank)
        return span
    q, kv = layout.model.q_size, layout.model.kv_size
    offset = (0, q, q + kv)[part]
    return [None if i is None else i - offset for i in _spans(shard, rank)[part]]


def _spans(shard: WeightShard, rank: int) -> list[list[int | None]]:
    """Per span of `rank`, the original index of every padded index it holds (None: zero)."""
    assert shard.dim is not None, f"{shard.name} is split"
    size = shard.shape[shard.dim]
    layout = shard.remap.indices() if shard.remap is not None else tuple(range(size))
    return [list(layout[start:stop]) for start, stop in shard.rank_spans[rank]]


def _chunk(size: int, tp: int, rank: int) -> list[int | None]:
    """Rank `rank`'s equal chunk of `size` indices zero padded to a multiple of tp."""
    step = -(-size // tp)
    return [i if i < size else None for i in range(rank * step, (rank + 1) * step)]


def rank_takes(layout: LoraLayout, plan: ShardPlan, rank: int, *, shard_linear: bool) -> dict[str, Take | None]:
    """Every stacked tensor's name (`layout.shapes()` order) -> the slice of it `rank` holds (a Take
    along dim 1 or 2 of the stored `[S, a, b]`), or None where it holds the whole tensor."""
    return {
        name: None if take is None else Take(dim=layout.stored_dim(take.dim), indices=take.indices)
        for name, take in _logical_takes(layout, plan, rank, shard_linear=shard_linear).items()
    }


def _logical_takes(layout: LoraLayout, plan: ShardPlan, rank: int, *, shard_linear: bool) -> dict[str, Take | None]:
    """`rank_takes` along the logical dims (A `[S, R_t, in]`, B `[S, out, R]`). Every layer is
    split alike: one layer's slices are computed and named for each layer."""
    first = _layer_takes(layout, plan, rank, shard_linear=shard_linear)
    return {name: first[_in_layer_0(name)] for name in layout.logical_shapes()}


def _in_layer_0(name: str) -> str:
    """`lora.layers.{i}.{rest}` -> `lora.layers.0.{rest}`."""
    lora_, layers, _, rest = name.split(".", 3)
    return f"{lora_}.{layers}.0.{rest}"


def _base_count(plan: ShardPlan, module: str, rank: int) -> int:
    """`len(_base_indices(...))` without building the indices (what sizes need)."""
    shard, part = _base_shard(plan, module)
    spans = shard.rank_spans[rank] if part is None else (shard.rank_spans[rank][part],)
    return sum(stop - start for start, stop in spans)


Shape3 = tuple[int, int, int]


def _layer_parts(
    layout: LoraLayout, *, shard_linear: bool, follow: Callable[[str], T], chunk: Callable[[int], T]
) -> dict[str, tuple[Shape3, tuple[int, T] | None]]:
    """Layer 0's stacked tensors -> (logical shape, None when a rank holds it whole, else the dim it is
    split along and what `follow(module)` (the base layer's split) or `chunk(size)` (equal chunks) make
    of that dim). One traversal serves the slices (`_layer_takes`) and the sizes (`bytes_per_slot`)."""
    out: dict[str, tuple[Shape3, tuple[int, T] | None]] = {}
    for target in layout.targets():
        carried = [m for m in layout.modules if TARGET_OF[m] == target]
        fan_in = layout.dims(carried[0])[0]
        a_shape = (layout.slots, layout.rank * len(carried), fan_in)
        if _row_parallel(carried[0]):  # o, down: A's columns follow the base's split
            out[lora_plan.weight_name(0, target, "a")] = (a_shape, (2, follow(carried[0])))
        else:
            out[lora_plan.weight_name(0, target, "a")] = (a_shape, (2, chunk(fan_in)) if shard_linear else None)
        for m in carried:
            fan_out = layout.dims(m)[1]
            b_shape = (layout.slots, fan_out, layout.rank)
            if _row_parallel(m):
                out[lora_plan.b_name(0, m)] = (b_shape, (1, chunk(fan_out)) if shard_linear else None)
            else:  # q, k, v, gate, up: B's rows follow the base's split
                out[lora_plan.b_name(0, m)] = (b_shape, (1, follow(m)))
    return out


def _layer_takes(layout: LoraLayout, plan: ShardPlan, rank: int, *, shard_linear: bool) -> dict[str, Take | None]:
    """The slices of layer 0's stacked tensors."""
    parts = _layer_parts(
        layout,
        shard_linear=shard_linear,
        follow=lambda m: _base_indices(layout, plan, m, rank),
        chunk=lambda size: _chunk(size, plan.tp, rank),
    )
    return {name: None if split is None else Take(dim=split[0], indices=split[1]) for name, (_, split) in parts.items()}


def rank_shapes(layout: LoraLayout, plan: ShardPlan, *, shard_linear: bool) -> dict[str, tuple[int, int, int]]:
    """Every stacked tensor's shape on a rank (the same on every rank), in `layout.shapes()` order."""
    takes = rank_takes(layout, plan, 0, shard_linear=shard_linear)
    out: dict[str, tuple[int, int, int]] = {}
    for name, shape in layout.shapes().items():
        take = takes[name]
        s, a, b = shape if take is None else take.out_shape(shape)
        out[name] = (s, a, b)
    return out


def part_widths(layout: LoraLayout, plan: ShardPlan, target: str) -> tuple[int, ...]:
    """The width on a rank of each output part of `target` (the fused QKV's Q, K and V rows, or the
    one output of another linear), whether or not an adapter targets the part."""
    if target != "qkv":
        module = next(m for m in lora_plan.KNOWN_MODULES if TARGET_OF[m] == target)
        return (layout.dims(module)[1],) if _row_parallel(module) else (len(_base_indices(layout, plan, module, 0)),)
    return tuple(len(_base_indices(layout, plan, m, 0)) for m in lora_plan.QKV_MODULES)


def gathers(layout: LoraLayout, plan: ShardPlan, *, shard_linear: bool) -> Mapping[str, int]:
    """The stacked tensors a step all-gathers after selecting the rows' adapters (the plain
    matrices, split with `shard_linear` at tp > 1) -> their full size along the split dim (the
    gathered result is cut to it: the chunks are zero padded)."""
    if not shard_linear or plan.tp == 1:
        return {}
    takes = _logical_takes(layout, plan, 0, shard_linear=True)
    shapes = layout.logical_shapes()
    out: dict[str, int] = {}
    for layer in range(layout.model.num_layers):
        for target in layout.targets():
            carried = [m for m in layout.modules if TARGET_OF[m] == target]
            if _row_parallel(carried[0]):
                names = [lora_plan.b_name(layer, m) for m in carried]
            else:
                names = [lora_plan.weight_name(layer, target, "a")]
            for name in names:
                take = takes[name]
                assert take is not None, f"{name} is split with lora_shard_linear_layer"
                out[name] = shapes[name][take.dim]
    return out


def bytes_per_slot(layout: LoraLayout, plan: ShardPlan, *, shard_linear: bool, dtype_bytes: int) -> int:
    """Bytes one adapter slot takes on one rank: what the engine allocates per slot. Counted from
    the split sizes alone (the planner asks this for every TP degree it tries)."""
    parts = _layer_parts(
        layout,
        shard_linear=shard_linear,
        follow=lambda m: _base_count(plan, m, 0),
        chunk=lambda size: -(-size // plan.tp),
    )
    total = 0
    for (_, a, b), split in parts.values():
        if split is not None:
            a, b = (split[1], b) if split[0] == 1 else (a, split[1])
        total += a * b
    return total * layout.model.num_layers * dtype_bytes
