"""The CPU backend's C++ graph runner (`cpu_runner.run_in_cpp`, `kernels/graph_runner.cpp`).

- A run of op nodes called from C++ gives the Python graph's results bit for bit: several results
  and list results taken apart by getitems, tensor lists (with and without Nones), numbers where
  a tensor goes, dtypes, defaults and keyword arguments, empty lists, in-place writes (the same
  tensor object comes back), bound tensors held by the runner; and on random chains of ops.
- Python functions, short runs, non-tensor values needed outside a run and a result taken by two
  getitems stay in Python.
- The runner refuses a program it cannot run (a constant of the wrong type, a wrong input count)
  with the op and argument named.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, fx

from nxdi.effects.backends import cpu, cpu_runner, kernels

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")

aten = torch.ops.aten


def _exported(fn: torch.nn.Module, args: Sequence[Tensor]) -> Callable[[], fx.GraphModule]:
    ep = torch.export.export(fn, tuple(args), strict=False)
    return lambda: cpu._plain_module(ep)


def _runners(gm: fx.GraphModule) -> int:
    return sum(n.op == "call_method" and n.target == "run" for n in gm.graph.nodes)


def _python_and_cpp(
    graph: Callable[[], fx.GraphModule], bound: int, args: Callable[[], list[Tensor]], min_calls: int = 1
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], list[Tensor], int, fx.GraphModule]:
    """The graph's results in Python, then with `run_in_cpp` (its first `bound` inputs bound), the
    second call's inputs, the op calls moved, and the rewritten module."""
    plain = graph()
    expected = plain(*args())
    gm = graph()
    inputs = args()
    moved = cpu_runner.run_in_cpp(gm, inputs[:bound], min_calls=min_calls)
    gm.recompile()
    return tuple(expected), tuple(gm(*inputs)), inputs, moved, gm


class _Mixed(torch.nn.Module):
    def forward(self, w: Tensor, x: Tensor, idx: Tensor, cache: Tensor) -> tuple[Tensor, ...]:
        a, b = torch.chunk(x @ w, 2, dim=-1)  # a list result
        m, i = torch.max(a, dim=-1)  # two results
        c = torch.cat([a, b * 2.5], dim=0).to(torch.bfloat16)  # a tensor list, a number, a dtype
        cache.index_copy_(0, idx, b[:1])  # in place
        y = torch.nn.functional.rms_norm(c.float(), (c.shape[-1],), eps=1e-5)  # a None default, a float
        return y.sum(dim=[0], keepdim=True) + m.unsqueeze(-1), i, cache


def test_a_mixed_program_gives_the_python_bits_and_writes_in_place() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 16, generator=g), torch.randn(3, 8, generator=g)

    def args() -> list[Tensor]:
        return [w, x, torch.tensor([1]), torch.zeros(4, 8)]

    graph = _exported(_Mixed(), args())
    expected, got, inputs, moved, gm = _python_and_cpp(graph, 1, args)
    assert moved >= 10 and _runners(gm) == 1
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    for e, r in zip(expected, got, strict=True):
        torch.testing.assert_close(r, e, rtol=0, atol=0)
    assert got[2] is inputs[3]  # the cache comes back as the very tensor written


class _Indexed(torch.nn.Module):
    def forward(self, cache: Tensor, pos: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        cache[:, pos] = v * 3 - 1  # index_put_ with [None, pos]: a tensor list holding None
        s = cache.sum(-1).to(torch.int32) + 1  # a wrapped int where a tensor goes
        whole = cache.sum().to(torch.float16) * 3.5  # 0-dim: promoted to float64 unless wrapped
        return cache, s, torch.where(s > 2, s, 0).to(torch.float64) / 7, whole


def test_optional_tensor_lists_and_wrapped_numbers() -> None:
    g = torch.Generator().manual_seed(1)
    v = torch.randn(3, 2, 5, generator=g)

    def args() -> list[Tensor]:
        return [torch.zeros(3, 6, 5), torch.tensor([4, 1]), v]

    expected, got, inputs, moved, _ = _python_and_cpp(_exported(_Indexed(), args()), 0, args)
    assert moved >= 6
    for e, r in zip(expected, got, strict=True):
        assert r.dtype == e.dtype
        torch.testing.assert_close(r, e, rtol=0, atol=0)
    assert got[0] is inputs[0]


def _graph(build: Callable[[fx.Graph, list[fx.Node]], object], n_inputs: int) -> Callable[[], fx.GraphModule]:
    """A hand-made graph: `build(graph, placeholders)` returns what it outputs."""

    def make() -> fx.GraphModule:
        graph = fx.Graph()
        xs = [graph.placeholder(f"x{i}") for i in range(n_inputs)]
        graph.output(build(graph, xs))
        return fx.GraphModule(torch.nn.Module(), graph)

    return make


def _chain(graph: fx.Graph, x: fx.Node, n: int) -> fx.Node:
    for k in range(n):
        x = graph.call_function(aten.add.Tensor, (x, k + 1), {"alpha": 2})
    return x


def _python_fn(x: Tensor) -> Tensor:
    return x * 2


def test_python_functions_and_short_runs_stay_in_python() -> None:
    def build(graph: fx.Graph, xs: list[fx.Node]) -> object:
        a = _chain(graph, xs[0], 9)
        b = _chain(graph, graph.call_function(_python_fn, (a,)), 9)
        return (b, _chain(graph, graph.call_function(_python_fn, (b,)), 3))

    x = torch.randn(4, 4)
    expected, got, _, moved, gm = _python_and_cpp(_graph(build, 1), 0, lambda: [x], min_calls=8)
    assert (moved, _runners(gm)) == (18, 2)  # the 3-op tail is too short
    assert any(n.target is _python_fn for n in gm.graph.nodes)
    for e, r in zip(expected, got, strict=True):
        torch.testing.assert_close(r, e, rtol=0, atol=0)


def _list_read_by_python(graph: fx.Graph, xs: list[fx.Node]) -> object:
    parts = graph.call_function(aten.split.Tensor, (_chain(graph, xs[0], 4), 2))
    joined = graph.call_function(torch.cat, (parts,))  # a Python function reads the list
    return _chain(graph, joined, 4)


def _result_taken_twice(graph: fx.Graph, xs: list[fx.Node]) -> object:
    best = graph.call_function(aten.max.dim, (_chain(graph, xs[0], 4), 1))
    first, again = (graph.call_function(operator.getitem, (best, 0)) for _ in range(2))
    return (_chain(graph, graph.call_function(aten.mul.Tensor, (first, again)), 4),)


@pytest.mark.parametrize(
    ("build", "kept", "moved"),
    [(_list_read_by_python, aten.split.Tensor, 8), (_result_taken_twice, aten.max.dim, 9)],
    ids=["a-list-needed-outside", "a-result-taken-twice"],
)
def test_an_op_the_runner_cannot_take_stays_in_python(
    build: Callable[[fx.Graph, list[fx.Node]], object], kept: object, moved: int
) -> None:
    x = torch.randn(6, 3)
    expected, got, _, count, gm = _python_and_cpp(_graph(build, 1), 0, lambda: [x], min_calls=4)
    assert count == moved and any(n.target is kept for n in gm.graph.nodes)  # the runs around it move
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_empty_lists_take_the_schemas_type() -> None:
    def build(graph: fx.Graph, xs: list[fx.Node]) -> object:
        total = graph.call_function(aten.sum.dim_IntList, (xs[0], []))  # every dimension
        shaped = graph.call_function(aten.view.default, (total, []))
        return (graph.call_function(aten.mul.Tensor, (shaped, 0.5)),)

    x = torch.randn(3, 5)
    expected, got, *_ = _python_and_cpp(_graph(build, 1), 0, lambda: [x])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


_OPS: list[tuple[str, Callable[[fx.Graph, fx.Node, fx.Node], fx.Node]]] = [
    ("add", lambda g, a, b: g.call_function(aten.add.Tensor, (a, b))),
    ("sub-alpha", lambda g, a, b: g.call_function(aten.sub.Tensor, (a, b), {"alpha": 3})),
    ("mul-number", lambda g, a, b: g.call_function(aten.mul.Tensor, (a, 0.75))),
    ("neg", lambda g, a, b: g.call_function(aten.neg.default, (a,))),
    ("t-t", lambda g, a, b: g.call_function(aten.t.default, (g.call_function(aten.t.default, (a,)),))),
    (
        "max",
        lambda g, a, b: g.call_function(
            aten.add.Tensor, (b, g.call_function(operator.getitem, (g.call_function(aten.max.dim, (a, 1, True)), 0)))
        ),
    ),
    (
        "chunk-cat",
        lambda g, a, b: g.call_function(
            aten.cat.default,
            (
                [
                    g.call_function(operator.getitem, (g.call_function(aten.chunk.default, (a, 2, 1)), i))
                    for i in (1, 0)
                ],
                1,
            ),
        ),
    ),
    (
        "bf16-round",
        lambda g, a, b: g.call_function(
            aten.to.dtype, (g.call_function(aten.to.dtype, (a, torch.bfloat16)), torch.float32)
        ),
    ),
]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(_OPS) - 1), st.integers(0, 63), st.integers(0, 63)), min_size=1, max_size=24)
)
def test_random_chains_give_the_python_bits(program: list[tuple[int, int, int]]) -> None:
    def build(graph: fx.Graph, xs: list[fx.Node]) -> object:
        values = list(xs)
        for op, i, j in program:
            values.append(_OPS[op][1](graph, values[i % len(values)], values[j % len(values)]))
        return tuple(values[2:])

    g = torch.Generator().manual_seed(len(program))
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    expected, got, *_ = _python_and_cpp(_graph(build, 2), 1, lambda: [x, y])
    for e, r in zip(expected, got, strict=True):
        torch.testing.assert_close(r, e, rtol=0, atol=0)


def test_a_constant_of_the_wrong_type_is_refused_naming_the_op() -> None:
    code = [0, 0, 3, 0, 0, 1, 0, 1, 1, 1, 1]  # add.Tensor(slot 0, "x", 1) -> slot 1
    with pytest.raises(RuntimeError, match=r"aten::add\.Tensor argument other: a constant of type str"):
        torch.classes.nxdi_kernels.GraphRunner(["aten::add"], ["Tensor"], code, ["x", 1], [], 1, 2, [1])


def test_a_call_with_the_wrong_input_count_is_refused() -> None:
    code = [0, 0, 3, 0, 0, 1, 0, 1, 1, 1, 1]  # add.Tensor(slot 0, 2, 1) -> slot 1
    runner = torch.classes.nxdi_kernels.GraphRunner(["aten::add"], ["Tensor"], code, [2, 1], [], 1, 2, [1])
    torch.testing.assert_close(runner.run([torch.ones(2)]), [torch.full((2,), 3.0)])
    with pytest.raises(RuntimeError, match="2 inputs where the program takes 1"):
        runner.run([torch.ones(2), torch.ones(2)])
