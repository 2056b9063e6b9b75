"""EAGLE token-tree speculation: one fused step drafts a token tree and verifies it. Pure.

The fused EAGLE step of `nxdi.core.programs.eagle_fused` with a token tree in place of the flat
chain of drafts (NxDI's EAGLE with `token_tree_config`; greedy only, as NxDI's). The tree
(`nxdi.core.planning.eagle_tree`) has N = speculation_length nodes numbered breadth-first, node 0
the root; the generic tree code is `nxdi.core.programs.token_tree` (Medusa's). A step at position
p with `cur` = t_p, for every row:

1. Drafting, level by level (`expand`). Node i sits at draft slot p-1+i with rotary position
   p-1+depth(i), and is the pair (token of i, hidden state before it): the root pairs (cur, h_{p-1})
   (read from the hidden-state cache), a node below it pairs its token with the draft's own hidden
   state g at its parent. Each depth's nodes run as one draft step that sees the cached prefix
   (slots < p-1) and, in the tree, itself and its ancestors (`TreeInputs` with the tree's origin),
   so node i's logits are those a chain decode of its path would give. A node with c children
   takes the draft's top-c tokens at it as those children, in order. The deepest level is not run.
2. Verification: the target scores the N nodes in one pass at slots p..p+N-1, rotary positions
   p+depth(i), with tree attention, and returns their hidden states.
3. Acceptance (`token_tree.greedy_accept`): the longest path whose tokens equal the target's
   argmax at their parents; the row emits its n accepted tokens and the target's argmax after the
   last: tokens [B, D+1] (D the tree's depth), padded with -1, counts in 1..D+1 (clamped, as the
   flat step's, so no emitted token rests on an input at max_length or later).
4. Caches. The target's: the accepted nodes' keys and values move to slots p..p+n
   (`token_tree.compact`). The hidden-state cache: the accepted nodes' target hidden states go to
   slots p..p+D (h_{p+d} at depth d). The draft's: one more draft run over the accepted path pairs
   (t_{p+1+d}, h_{p+d}) at p+d (NxDI's final draft run) rewrites the slots the tree scribbled on
   with the chain's keys and values. Slots at and after the next position p+c hold leftovers of
   the tree; the next step writes each of them before any query may read it (its tree starts at
   p+c-1 in the draft's cache and p+c in the others', and a tree node reads only its ancestors).

Static shapes throughout: the tree, its levels and every gather index are fixed when the program
is traced, the levels are a Python loop over that static structure, and nothing branches on values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from nxdi.core.planning import eagle_tree as tree_plan
from nxdi.core.planning.token_tree import TokenTree
from nxdi.core.programs import decoder, eagle, eagle_fused, fused_speculation, speculation, step, token_tree
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.core.programs.fused_speculation import FusedSpec, FusedWeights
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import StepOutputs, StepSpec
from nxdi.core.programs.token_tree import TreeInputs


def _index(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def expand(
    w: Any,
    cache: KVCache,
    root: Tensor,
    origin: Tensor,
    state: Tensor,
    *,
    tree: TokenTree,
    spec: StepSpec,
    coll: Collectives = SINGLE,
) -> tuple[Tensor, KVCache]:
    """Draft the tree's tokens level by level (rule 1 of the module docstring).

    Args:
        w: the EAGLE draft's weights.
        cache: the draft's cache view, L layers of [B, K, T, D] (T > origin + N - 1).
        root: [B] the root's token (the row's last accepted token).
        origin: [B] the root's draft slot (p - 1); node i is written at origin + i.
        state: [B, E] the hidden state before the root (the target's h_{p-1}).
        tree: the tree (N nodes, breadth-first).
        spec: the draft's step (its model and partition).

    Returns:
        tokens [B, N] int64 (node 0 the root), and the draft's cache with the pairs of every node
        above the deepest level written at their slots.
    """
    b, n, device = root.shape[0], tree.nodes, root.device
    mask = token_tree.tree_mask(tree, device)  # [N, N]
    key_positions = origin[:, None] + token_tree.depths(tree, device)[None, :]  # [B, N]
    spans = tree_plan.levels(tree)
    tokens = root[:, None].to(torch.int64)  # [B, 1]: the nodes drafted so far, breadth-first
    own = state[:, None]  # [B, 1, E]; after level 0: the draft's own hidden state of each node so far
    for d, (start, end) in enumerate(spans[:-1]):  # unrolled when traced: the tree is static
        c = end - start
        parents = [max(tree.parents[i], 0) for i in range(start, end)]
        prev = state[:, None] if d == 0 else own.index_select(1, _index(parents, device))  # [B, c, E]
        slots = origin[:, None] + torch.arange(start, end, device=device)[None, :]  # [B, c]
        x = StepInputs(
            input_ids=tokens[:, start:end],
            position_ids=slots,
            last_index=torch.full((b,), c - 1, dtype=torch.int64, device=device),
        )
        at = TreeInputs(
            positions=(origin + d)[:, None].expand(b, c),
            mask=mask[start:end][None].expand(b, c, n),
            origin=origin,
            key_positions=key_positions,
        )
        logits, g, cache = eagle.forward(
            w, cache, x, prev, spec=spec.model, part=spec.partition, coll=coll, tree=at
        )  # [B, c, V], [B, c, E]
        below = range(*spans[d + 1])
        k = 1 + max(tree.choices[j] for j in below)  # the widest node of this level
        top = logits.topk(k, dim=-1).indices.reshape(b, c * k)  # [B, c*K]: each node's best K, best first
        picked = [(tree.parents[j] - start) * k + tree.choices[j] for j in below]
        tokens = torch.cat((tokens, top.index_select(1, _index(picked, device))), dim=1)
        own = g if d == 0 else torch.cat((own, g), dim=1)  # [B, end, E]: draft hidden of nodes 0..end-1
    return tokens, cache


def fused_step(
    target_forward: step.Forward,
    weights: FusedWeights,
    cache: KVCache,
    x: StepInputs,
    params: Tensor,
    uniforms: Tensor,
    *,
    spec: FusedSpec,
    coll: Collectives = SINGLE,
) -> tuple[StepOutputs, KVCache]:
    """One EAGLE token-tree step for every row (the module docstring; greedy).

    Args:
        x: input_ids [B, 1] each row's last accepted token, position_ids [B, 1] its position p
            (1 <= p < max_length: context encoding came first); last_index is unused.
        params, uniforms: unused (the tree step is greedy); their shapes are the fused step's.

    Returns:
        tokens [B, D+1] int64 (each row's emitted tokens, then -1), `COUNTS` [B] int64 in
        1..min(D+1, max_length - p), and the joined cache (target, draft, hidden states).
    """
    tree = spec.tree
    assert tree is not None, "a tree step needs the FusedSpec's tree"
    assert not spec.target.output_logits, "output_logits is refused with token_tree_config"
    target_cache, draft_cache, hidden_cache = eagle_fused.split(cache, spec.target_layers)
    at = x.position_ids  # [B, 1]
    origin = (at[:, 0] - 1).clamp(min=0)  # [B] the root's draft slot (clamped: example inputs at 0)
    state = eagle_fused.read_hidden(hidden_cache, origin)  # [B, E] h_{p-1}
    d = spec.draft
    tokens, draft_cache = expand(
        weights.draft, draft_cache, x.input_ids[:, 0], origin, state, tree=tree, spec=d, coll=coll
    )  # [B, N]
    logits, hidden, target_cache = _verify(
        target_forward, weights.target, target_cache, tokens, at, spec=spec, coll=coll
    )
    accepted = token_tree.greedy_accept(logits, tokens, tree)
    counts = torch.minimum(accepted.counts, (spec.max_length - at[:, 0]).clamp(min=1))  # [B]
    accepted = dataclasses.replace(accepted, counts=counts)
    width = tree_plan.emitted_width(tree)
    offsets = torch.arange(width, device=at.device)[None, :]  # [1, D+1]
    emitted = torch.where(offsets < counts[:, None], accepted.tokens, speculation.PAD)  # [B, D+1]
    target_cache = token_tree.compact(target_cache, accepted, at[:, 0])
    path = hidden.gather(1, accepted.nodes[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, D+1, E] h_{p+d}
    draft_cache, hidden_cache = eagle_fused.catch_up(
        weights.draft, draft_cache, hidden_cache, emitted, path, at + offsets, counts, spec=d, coll=coll
    )
    outs = StepOutputs(logits=None, tokens=emitted, extras={fused_speculation.COUNTS: counts})
    return outs, eagle_fused.join(target_cache, draft_cache, hidden_cache)


def _verify(
    target_forward: step.Forward,
    w: Any,
    cache: KVCache,
    tokens: Tensor,
    at: Tensor,
    *,
    spec: FusedSpec,
    coll: Collectives,
) -> tuple[Tensor, Tensor, KVCache]:
    """Rule 2: the target's pass over the tree's N nodes `tokens` [B, N] at slots p..p+N-1 (`at`
    [B, 1] is p): logits [B, N, V], final hidden states [B, N, E] and its cache."""
    assert spec.tree is not None
    n = spec.tree.nodes
    slots = at + torch.arange(n, device=at.device)[None, :]  # [B, N]
    last = torch.full((tokens.shape[0],), n - 1, dtype=torch.int64, device=at.device)
    t = spec.target
    logits, cache, extras = target_forward(
        w,
        cache,
        StepInputs(input_ids=tokens, position_ids=slots, last_index=last),
        spec=t.model,
        part=t.partition,
        coll=coll,
        all_logits=True,
        tree=token_tree.tree_inputs(slots, spec.tree),
        hidden=True,
    )
    return logits, extras[decoder.HIDDEN], cache
