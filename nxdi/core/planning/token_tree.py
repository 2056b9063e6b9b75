"""Token trees: the candidate tokens one speculation step scores, as a static structure. Pure.

A tree is given as paths (NxDI's `medusa_tree`, e.g. `medusa_mc_sim_7b_63.json`): each path is a
tuple of top-k choice indices, one per depth, so `(0, 1)` is "the best candidate at depth 1, then
the second best at depth 2 after it". The root, node 0, is not a path: it is the row's last
accepted token (the target's own next token), whose successors the tree proposes.

Rules:
- Nodes are numbered in the reference's order: the root, then the paths sorted by (depth, choices),
  so every node comes after its parent and the nodes of one depth are contiguous.
- A tree is prefix-closed: every proper prefix of a path is itself a path (a node's parent exists).
- One step scores `nodes` N tokens: the tree's own nodes, then padding nodes (depth 0, parent none)
  up to N, so one compiled program serves any tree of at most N nodes.
- A candidate path ends at a leaf (a node that is nobody's parent): the longest chain the target
  can accept in one step. `leaf_paths` lists them as node indices, root first.

This module imports no torch: configuration checks use it. The tensor side (attention masks,
candidate tokens, acceptance, KV compaction) is `nxdi.core.programs.token_tree`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem

ROOT = 0
"""The root's node index (the last accepted token)."""


def _ints(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _paths(paths: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(_ints(p) for p in paths)


@attrs.frozen(kw_only=True)
class TokenTree:
    """A validated, padded token tree (build it with `parse_token_tree`)."""

    paths: tuple[tuple[int, ...], ...] = attrs.field(converter=_paths)
    """The tree's paths in node order: node i (i >= 1) is `paths[i - 1]`."""
    nodes: int = attrs.field(validator=attrs.validators.gt(0))
    """N, the nodes a step scores: the root, the paths, then padding."""
    parents: tuple[int, ...] = attrs.field(converter=_ints)
    """[N] each node's parent; -1 for the root and padding."""

    @property
    def size(self) -> int:
        """Real nodes: the root and one per path."""
        return len(self.paths) + 1

    @property
    def depths(self) -> tuple[int, ...]:
        """[N] each node's depth (0 for the root and padding)."""
        return (0, *(len(p) for p in self.paths), *(0,) * (self.nodes - self.size))

    @property
    def choices(self) -> tuple[int, ...]:
        """[N] each node's top-k index among its depth's candidates (0 for the root and padding)."""
        return (0, *(p[-1] for p in self.paths), *(0,) * (self.nodes - self.size))

    @property
    def depth(self) -> int:
        """The deepest path's length (0 for a root alone)."""
        return max((len(p) for p in self.paths), default=0)

    @property
    def top_k(self) -> int:
        """Candidates each depth needs: one more than the largest choice index (at least 1)."""
        return max((c + 1 for p in self.paths for c in p), default=1)

    def ancestors(self, node: int) -> tuple[int, ...]:
        """Node indices from the root down to `node` (itself last); a padding node is alone."""
        chain = [node]
        while self.parents[chain[-1]] >= 0:
            chain.append(self.parents[chain[-1]])
        return tuple(reversed(chain))

    @property
    def leaf_paths(self) -> tuple[tuple[int, ...], ...]:
        """Every root-to-leaf chain of node indices, in leaf order, each `depth + 1` long padded with -1."""
        inner = set(self.parents[: self.size])
        width = self.depth + 1
        leaves = [n for n in range(self.size) if n not in inner]
        return tuple((*self.ancestors(n), *(-1,) * (width - len(self.ancestors(n)))) for n in leaves)

    @property
    def mask(self) -> tuple[tuple[bool, ...], ...]:
        """[N][N] tree attention: `mask[i][j]` when node j is node i or one of its ancestors."""
        seen = [frozenset(self.ancestors(i)) for i in range(self.nodes)]
        return tuple(tuple(j in seen[i] for j in range(self.nodes)) for i in range(self.nodes))


def tree_problems(
    paths: Sequence[Sequence[int]] | None,
    *,
    field: str,
    nodes: int,
    max_depth: int,
    nodes_field: str,
    depth_field: str,
) -> Iterator[Problem]:
    """Every reason `paths` is not a tree of at most `nodes` nodes and `max_depth` depth.

    Problems: no paths; an empty path; a negative choice; a path listed twice; a path whose prefix
    is not a path (not prefix-closed); a path deeper than `max_depth` (named `depth_field`); more
    nodes, with the root, than `nodes` (named `nodes_field`).
    """
    if not paths:
        yield Problem.of(field, paths, "holds no path: a tree needs at least one candidate", "give a list of paths")
        return
    given = [tuple(p) for p in paths]
    seen = set(given)
    for p in given:
        if not p:
            yield Problem.of(field, list(p), "holds an empty path (the root is implicit)", "drop it")
        elif any(c < 0 for c in p):
            yield Problem.of(field, list(p), "has a negative top-k choice", "use choices >= 0")
    for p in sorted({p for p in given if given.count(p) > 1}):
        yield Problem.of(field, list(p), "is listed twice", "list each path once")
    missing = sorted({p[:i] for p in seen for i in range(1, len(p)) if p[:i] not in seen}, key=lambda q: (len(q), q))
    for q in missing:
        why = "is the prefix of a path but not a path itself: a tree must be prefix-closed"
        yield Problem.of(field, list(q), why, f"add {list(q)} to {field}")
    deep = [p for p in seen if len(p) > max_depth]
    if deep:
        worst = max(deep, key=lambda q: (len(q), q))
        why = f"is {len(worst)} deep, deeper than {depth_field}={max_depth} ({len(deep)} path(s) are)"
        yield Problem.of(field, list(worst), why, f"raise {depth_field} to {len(worst)}, or drop the deeper paths")
    if len(seen) + 1 > nodes:
        why = f"paths make {len(seen) + 1} nodes with the root, more than {nodes_field}={nodes}"
        yield Problem.of(field, len(seen), why, f"raise {nodes_field} to {len(seen) + 1}, or drop paths")


def parse_token_tree(
    paths: Sequence[Sequence[int]] | None,
    *,
    nodes: int,
    max_depth: int,
    field: str = "tree",
    nodes_field: str = "nodes",
    depth_field: str = "max_depth",
) -> Result[TokenTree, ConfigError]:
    """The padded tree of `paths` (see the module docstring).

    Args:
        paths: top-k choice tuples, in any order.
        nodes: N, the nodes one step scores (the root included; the tree is padded to it).
        max_depth: the deepest path allowed (e.g. the number of Medusa heads).
        field, nodes_field, depth_field: the setting names problems are reported under.

    Returns:
        The tree, or a ConfigError listing every problem (`tree_problems`).
    """
    kinds = {"field": field, "nodes_field": nodes_field, "depth_field": depth_field}
    problems = tuple(tree_problems(paths, nodes=nodes, max_depth=max_depth, **kinds))
    if problems:
        return Failure(ConfigError(problems=problems))
    ordered = sorted({tuple(p) for p in paths or ()}, key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(ordered)}
    parents = (-1, *(index[p[:-1]] if len(p) > 1 else ROOT for p in ordered))
    return Success(TokenTree(paths=ordered, nodes=nodes, parents=(*parents, *(-1,) * (nodes - len(parents)))))
