"""EAGLE token trees (`token_tree_config`): the adjacency dict a user writes, as a `TokenTree`. Pure.

`token_tree_config` (NxDI's EAGLE token tree) is an adjacency dict `{node id: [child ids]}`, its
keys and ids ints or JSON strings: node 0 is the root (the row's last accepted token), a node
missing as a key is a leaf, and a node with c children takes the draft's top-c tokens at it as
those children, in the listed order. So child j of a node is that node's top-k choice j, and the
tree is the `nxdi.core.planning.token_tree.TokenTree` of the paths of those choices: the same
structure Medusa's programs (tree mask, per-node positions, greedy acceptance, KV compaction)
run. Node ids only name the structure: `TokenTree` numbers the nodes breadth-first, children in
their listed order, so each depth's nodes are contiguous (what the level-by-level drafting needs).

Rules (`tree_problems` lists every broken one at once, under the field `token_tree_config`):
- a non-empty dict whose ids are integers 0..n-1, with the root 0 holding at least one child;
- each node has one parent (no node listed twice as a child, none as the root's or its own
  child: that is a cycle), and every node is reachable from the root;
- `speculation_length` equals the node count n (the target scores every node in one pass, as
  NxDI's tree step scores `speculation_length` tokens).

A tree step emits `depth + 1` tokens at most: the accepted path below the root, then the target's
next token (`emitted_width`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from returns.result import Failure, Result, Success

from nxdi.core.config.fields import JsonMap
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import ConfigError, Problem
from nxdi.core.planning import token_tree
from nxdi.core.planning.token_tree import TokenTree

FIELD = "token_tree_config"


def _as_id(raw: Any) -> int | None:
    """An integer node id from an int or a decimal string (JSON keys), else None."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
        return int(raw.strip())
    return None


def _plain(config: Any) -> Any:
    """A dict from the spec's frozen JSON object (`JsonMap`); anything else as it is."""
    return config.to_dict() if isinstance(config, JsonMap) else config


def _adjacency(config: Mapping[Any, Any]) -> tuple[dict[int, list[int]], list[Problem]]:
    """The dict with integer ids, and the problems of ids and lists that are not integers."""
    out: dict[int, list[int]] = {}
    problems: list[Problem] = []
    for key, children in config.items():
        node = _as_id(key)
        if node is None:
            problems.append(Problem.of(FIELD, key, "has a key that is not an integer node id", "use ids 0..n-1"))
            continue
        if children is None:
            children = []
        if not isinstance(children, list | tuple):
            why = f"maps node {node} to {children!r}, not a list of child ids"
            problems.append(Problem.of(FIELD, {key: children}, why, "give each node a list of child ids"))
            continue
        ids = [_as_id(c) for c in children]
        if any(i is None for i in ids):  # reported; the valid ids still take part in the other checks
            why = f"lists a child of node {node} that is not an integer node id"
            problems.append(Problem.of(FIELD, {key: list(children)}, why, "use ids 0..n-1"))
        out.setdefault(node, []).extend(i for i in ids if i is not None)
    return out, problems


def tree_problems(
    config: Mapping[Any, Any] | JsonMap | None, *, speculation_length: int | None = None
) -> Iterator[Problem]:
    """Every reason `config` is not an EAGLE token tree (see the module docstring).

    Args:
        config: the `token_tree_config` value.
        speculation_length: the target's setting, checked against the node count (None: unchecked).
    """
    config = _plain(config)
    if not isinstance(config, Mapping) or not config:
        why = "is empty or not a dict: a token tree maps each node id to its children, root 0 first"
        yield Problem.of(FIELD, config, why, 'give e.g. {"0": [1, 2], "1": [3]}')
        return
    adjacency, problems = _adjacency(config)
    yield from problems
    nodes = set(adjacency) | {c for kids in adjacency.values() for c in kids}
    if not adjacency.get(0):
        why = "has no root: node 0 must be a key with at least one child (node 0 is the row's last token)"
        yield Problem.of(FIELD, sorted(adjacency), why, 'add "0": [its children]')
    gaps = sorted(set(range(len(nodes))) - nodes)
    strays = sorted(n for n in nodes if not 0 <= n < len(nodes))
    if gaps or strays:
        why = f"node ids must be 0..{len(nodes) - 1} with none missing (missing: {gaps}; out of range: {strays})"
        yield Problem.of(FIELD, sorted(nodes), why, "number the nodes 0..n-1")
    parents: dict[int, list[int]] = {}
    for node, kids in adjacency.items():
        for c in kids:
            parents.setdefault(c, []).append(node)
    for child, ps in sorted(parents.items()):
        if child == 0 or len(ps) > 1:
            why = f"gives node {child} the parent(s) {ps}" + (": the root has none" if child == 0 else ": one allowed")
            yield Problem.of(FIELD, {p: adjacency[p] for p in ps}, why, f"list node {child} under one parent only")
    unreachable = sorted(nodes - _reachable(adjacency))
    if unreachable and adjacency.get(0):
        why = f"has nodes no path from the root 0 reaches: {unreachable}"
        yield Problem.of(FIELD, unreachable, why, "list each of them as a child of a node under the root, or drop them")
    if speculation_length is not None and not problems and speculation_length != len(nodes):
        why = f"has {len(nodes)} nodes but speculation_length={speculation_length}: the target scores every node"
        yield Problem.of("speculation_length", speculation_length, why, f"set speculation_length={len(nodes)}")


def _reachable(adjacency: Mapping[int, list[int]]) -> set[int]:
    """Nodes reached from the root (each once: a cycle stops at a node already seen)."""
    seen, frontier = {0}, [0]
    while frontier:
        node = frontier.pop()
        for c in adjacency.get(node, ()):
            if c not in seen:
                seen.add(c)
                frontier.append(c)
    return seen


def _choice_paths(adjacency: Mapping[int, list[int]]) -> list[tuple[int, ...]]:
    """Each non-root node's path of child indices from the root (a valid tree)."""
    paths: list[tuple[int, ...]] = []
    frontier: list[tuple[int, tuple[int, ...]]] = [(0, ())]
    while frontier:
        node, path = frontier.pop()
        for j, c in enumerate(adjacency.get(node, ())):
            paths.append((*path, j))
            frontier.append((c, (*path, j)))
    return paths


def parse_eagle_tree(
    config: Mapping[Any, Any] | JsonMap | None, *, speculation_length: int | None = None
) -> Result[TokenTree, ConfigError]:
    """The `TokenTree` of an adjacency dict, nodes numbered breadth-first (see the module docstring).

    Returns:
        The tree (no padding: `nodes` is the node count), or a ConfigError listing every problem.
    """
    problems = tuple(tree_problems(config, speculation_length=speculation_length))
    if problems:
        return Failure(ConfigError(problems=problems))
    plain = _plain(config)
    assert plain is not None
    adjacency, _ = _adjacency(plain)
    paths = _choice_paths(adjacency)
    return token_tree.parse_token_tree(paths, nodes=len(paths) + 1, max_depth=len(paths), field=FIELD)


def emitted_width(tree: TokenTree) -> int:
    """Tokens a tree step emits at most: the deepest path's nodes below the root, plus the target's next."""
    return tree.depth + 1


def tree_of(s: NeuronSpec) -> TokenTree | None:
    """The token tree of a validated spec (`token_tree_config`), else None."""
    if s.token_tree_config is None:
        return None
    parsed = parse_eagle_tree(s.token_tree_config)
    assert isinstance(parsed, Success), f"a validated spec has a valid token tree: {parsed}"
    return parsed.unwrap()


def fused_width(s: NeuronSpec) -> int:
    """Tokens a fused step emits at most per row (fused_outputs[0] is [B, width]): speculation_length,
    or with a token tree its `emitted_width`."""
    tree = tree_of(s)
    return s.speculation_length if tree is None else emitted_width(tree)


def levels(tree: TokenTree) -> tuple[tuple[int, int], ...]:
    """[(first node, end)] of each depth 0..depth: breadth-first numbering keeps a depth contiguous."""
    out = []
    for d in range(tree.depth + 1):
        at = [i for i, depth in enumerate(tree.depths[: tree.size]) if depth == d]
        out.append((at[0], at[-1] + 1))
    return tuple(out)


def rule_problems(s: NeuronSpec) -> Iterator[Problem]:
    """The rules of `token_tree_config` (nothing when it is None): the tree itself and its node
    count against speculation_length, EAGLE speculation, greedy on-device sampling (the tree step
    accepts greedily, as NxDI's), and no output_logits (a tree step returns tokens only).
    (enable_eagle_speculation turns on fused speculation, except on an EAGLE draft's config,
    which carries the target's settings, so EAGLE is the one setting to ask for.)"""
    if s.token_tree_config is None:
        return
    yield from tree_problems(s.token_tree_config, speculation_length=s.speculation_length)
    if not s.enable_eagle_speculation:
        why = "runs only in EAGLE speculation: it shapes the EAGLE draft's proposals"
        yield Problem.of(FIELD, "set", why, "set enable_eagle_speculation=True (with an EAGLE draft), or drop it")
    ods = s.on_device_sampling_config
    for name in ("do_sample", "dynamic"):
        if ods is not None and getattr(ods, name):
            why = "samples, but a token-tree step accepts greedily (exact tree sampling is not implemented)"
            fix = f"set {name}=False (greedy), or drop token_tree_config to sample with a flat draft"
            yield Problem.of(f"on_device_sampling_config.{name}", True, why, fix)
    if s.output_logits:
        why = "is not returned by a token-tree step (it returns the accepted tokens)"
        yield Problem.of("output_logits", True, why, "set output_logits=False, or drop token_tree_config")
