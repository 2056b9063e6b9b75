"""Token-tree speculation in tensors: tree attention, candidate tokens, greedy acceptance and KV
compaction. Pure.

Theory of operation (the tree's structure is `nxdi.core.planning.token_tree.TokenTree`):
1. A tree step scores N nodes per row in one decoder step. Node i is written to cache slot
   L + i (L: the row's position of the root, its last emitted token), so the step's tokens hold
   contiguous slots as every step's do, but its rotary position is L + depth(i): siblings share
   a position. `TreeInputs` carries those positions and the tree mask to the decoder.
2. Attention (`visible`): a node sees the row's cached prefix (slots < L) and, among the step's
   slots, itself and its ancestors only, so its logits are those a plain decode of its path
   would give.
3. Candidates (`candidate_tokens`): the root is the target's own next token; the node at depth d
   with choice c is the c-th best token of proposer d-1 (Medusa: head d-1's top-k).
4. Acceptance (`greedy_accept`): a node is right when its token equals the target's argmax at its
   parent. The accepted chain is the longest root-to-leaf prefix of right nodes (siblings carry
   distinct tokens, so at most one child of a node is right and the chain is unique). A row emits
   its n accepted tokens and then the target's argmax at the chain's last node: n + 1 tokens.
5. Compaction (`compact`): the accepted nodes' keys and values move to slots L..L+n (depth d to
   L + d; the root is already at L) by one gather and one scatter per cache tensor, reads before
   writes, so the cache holds the emitted sequence as if it had been decoded token by token. The
   slots after L + n keep what the step wrote; the next step (at L + n + 1) overwrites them
   before anything reads them. Static shapes throughout, per row, no host reads.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from nxdi.core.planning.token_tree import TokenTree
from nxdi.core.programs import kv_cache
from nxdi.core.programs.kv_cache import KVCache

PAD = -1
"""Filler past a row's emitted tokens (not a vocabulary id)."""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class TreeInputs:
    """What a tree step adds to `StepInputs` (whose `position_ids` are then the contiguous slots)."""

    positions: Tensor
    """[B, S] int64 rotary position of each token: the row's first slot plus the node's depth."""
    mask: Tensor
    """[B, S, M] bool: token s attends to the tree's node j, at slot `origin + j` (itself and its
    ancestors). M = S when the step scores the whole tree."""
    origin: Tensor | None = None
    """[B] the slot of the mask's node 0, when the step runs part of a tree (one level of an EAGLE
    draft's expansion); default the step's first slot. Slots before it are the cached prefix."""
    key_positions: Tensor | None = None
    """[B, M] rotary positions of the tree's nodes (sliding windows compare them); default `positions`."""


def depths(tree: TokenTree, device: torch.device | None = None) -> Tensor:
    """[N] int64 node depths (padding 0)."""
    return torch.tensor(tree.depths, dtype=torch.int64, device=device)


def tree_mask(tree: TokenTree, device: torch.device | None = None) -> Tensor:
    """[N, N] bool: node i attends to node j (j is i or an ancestor of i; padding sees itself)."""
    return torch.tensor(tree.mask, dtype=torch.bool, device=device)


def tree_inputs(slots: Tensor, tree: TokenTree) -> TreeInputs:
    """The tree inputs of a step whose N tokens sit at `slots` [B, N] (L + 0 .. L + N - 1)."""
    b, n = slots.shape
    positions = slots[:, :1] + depths(tree, slots.device)[None, :]  # [B, N]
    return TreeInputs(positions=positions, mask=tree_mask(tree, slots.device)[None].expand(b, n, n))


def visible(slots: Tensor, tree: TreeInputs, length: int, *, window: int | None = None) -> Tensor:
    """Which cache slots each token of a tree step may attend to: bool [B, 1, S, T].

    The tree's M nodes hold the contiguous slots `origin + 0..M-1` (`tree.origin`, default
    `slots[:, 0]`: the step is the whole tree). Slot t < origin holds the cached prefix (position
    t), visible to every token; a slot of the tree is visible as `tree.mask` says; slots after the
    tree are not. With a sliding window, query position p sees a key at position q only when
    p - q < window (positions, not slots: siblings share a position). Each token sees itself.
    """
    b, s = slots.shape
    m = tree.mask.shape[2]
    origin = slots[:, 0] if tree.origin is None else tree.origin  # [B]
    t = torch.arange(length, device=slots.device)[None, :]  # [1, T]
    rel = t - origin[:, None]  # [B, T]: node index within the tree (negative: the prefix)
    inside = (rel >= 0) & (rel < m)
    index = rel.clamp(0, m - 1)[:, None, :].expand(b, s, length)  # [B, S, T]
    seen = (rel < 0)[:, None, :] | (inside[:, None, :] & tree.mask.gather(2, index))
    if window is not None:
        nodes = tree.positions if tree.key_positions is None else tree.key_positions  # [B, M]
        keys = torch.where(inside, nodes.gather(1, rel.clamp(0, m - 1)), t)  # [B, T] key positions
        seen = seen & (tree.positions[:, :, None] - keys[:, None, :] < window)
    return seen[:, None]


def candidate_tokens(root: Tensor, proposals: Tensor, tree: TokenTree) -> Tensor:
    """The tree's tokens [B, N]: node 0 is `root` [B]; a node at depth d with choice c is
    `proposals[:, d - 1, c]` (proposals [B, D', K]: each depth's candidates, best first, D' >= the
    tree's depth, K >= its top_k); padding nodes repeat the root."""
    b = root.shape[0]
    flat = torch.cat((root[:, None], proposals.reshape(b, -1)), dim=1)  # [B, 1 + D'*K]
    k = proposals.shape[2]
    index = [0 if d == 0 else 1 + (d - 1) * k + c for d, c in zip(tree.depths, tree.choices, strict=True)]
    return flat[:, torch.tensor(index, dtype=torch.int64, device=root.device)]


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class Acceptance:
    """What a row of a tree step accepted (D: the tree's depth)."""

    tokens: Tensor
    """[B, D+1] int64: the accepted tokens, then the target's own next token, then PAD."""
    counts: Tensor
    """[B] int64: tokens emitted, n + 1 in 1..D+1 (n accepted nodes)."""
    nodes: Tensor
    """[B, D+1] int64: the accepted chain's node per depth (root first); valid where depth < counts."""
    last: Tensor
    """[B] int64: the chain's last node, whose next token the target emitted."""


def greedy_accept(logits: Tensor, tokens: Tensor, tree: TokenTree, *, pad: int = PAD) -> Acceptance:
    """Greedy verification of a tree step (see the module docstring, 4).

    Args:
        logits: [B, N, V] the target's logits at every node.
        tokens: [B, N] int64 the nodes' tokens (node 0 the root).
        tree: the tree the tokens were laid out by.

    Returns:
        The acceptance per row; ties between equally long chains go to the first leaf path.
    """
    best = logits.argmax(-1)  # [B, N]: the target's next token after each node
    b = tokens.shape[0]
    parents = torch.tensor(tree.parents, dtype=torch.int64, device=tokens.device).clamp(min=0)  # root: itself
    is_root = torch.arange(tokens.shape[1], device=tokens.device)[None, :] == 0  # the root was emitted already
    right = (tokens == best.gather(1, parents[None, :].expand(b, -1))) | is_root  # [B, N]
    paths = torch.tensor(tree.leaf_paths, dtype=torch.int64, device=tokens.device)  # [P, D+1], -1 padded
    ok = right[:, paths.clamp(min=0)] & (paths >= 0)  # [B, P, D+1]
    depth = torch.arange(ok.shape[2], device=tokens.device)
    # The first wrong depth (min rather than a cumprod of `ok`: torch-xla cannot lower cumprod).
    first_wrong = torch.where(ok, ok.shape[2], depth).amin(dim=2)  # [B, P]; the root is always right
    accepted = first_wrong - 1  # [B, P] accepted nodes below the root
    chosen = accepted.argmax(dim=1)  # [B]: the first longest chain
    n = accepted.gather(1, chosen[:, None])[:, 0]  # [B]
    nodes = paths.clamp(min=0)[chosen]  # [B, D+1]
    last = nodes.gather(1, n[:, None])[:, 0]  # [B]
    chain = tokens.gather(1, nodes)  # [B, D+1]: chain[:, d] the token at depth d
    slot = torch.arange(nodes.shape[1], device=tokens.device)[None, :]
    shifted = torch.cat((chain[:, 1:], chain[:, :1]), dim=1)  # emitted slot j holds depth j + 1
    bonus = best.gather(1, last[:, None])  # [B, 1]
    emitted = torch.where(slot < n[:, None], shifted, torch.where(slot == n[:, None], bonus, pad))
    return Acceptance(tokens=emitted, counts=n + 1, nodes=nodes, last=last)


def compact_tensor(cache: Tensor, nodes: Tensor, counts: Tensor, start: Tensor) -> Tensor:
    """A copy of one cache tensor [B, K, T, D] with each row's accepted nodes moved from slot
    `start + nodes[:, d]` to `start + d` for d < counts (see the module docstring, 5)."""
    b, k, _, d = cache.shape
    depth = torch.arange(nodes.shape[1], device=nodes.device)[None, :]  # [1, D+1]
    dst = start[:, None] + depth  # [B, D+1]
    src = torch.where(depth < counts[:, None], start[:, None] + nodes, dst)
    span = (b, k, nodes.shape[1], d)
    moved = kv_cache.gather(cache, 2, src[:, None, :, None].expand(span))
    return kv_cache.scatter(cache, 2, dst[:, None, :, None].expand(span), moved)


def compact(cache: KVCache, accepted: Acceptance, start: Tensor) -> KVCache:
    """`compact_tensor` on every layer's keys and values; `start` [B]: each row's root slot L."""

    def move(t: Tensor) -> Tensor:
        return compact_tensor(t, accepted.nodes, accepted.counts, start)

    return KVCache(k=tuple(move(t) for t in cache.k), v=tuple(move(t) for t in cache.v))
