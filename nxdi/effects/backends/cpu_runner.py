"""Load-time rewrite that calls a bound graph's op nodes from C++. Effects: none beyond the graph.

A bound decode step is a few hundred graph nodes (about 290 for the 1.1B shape), and the graph's
Python code calls each through torch's Python bindings: a few microseconds of interpreter and
argument parsing per node, on top of the dispatch itself. `run_in_cpp` hands each long run of
dispatcher ops (and the `getitem`s of their results) to `nxdi_kernels::GraphRunner`
(`kernels/graph_runner.cpp`), which makes the same calls, with the same arguments, in the same
order, from C++: the same results bit for bit, and the same in-place writes. What it cannot encode
stays in Python and ends a run: calls of Python functions, ops whose arguments hold something
other than tensors from the graph and plain constants, and results other than tensors needed
outside the run.

Tensors bound at load (weights, folded constants: the first placeholders, `bound`) are held by the
runner; each call passes only the others (cache, inputs, values from Python nodes before the run).
Measured in docs/cpu-backend.md, "Graph runs in C++".
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor, fx

MIN_CALLS = 8
"""Runs of fewer op calls stay in Python: the runner's call costs about what a few nodes do."""

# The runner's instructions and argument kinds (kernels/graph_runner.cpp).
_CALL = 0
_ITEM = 1
_FREE = 2
_SLOT = 0
_CONSTANT = 1
_TENSORS = 2
_OPTIONAL_TENSORS = 3
_EMPTY_LIST = 4
_CONSTANT_TYPES = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format, type(None))


def run_in_cpp(gm: fx.GraphModule, bound: Sequence[Tensor], min_calls: int = MIN_CALLS) -> int:
    """Replace each run of at least `min_calls` encodable op calls in `gm` (see the module) with one
    call of a `GraphRunner`; `bound` are the tensors bound to the graph's first placeholders.
    Returns the number of op calls moved to C++. Needs the kernels library (`kernels.load()`).

    Raises:
        RuntimeError: the runner refused a program this module made (a bug, not a user error).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    held = {node: t for node, t in zip(placeholders, bound, strict=False)}
    refused: set[fx.Node] = set()
    while True:  # a run whose non-tensor result is needed outside it is cut before that node
        runs = _runs(gm.graph, refused)
        cut = {n for run in runs for n in _outputs(run) if not _is_tensor(n)}
        if not cut:
            break
        refused |= cut
    long_runs = [run for run in runs if _calls(run) >= min_calls]
    for i, run in enumerate(long_runs):
        _replace(gm, run, held, f"_nxdi_runner_{i}")
    return sum(_calls(run) for run in long_runs)


def _calls(run: list[fx.Node]) -> int:
    return sum(n.target is not operator.getitem for n in run)


def _schema_args(node: fx.Node) -> list[object] | None:
    """The node's argument values in its op's schema order, defaults filled in; None if missing."""
    schema = node.target._schema  # type: ignore[union-attr]
    values: list[object] = []
    for i, a in enumerate(schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            values.append(node.args[i])
        elif a.name in node.kwargs:
            values.append(node.kwargs[a.name])
        elif a.has_default_value():
            values.append(a.default_value)
        else:
            return None
    return values


def _encodable(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    values = _schema_args(node)
    if values is None:
        return False
    if len(schema.returns) > 1:  # each result gets one slot: one getitem per result
        taken = [u.args[1] for u in node.users if u.target is operator.getitem]
        if len(taken) != len(set(taken)):
            return False
    for a, v in zip(schema.arguments, values, strict=True):
        if isinstance(v, (list, tuple)):
            nodes = [e for e in v if isinstance(e, fx.Node)]
            if nodes and str(a.type) not in ("List[Tensor]", "List[Optional[Tensor]]"):
                return False
            if nodes and not all(isinstance(e, fx.Node) or e is None for e in v):
                return False
            if not nodes and not all(isinstance(e, _CONSTANT_TYPES) for e in v):
                return False
        elif not isinstance(v, (fx.Node, *_CONSTANT_TYPES)):
            return False
    return True


def _runs(graph: fx.Graph, refused: set[fx.Node]) -> list[list[fx.Node]]:
    """Maximal runs of consecutive encodable nodes: op calls, and getitems of a call in the run."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    members: set[fx.Node] = set()
    for node in graph.nodes:
        is_item = node.op == "call_function" and node.target is operator.getitem and node.args[0] in members
        if node not in refused and (is_item or _encodable(node)):
            current.append(node)
            members.add(node)
            continue
        if current:
            runs.append(current)
        current, members = [], set()
    if current:
        runs.append(current)
    return runs


def _outputs(run: list[fx.Node]) -> list[fx.Node]:
    """The run's nodes used outside it, in run order."""
    inside = set(run)
    return [n for n in run if any(u not in inside for u in n.users)]


def _is_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if val is not None:
        return isinstance(val, Tensor)
    if node.target is operator.getitem:
        return False  # unknown without a meta value: keep it in Python
    returns = node.target._schema.returns  # type: ignore[union-attr]
    return len(returns) == 1 and str(returns[0].type) == "Tensor"


@attrs.define
class _Program:
    """A run being encoded: slots (held, then inputs, then made), code, constants."""

    held_nodes: list[fx.Node]
    inputs: list[fx.Node]
    slot: dict[fx.Node, int]
    names: list[str] = attrs.Factory(list)
    overloads: list[str] = attrs.Factory(list)
    ops: dict[object, int] = attrs.Factory(dict)
    code: list[int] = attrs.Factory(list)
    constants: list[object] = attrs.Factory(list)

    def op(self, target: torch._ops.OpOverload) -> int:
        if target not in self.ops:
            self.ops[target] = len(self.names)
            self.names.append(target._schema.name)
            self.overloads.append(target._schema.overload_name)
        return self.ops[target]

    def new_slot(self) -> int:
        """The next slot; the caller gives it to a node at once, so `len(slot)` counts them all."""
        return len(self.slot)

    def arg(self, type_name: str, v: object) -> list[int]:
        if isinstance(v, fx.Node):
            return [_SLOT, self.slot[v]]
        if isinstance(v, (list, tuple)) and any(isinstance(e, fx.Node) for e in v):
            kind = _TENSORS if type_name == "List[Tensor]" else _OPTIONAL_TENSORS
            return [kind, len(v), *(-1 if e is None else self.slot[e] for e in v)]  # type: ignore[index]
        if isinstance(v, (list, tuple)) and not v:
            return [_EMPTY_LIST]  # its element type comes from the schema, in C++
        self.constants.append(list(v) if isinstance(v, tuple) else v)
        return [_CONSTANT, len(self.constants) - 1]


def _replace(gm: fx.GraphModule, run: list[fx.Node], held: dict[fx.Node, Tensor], name: str) -> None:
    """Encode `run`, put one runner call where it was (the module's attribute `name`), and erase it."""
    inside = set(run)
    external: list[fx.Node] = []
    for node in run:
        for used in node.all_input_nodes:
            if used not in inside and used not in external:
                external.append(used)
    held_nodes = [n for n in external if n in held]
    inputs = [n for n in external if n not in held]
    p = _Program(held_nodes, inputs, {n: i for i, n in enumerate(held_nodes + inputs)})
    outputs = _outputs(run)
    last_use: dict[fx.Node, fx.Node] = {}
    for node in run:
        for used in node.all_input_nodes:
            if used not in held:
                last_use[used] = node
    freed_after: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_use.items():
        if value not in outputs:
            freed_after.setdefault(user, []).append(value)
    for node in run:
        if node.target is operator.getitem:
            source, index = node.args
            returns = source.target._schema.returns  # type: ignore[union-attr]
            if len(returns) == 1:  # one list result: take its element
                p.slot[node] = p.new_slot()
                p.code += [_ITEM, p.slot[source], int(index), p.slot[node]]  # type: ignore[call-overload]
            # else: the call's result `index` already has this node's slot
        else:
            target: torch._ops.OpOverload = node.target  # type: ignore[assignment]
            schema = target._schema
            values = _schema_args(node)
            assert values is not None  # _encodable
            p.code += [_CALL, p.op(target), len(values)]
            for a, v in zip(schema.arguments, values, strict=True):
                p.code += p.arg(str(a.type), v)
            rets: list[int] = []
            if len(schema.returns) == 1:
                p.slot[node] = p.new_slot()
                rets = [p.slot[node]]
            else:
                items = {int(u.args[1]): u for u in node.users if u in inside and u.target is operator.getitem}  # type: ignore[call-overload]
                for k in range(len(schema.returns)):
                    if k in items:
                        p.slot[items[k]] = p.new_slot()
                    rets.append(p.slot[items[k]] if k in items else -1)
            p.code += [len(rets), *rets]
        for value in freed_after.get(node, ()):
            if value in p.slot:  # a call of several results has none: its getitems do
                p.code += [_FREE, p.slot[value]]
    runner = torch.classes.nxdi_kernels.GraphRunner(
        p.names,
        p.overloads,
        p.code,
        p.constants,
        [held[n] for n in held_nodes],
        len(inputs),
        len(p.slot),
        [p.slot[n] for n in outputs],
    )
    setattr(gm, name, runner)
    graph = gm.graph
    with graph.inserting_before(run[0]), warnings.catch_warnings():
        # fx warns of a get_attr that is neither a tensor nor a module; the runner is neither
        warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node")
        attr = graph.get_attr(name)
        call = graph.call_method("run", (attr, list(inputs)))
        for k, node in enumerate(outputs):
            item = graph.call_function(operator.getitem, (call, k))
            item.meta = dict(node.meta)
            node.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for node in reversed(run):
        graph.erase_node(node)
