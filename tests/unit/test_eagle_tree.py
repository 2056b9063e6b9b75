"""EAGLE token trees: the `token_tree_config` parser (`nxdi.core.planning.eagle_tree`) and the
level-by-level draft expansion (`nxdi.core.programs.eagle_tree.expand`).

- A known tree parses to the breadth-first `TokenTree` (JSON string ids as ints); any relabelling of
  a random tree, with its children in the same order, parses to the same tree; every problem of a
  broken tree is listed at once, under `token_tree_config` (or `speculation_length`).
- Expansion: each drafted node's children are the draft's top-c tokens at it, where its logits are
  those a chain decode of its path gives (pair by pair through the cache), and each node's keys and
  values at its tree slot equal the chain's at its depth (in float64, as the structural program
  properties are: `tests/support/program_checks.DTYPE`).
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core import weight_plan
from nxdi.core.eagle_layout import EagleDraft
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import eagle_tree as plan
from nxdi.core.planning.token_tree import TokenTree
from nxdi.core.programs import eagle, eagle_tree, inputs, kv_cache
from nxdi.core.programs.step import StepSpec
from nxdi.testing.strategies.decoders import LLAMA_SHAPED, cast_floats, dense_specs, program_of
from tests.support.program_checks import DTYPE, close

TREE = {"0": ["1", "2"], "1": ["3", "4"], "2": ["5"], "3": ["6"]}


def test_a_known_tree_parses_breadth_first() -> None:
    tree = plan.parse_eagle_tree(TREE, speculation_length=7).unwrap()
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert plan.levels(tree) == ((0, 1), (1, 3), (3, 6), (6, 7))
    assert plan.emitted_width(tree) == 4 and tree.top_k == 2
    assert plan.parse_eagle_tree({0: [1, 2], 1: [3, 4], 2: [5], 3: [6], 6: []}) == Success(tree)


@st.composite
def parent_lists(draw: st.DrawFn) -> list[int]:
    """parents[i] of nodes 1..n-1 (node 0 the root): each an earlier node."""
    n = draw(st.integers(2, 12))
    return [draw(st.integers(0, i - 1)) for i in range(1, n)]


def _adjacency(parents: list[int], labels: list[int]) -> dict[str, list[str]]:
    """The JSON adjacency of the tree, node i named labels[i] (labels[0] = 0), children in index order."""
    out: dict[str, list[str]] = {}
    for child, parent in enumerate(parents, start=1):
        out.setdefault(str(labels[parent]), []).append(str(labels[child]))
    return out


def _shape(tree: TokenTree) -> list[tuple[int, ...]]:
    return sorted(tree.paths)


@settings(deadline=None, max_examples=60)
@given(parents=parent_lists(), data=st.data())
def test_relabelled_trees_parse_to_the_same_tree(parents: list[int], data: st.DataObject) -> None:
    n = len(parents) + 1
    rest = data.draw(st.permutations(list(range(1, n))), label="labels")
    plain = plan.parse_eagle_tree(_adjacency(parents, list(range(n))), speculation_length=n).unwrap()
    relabelled = plan.parse_eagle_tree(_adjacency(parents, [0, *rest]), speculation_length=n).unwrap()
    assert relabelled == plain and plain.nodes == plain.size == n
    assert all(plain.parents[i] < i for i in range(1, n)), "breadth-first: parents first"
    assert [plain.depths[i] for i in range(n)] == sorted(plain.depths[:n])
    spans = plan.levels(plain)
    assert spans[0] == (0, 1) and spans[-1][1] == n and all(a[1] == b[0] for a, b in itertools.pairwise(spans))


@settings(deadline=None, max_examples=40)
@given(parents=parent_lists(), length=st.integers(1, 16))
def test_speculation_length_must_be_the_node_count(parents: list[int], length: int) -> None:
    n = len(parents) + 1
    parsed = plan.parse_eagle_tree(_adjacency(parents, list(range(n))), speculation_length=length)
    assert isinstance(parsed, Success) == (length == n)
    if length != n:
        (problem,) = parsed.failure().problems
        assert problem.field == "speculation_length" and f"set speculation_length={n}" in problem.fix


def test_a_broken_tree_lists_every_problem() -> None:
    broken = {"0": [1, 1], "1": [3, "x"], "2": [5], "7": [1]}
    fields_and_reasons = [(p.field, p.reason) for p in plan.parse_eagle_tree(broken).failure().problems]
    reasons = " | ".join(r for _, r in fields_and_reasons)
    assert {f for f, _ in fields_and_reasons} == {"token_tree_config"}
    for expected in (
        "not an integer node id",
        "missing: [4]; out of range: [7]",
        "parent(s) [0, 0, 7]",
        "no path from the root",
    ):
        assert expected in reasons, reasons
    for empty in (None, {}, [], {"1": [2]}):
        assert isinstance(plan.parse_eagle_tree(empty), Failure)
    assert "has no root" in plan.parse_eagle_tree({"1": [0]}).failure().problems[0].reason
    cyclic = plan.parse_eagle_tree({"0": [1], "1": [2], "2": [1]}).failure().problems
    assert any("parent(s) [0, 2]" in p.reason for p in cyclic)


def test_the_configuration_rules_name_each_setting() -> None:
    from nxdi.core.config.neuron_spec import NeuronSpec
    from nxdi.core.config.sub_specs import OnDeviceSamplingSpec

    base = NeuronSpec(enable_eagle_speculation=True, speculation_length=7, token_tree_config=TREE)  # type: ignore[call-arg, arg-type]
    assert list(plan.rule_problems(base)) == []
    sampled = NeuronSpec(
        enable_eagle_speculation=False,
        speculation_length=7,
        token_tree_config=TREE,  # type: ignore[arg-type]
        output_logits=True,
        on_device_sampling_config=OnDeviceSamplingSpec(do_sample=True, dynamic=True),
    )
    named = [p.field for p in plan.rule_problems(sampled)]
    assert named == [
        "token_tree_config",
        "on_device_sampling_config.do_sample",
        "on_device_sampling_config.dynamic",
        "output_logits",
    ]


# --- the draft's expansion ----------------------------------------------------------------------


def _draft(spec: ModelSpec, seed: int) -> eagle.EagleWeights:
    layout = EagleDraft(input_norm=False, fc_bias=False)
    table = program_of(spec).table
    wplan = weight_plan.weight_plan_for(table, spec, eagle_draft=layout).unwrap()
    g = torch.Generator().manual_seed(seed)
    state = {
        wplan.stored_key(name): torch.randn(shape, generator=g) * (0.5 if len(shape) == 1 else shape[-1] ** -0.5)
        for name, shape in wplan.source_shapes().items()
    }
    tensors = cast_floats(weight_ops.convert(wplan, state).unwrap(), DTYPE)
    return eagle.weights_from_slots(layout.table(table).slots(tensors, spec), spec=spec)


@settings(deadline=None, max_examples=20)
@given(spec=dense_specs(model_types=LLAMA_SHAPED), parents=parent_lists(), seed=st.integers(0, 2**31 - 1))
def test_each_level_drafts_what_a_chain_decode_of_its_paths_drafts(
    spec: ModelSpec, parents: list[int], seed: int
) -> None:
    tree = plan.parse_eagle_tree(_adjacency(parents, list(range(len(parents) + 1)))).unwrap()
    w, g = _draft(spec, seed), torch.Generator().manual_seed(seed + 1)
    prefix, n = 3, tree.nodes
    length = prefix + n
    toks = torch.randint(0, spec.vocab_size, (1, prefix), generator=g)
    cache = kv_cache.empty_cache(spec, batch=1, length=length, dtype=DTYPE)
    cache = _prefill(w, cache, toks, spec, g)
    root = torch.randint(0, spec.vocab_size, (1,), generator=g)
    state = torch.randn(1, spec.hidden_size, generator=g, dtype=DTYPE)
    origin = torch.tensor([prefix])
    tokens, drafted = eagle_tree.expand(w, cache, root, origin, state, tree=tree, spec=StepSpec(model=spec))
    assert tokens.shape == (1, n) and int(tokens[0, 0]) == int(root)
    inner = {tree.parents[i] for i in range(1, n)}
    for node in sorted(inner):
        chain = tree.ancestors(node)
        c, prev, logits = cache, state[:, None], None
        for depth, step_node in enumerate(chain):
            x = inputs.token_inputs(tokens[:, step_node], torch.tensor([prefix + depth]))
            logits, own, c = eagle.forward(w, c, x, prev, spec=spec)
            prev = own
        assert logits is not None
        for layer in range(len(c.k)):
            close(drafted.k[layer][0, :, prefix + node], c.k[layer][0, :, prefix + len(chain) - 1])
        children = [j for j in range(1, n) if tree.parents[j] == node]
        top = logits[0, 0].topk(len(children)).indices.tolist()
        assert [int(tokens[0, j]) for j in children] == top


def _prefill(
    w: eagle.EagleWeights, cache: kv_cache.KVCache, toks: torch.Tensor, spec: ModelSpec, g: torch.Generator
) -> kv_cache.KVCache:
    """The cache after `toks` [1, P] paired with random hidden states at slots 0..P-1."""
    p = toks.shape[1]
    hidden = torch.randn(1, p, spec.hidden_size, generator=g, dtype=DTYPE)
    x = inputs.prompt_inputs([toks[0].tolist()], length=p)
    _, _, part = eagle.forward(w, cache.prefix(p), x, hidden, spec=spec)
    return cache.splice(part)
