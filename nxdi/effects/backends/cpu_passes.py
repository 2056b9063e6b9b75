"""Load-time rewrites of a traced CPU program: oneDNN-prepacked linear weights, in-place cache writes.
Effects: allocates the packed weight copies.

Theory of operation. A saved program is the pure graph (weights are inputs, cache writes are
out of place). When weights are bound, two rewrites make it fast without changing its results:

1. **Prepacked linears.** `aten.linear(x, w)` with `w` a weight input becomes a oneDNN matmul on a
   copy of `w` reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`). A
   plain-layout weight is otherwise reordered on *every* call, which dominates bf16 decode on CPUs
   without AMX (2-5x per linear at batch 1, see docs/cpu-backend.md). The packed copy is opaque
   (an mkldnn tensor), so it lives in the bound module, never in a saved file.
2. **In-place cache writes.** A functional write of a cache input (`index_copy`, `scatter`,
   `index_put`) becomes its in-place twin when nothing reads the old cache (or a view of it) after
   the write, so a decode step does not copy the whole cache view per layer. The result is the
   caller's tensor itself, which is why runs treat the given cache as consumed.

Both rewrites are checked against the pure form by tests (same outputs, same new cache).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor, fx

_LINEAR = torch.ops.aten.linear.default
_IN_PLACE = {
    torch.ops.aten.index_copy.default: torch.ops.aten.index_copy_.default,
    torch.ops.aten.scatter.src: torch.ops.aten.scatter_.src,
    torch.ops.aten.scatter.value: torch.ops.aten.scatter_.value,
    torch.ops.aten.index_put.default: torch.ops.aten.index_put_.default,
}
"""Functional cache writes and their in-place twins (same arguments, result aliases argument 0)."""


def packable_dtypes() -> frozenset[torch.dtype]:
    """Weight dtypes this CPU's oneDNN build can prepack (empty without oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        dtypes.add(torch.float16)
    return frozenset(dtypes)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` with a prepacked weight: x [..., K], packed [N, K] (mkldnn layout) -> [..., N]."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def _rows(node: fx.Node) -> int:
    """The number of rows (product of leading dims) of a linear's input, the oneDNN packing hint."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if val is None:
        return 1
    rows = 1
    for d in val.shape[:-1]:
        rows *= int(d)
    return max(rows, 1)


def prepack_linears(
    gm: fx.GraphModule, weight_nodes: Sequence[fx.Node], weights: Sequence[Tensor], dtypes: frozenset[torch.dtype]
) -> int:
    """Rewrite every `linear(x, w)` whose `w` is a 2-D weight input of a packable dtype. Returns the count.

    Each such weight is packed once (shared by all its linears) and held as a module attribute.
    """
    graph, count = gm.graph, 0
    for i, (node, w) in enumerate(zip(weight_nodes, weights, strict=True)):
        users = [u for u in node.users if u.target is _LINEAR and u.args[1] is node]
        if not users or w.dim() != 2 or w.dtype not in dtypes:
            continue
        attr = f"_nxdi_packed_{i}"
        packed_w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _rows(users[0]))
        gm.register_buffer(attr, packed_w, persistent=False)
        with graph.inserting_after(node):
            packed = graph.get_attr(attr)
        for u in users:
            bias = u.args[2] if len(u.args) > 2 else None
            with graph.inserting_before(u):
                new = graph.call_function(packed_linear, (u.args[0], packed, bias))
            new.meta = dict(u.meta)
            u.replace_all_uses_with(new)
            graph.erase_node(u)
            count += 1
    return count


def _is_view(node: fx.Node) -> bool:
    """True for ops whose result may alias their first argument (views, getitem of split/unbind)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _aliases(node: fx.Node) -> set[fx.Node]:
    """`node` and every node that may be a view of it."""
    seen, stack = {node}, [node]
    while stack:
        for u in stack.pop().users:
            if u not in seen and _is_view(u) and u.args and u.args[0] in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _safe_to_mutate(cache: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Nothing reads `cache` (or a view of it) after `write` or inside it, and no view of it is an output."""
    aliases = _aliases(cache)
    if any(n in aliases for a in write.args[1:] for n in _flat_nodes(a)):
        return False  # the write's index or source reads the memory it overwrites
    for alias in aliases:
        for u in alias.users:
            if u is write or (_is_view(u) and u.args[0] is alias):
                continue
            if u.op == "output" or order[u] > order[write]:
                return False
    return True


def _flat_nodes(arg: object) -> list[fx.Node]:
    """The nodes inside an argument (which may be a list or tuple of nodes, e.g. index_put's indices)."""
    if isinstance(arg, fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [n for a in arg for n in _flat_nodes(a)]
    return []


def reinplace_cache_writes(gm: fx.GraphModule, cache_nodes: Sequence[fx.Node]) -> tuple[bool, ...]:
    """Turn each cache input's single functional write into its in-place twin where that is safe.

    Returns, per cache input, whether it is now written in place.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = []
    for cache in cache_nodes:
        writes = [u for u in cache.users if u.target in _IN_PLACE and u.args[0] is cache]
        ok = len(writes) == 1 and _safe_to_mutate(cache, writes[0], order)
        if ok:
            writes[0].target = _IN_PLACE[writes[0].target]  # type: ignore[index]  # filtered to _IN_PLACE keys above
        done.append(ok)
    return tuple(done)
