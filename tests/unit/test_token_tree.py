"""Token trees (`nxdi.core.planning.token_tree`, `nxdi.core.programs.token_tree`): the buffers of
known trees, every malformed tree refused with its problems, and the tensor functions (tree
attention, candidate tokens, greedy acceptance, KV compaction) against slow loop references on
random trees and inputs (hypothesis)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core.planning import medusa as medusa_plan
from nxdi.core.planning.token_tree import TokenTree, parse_token_tree
from nxdi.core.programs import token_tree
from nxdi.core.programs.kv_cache import KVCache

# --- known trees --------------------------------------------------------------------------------

FIVE = [[0], [0, 0], [1], [0, 1], [0, 0, 0]]
"""Nodes in order: root, [0], [1], [0,0], [0,1], [0,0,0]."""


def test_the_buffers_of_a_known_tree() -> None:
    tree = parse_token_tree(FIVE, nodes=8, max_depth=3).unwrap()
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert tree.parents == (-1, 0, 0, 1, 1, 3, -1, -1)  # two padding nodes
    assert tree.depths == (0, 1, 1, 2, 2, 3, 0, 0)
    assert tree.choices == (0, 0, 1, 0, 1, 0, 0, 0)
    assert (tree.size, tree.depth, tree.top_k) == (6, 3, 2)
    assert tree.leaf_paths == ((0, 2, -1, -1), (0, 1, 4, -1), (0, 1, 3, 5))
    mask = torch.tensor(tree.mask, dtype=torch.int64)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 1, 0],  # padding sees itself only
            [0, 0, 0, 0, 0, 0, 0, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_candidate_tokens_lay_out_each_depths_choices() -> None:
    tree = parse_token_tree(FIVE, nodes=7, max_depth=3).unwrap()
    root = torch.tensor([7, 8])
    proposals = torch.arange(2 * 3 * 2).reshape(2, 3, 2) + 100  # [B, depth, K]: row 0 100..105, row 1 106..111
    tokens = token_tree.candidate_tokens(root, proposals, tree)
    # root, depth-1 choice 0 and 1, depth-2 choices 0 and 1, depth-3 choice 0, then padding (the root)
    assert tokens.tolist() == [[7, 100, 101, 102, 103, 104, 7], [8, 106, 107, 108, 109, 110, 8]]


def test_a_small_tree_of_the_reference_kind_fits_a_medusa_plan() -> None:
    """A Medusa configuration's plan: N nodes padded, K from the largest choice, one head per depth."""
    from nxdi.core.config.neuron_spec import NeuronSpec

    spec = NeuronSpec(is_medusa=True, medusa_speculation_length=8, num_medusa_heads=3, medusa_tree=FIVE)
    plan = medusa_plan.plan_for(spec).unwrap()
    assert (plan.nodes, plan.top_k, plan.num_heads, plan.emitted) == (8, 2, 3, 4)
    assert list(medusa_plan.head_shapes(1, hidden=4, vocab=9).items()) == [
        ("medusa_head_0.0.linear.weight", (4, 4)),
        ("medusa_head_0.0.linear.bias", (4,)),
        ("medusa_head_0.1.weight", (9, 4)),
    ]


@pytest.mark.parametrize(
    ("paths", "nodes", "depth", "fragments"),
    [
        ([[0], [0, 0, 1]], 8, 4, ["[0, 0]: is the prefix of a path but not a path itself"]),
        ([[0], [0, 0], [0, 0, 0]], 8, 2, ["tree=[0, 0, 0]: is 3 deep, deeper than max_depth=2"]),
        ([[0], [1], [2]], 3, 4, ["tree=3: paths make 4 nodes with the root, more than nodes=3"]),
        ([[0], [0]], 8, 4, ["[0]: is listed twice"]),
        ([[0], []], 8, 4, ["[]: holds an empty path"]),
        ([], 8, 4, ["holds no path"]),
        (None, 8, 4, ["holds no path"]),
        (
            [[1, 2, 3], [1, 2, 3]],
            1,
            2,
            ["[1]: is the prefix", "[1, 2]: is the prefix", "listed twice", "deeper than", "more than nodes=1"],
        ),
    ],
)
def test_malformed_trees_are_refused_with_every_problem(
    paths: list[list[int]] | None, nodes: int, depth: int, fragments: list[str]
) -> None:
    result = parse_token_tree(paths, nodes=nodes, max_depth=depth)
    assert isinstance(result, Failure)
    text = result.failure().render()
    for fragment in fragments:
        assert fragment in text, text


# --- hypothesis: random trees ------------------------------------------------------------------


@st.composite
def trees(draw: st.DrawFn, *, max_depth: int = 4, max_choice: int = 3) -> TokenTree:
    """A prefix-closed tree (the prefix closure of random paths), padded by 0..3 nodes."""
    raw = draw(
        st.lists(
            st.lists(st.integers(0, max_choice - 1), min_size=1, max_size=max_depth).map(tuple),
            min_size=1,
            max_size=8,
        )
    )
    closed = sorted({p[:i] for p in raw for i in range(1, len(p) + 1)})
    nodes = len(closed) + 1 + draw(st.integers(0, 3))
    parsed = parse_token_tree(closed, nodes=nodes, max_depth=max_depth)
    assert isinstance(parsed, Success), parsed
    return parsed.unwrap()


def _slow_accept(logits: torch.Tensor, tokens: torch.Tensor, tree: TokenTree) -> tuple[list[list[int]], list[int]]:
    """The definition, row by row: the longest chain (first leaf path wins a tie) whose every token
    is the target's argmax at its parent; emit it and the argmax at its last node."""
    best = logits.argmax(-1)
    out, chains = [], []
    for b in range(tokens.shape[0]):
        chain = [0]
        for leaf in tree.leaf_paths:
            walk = [0]
            for node in leaf[1:]:
                if node < 0 or int(tokens[b, node]) != int(best[b, tree.parents[node]]):
                    break
                walk.append(node)
            if len(walk) > len(chain):
                chain = walk
        emitted = [int(tokens[b, n]) for n in chain[1:]] + [int(best[b, chain[-1]])]
        out.append(emitted + [-1] * (tree.depth + 1 - len(emitted)))
        chains.append(chain)
    return out, [len(c) for c in chains]


def _planted(tree: TokenTree, data: st.DataObject, batch: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits, and node tokens of which about half equal the argmax at their parent (so
    chains of every length occur)."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, tree.nodes, vocab, generator=g)
    best = logits.argmax(-1)
    tokens = torch.randint(0, vocab, (batch, tree.nodes), generator=g)
    parents = torch.tensor(tree.parents).clamp(min=0)
    plant = torch.rand(batch, tree.nodes, generator=g) < 0.6
    return logits, torch.where(plant, best[:, parents], tokens)


@settings(deadline=None)
@given(tree=trees(), data=st.data())
def test_greedy_acceptance_equals_the_slow_reference(tree: TokenTree, data: st.DataObject) -> None:
    logits, tokens = _planted(tree, data, batch=3, vocab=5)
    got = token_tree.greedy_accept(logits, tokens, tree)
    emitted, lengths = _slow_accept(logits, tokens, tree)
    assert got.tokens.tolist() == emitted
    assert got.counts.tolist() == lengths
    for b, n in enumerate(lengths):  # the chain's nodes are a root-to-node path of the tree
        nodes = got.nodes[b, :n].tolist()
        assert nodes == list(tree.ancestors(nodes[-1]))
        assert int(got.last[b]) == nodes[-1]


@settings(deadline=None)
@given(tree=trees(), data=st.data())
def test_compaction_moves_exactly_the_accepted_nodes(tree: TokenTree, data: st.DataObject) -> None:
    logits, tokens = _planted(tree, data, batch=3, vocab=5)
    accepted = token_tree.greedy_accept(logits, tokens, tree)
    b, k, d, length = 3, 2, 4, tree.nodes + 6
    start = torch.tensor([data.draw(st.integers(0, length - tree.nodes)) for _ in range(b)])
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    cache = KVCache(k=(torch.randn(b, k, length, d, generator=g),), v=(torch.randn(b, k, length, d, generator=g),))
    before = [t.clone() for t in (*cache.k, *cache.v)]
    moved = token_tree.compact(cache, accepted, start)
    for original, new in zip((*cache.k, *cache.v), (*moved.k, *moved.v), strict=True):
        expected = original.clone()
        for row in range(b):
            for depth in range(int(accepted.counts[row])):
                node = int(accepted.nodes[row, depth])
                expected[row, :, int(start[row]) + depth] = original[row, :, int(start[row]) + node]
        assert torch.equal(new, expected)
    assert all(torch.equal(a, c) for a, c in zip(before, (*cache.k, *cache.v), strict=True)), "input mutated"


def _slow_visible(slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, length: int, window: int | None):
    b, s = slots.shape
    out = torch.zeros(b, 1, s, length, dtype=torch.bool)
    for row in range(b):
        start = int(slots[row, 0])
        for q in range(s):
            p = int(positions[row, q])
            for t in range(length):
                if t < start:
                    seen, key = True, t
                elif t < start + s:
                    seen, key = bool(mask[row, q, t - start]), int(positions[row, t - start])
                else:
                    seen, key = False, t
                out[row, 0, q, t] = seen and (window is None or p - key < window)
    return out


@settings(deadline=None)
@given(tree=trees(), data=st.data(), window=st.one_of(st.none(), st.integers(1, 6)))
def test_tree_attention_sees_the_prefix_and_the_ancestors(tree: TokenTree, data: st.DataObject, window: int | None):
    length = tree.nodes + 8
    starts = [data.draw(st.integers(0, length - tree.nodes)) for _ in range(2)]
    slots = torch.tensor(starts)[:, None] + torch.arange(tree.nodes)[None, :]
    inputs = token_tree.tree_inputs(slots, tree)
    assert torch.equal(inputs.positions, torch.tensor(starts)[:, None] + torch.tensor(tree.depths)[None, :])
    got = token_tree.visible(slots, inputs, length, window=window)
    assert torch.equal(got, _slow_visible(slots, inputs.positions, inputs.mask, length, window))
    assert bool(got.any(-1).all()), "every token sees at least itself"


def _ids(paths: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    return [tuple(p) for p in paths]


def test_the_medusa_rules_name_every_problem_of_a_configuration() -> None:
    from nxdi.core.config.neuron_spec import NeuronSpec

    spec = NeuronSpec(
        is_medusa=True,
        medusa_speculation_length=3,
        num_medusa_heads=1,
        medusa_tree=_ids([[0], [0, 0], [1, 1]]),
        speculation_length=4,
        seq_len=128,
        max_length=128,
    )
    text = "\n".join(p.render() for p in medusa_plan.rule_problems(spec))
    for fragment in (
        "speculation_length=4: is another speculation method",
        "medusa_tree=[1]: is the prefix of a path but not a path itself",
        "medusa_tree=[1, 1]: is 2 deep, deeper than num_medusa_heads=1",
        "paths make 4 nodes with the root, more than medusa_speculation_length=3",
    ):
        assert fragment in text, text
