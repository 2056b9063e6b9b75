"""Medusa heads and the Medusa programs: the decoder step plus the heads, and the tree step. Pure.

A Medusa model runs the decoder with its final (normed) hidden states returned (`decoder.HIDDEN`)
and puts the heads on them inside the program (`nxdi.core.planning.medusa` has the layout):

    head_i(h) = lm_i(h + SiLU(W_i h + b_i))                      [.., V] fp32

Every program of the model returns `MEDUSA_TOKENS` [B, H, K]: each head's top-K token ids (best
first) at the row's output token, the candidates of the next tree. A context-encoding or
token-generation step is the decoder's own step plus that output. A tree step (the speculation
phase, N = medusa_speculation_length tokens per row laid out by the plan's tree, at slots
L..L+N-1) also accepts in the program (`token_tree.greedy_accept`), compacts the accepted nodes'
keys and values (`token_tree.compact`) and runs the heads at the accepted chain's last node:

    forward_outputs(...) -> logits [B, N, V], cache, {MEDUSA_TOKENS: [B, H, K],
                            ACCEPTED_TOKENS: [B, D+1], ACCEPTED_COUNTS: [B]}

so one step is one round of Medusa decoding, and the host only feeds its outputs back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import medusa as medusa_plan
from nxdi.core.planning.medusa import MedusaPlan
from nxdi.core.planning.partition import Partition
from nxdi.core.programs import decoder, inputs, token_tree
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache

MEDUSA_TOKENS = "medusa_tokens"
"""[B, H, K] int64: each head's top-K candidates at the row's output token (the accepted chain's
last node in a tree step)."""
ACCEPTED_TOKENS = "accepted_tokens"
"""[B, D+1] int64 (tree steps): the accepted tokens, the target's own next token, then -1."""
ACCEPTED_COUNTS = "accepted_counts"
"""[B] int64 (tree steps): tokens emitted, 1..D+1."""


ROW_OUTPUTS = frozenset({MEDUSA_TOKENS, ACCEPTED_TOKENS, ACCEPTED_COUNTS})
"""The Medusa outputs, one value per batch row ([B, ...]; routing outputs are per token)."""


def outputs(*, tree: bool) -> tuple[str, ...]:
    """The extra outputs of a Medusa program, in order: a tree step's, or any other step's."""
    return (MEDUSA_TOKENS, ACCEPTED_TOKENS, ACCEPTED_COUNTS) if tree else (MEDUSA_TOKENS,)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class MedusaHead:
    """One head: a ResBlock, then an LM layer without bias."""

    res_weight: Tensor
    """[E, E]"""
    res_bias: Tensor
    """[E]"""
    lm: Tensor
    """[V, E]"""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class MedusaWeights:
    """The target's weights (its program's value) and the heads."""

    decoder: Any
    heads: tuple[MedusaHead, ...]


def heads_from_tensors(tensors: Mapping[str, Tensor], num_heads: int) -> tuple[MedusaHead, ...]:
    """The heads from tensors named by their checkpoint keys (`medusa_plan.head_keys`).

    Raises:
        KeyError: a head tensor is missing (the loader checks the file before this).
    """
    out = []
    for i in range(num_heads):
        res_w, res_b, lm = medusa_plan.head_keys(i)
        out.append(MedusaHead(res_weight=tensors[res_w], res_bias=tensors[res_b], lm=tensors[lm]))
    return tuple(out)


def head_logits(heads: tuple[MedusaHead, ...], h: Tensor) -> Tensor:
    """Every head's logits [N, H, V] fp32 at hidden states h [N, E] (the target's, after its final norm)."""
    out = []
    for head in heads:
        x = h + F.silu(F.linear(h, head.res_weight, head.res_bias))  # the ResBlock
        out.append(F.linear(x, head.lm).float())
    return torch.stack(out, dim=1)


def top_candidates(heads: tuple[MedusaHead, ...], h: Tensor, k: int) -> Tensor:
    """[N, H, K] int64: each head's K best tokens at h [N, E], best first."""
    return head_logits(heads, h).topk(k, dim=-1).indices


Forward = Callable[..., tuple[Tensor, KVCache, Mapping[str, Tensor]]]


def forward_outputs(
    w: MedusaWeights,
    cache: KVCache,
    x: StepInputs,
    *,
    spec: ModelSpec,
    part: Partition | None = None,
    coll: Collectives = SINGLE,
    all_logits: bool = False,
    blocks: BlockInputs | None = None,
    base: Forward,
    plan: MedusaPlan,
) -> tuple[Tensor, KVCache, dict[str, Tensor]]:
    """One Medusa step (bind `base`, the target's `forward_outputs`, and `plan` first).

    Args:
        w: the target's weights and the heads.
        cache: the cache view [B, K, T, D] per layer.
        x: inputs [B, S]. With `all_logits` (the speculation phase) this is a tree step: S = N
            tokens laid out by `plan.tree`, `position_ids` their slots L..L+N-1 (contiguous).
        spec, part, coll: as `decoder.forward_outputs`.
        blocks: must be None (Medusa runs on the contiguous cache).

    Returns:
        A context/token step: the decoder's logits [B, 1, V], cache and extras, plus
        `MEDUSA_TOKENS`. A tree step: logits [B, N, V] at every node, the cache with the accepted
        nodes compacted to L..L+n, and `MEDUSA_TOKENS`, `ACCEPTED_TOKENS`, `ACCEPTED_COUNTS`.
    """
    assert blocks is None, "Medusa runs on the contiguous KV cache (checked by the configuration)"
    kwargs: dict[str, Any] = {"spec": spec, "part": part, "coll": coll, "hidden": True}
    if not all_logits:
        logits, cache, extras = base(w.decoder, cache, x, **kwargs)
        extras = dict(extras)
        every = extras.pop(decoder.HIDDEN)  # [B, S, E]
        hidden = every.gather(1, x.last_index[:, None, None].expand(-1, 1, every.shape[-1]))[:, 0]  # [B, E]
        return logits, cache, {**extras, MEDUSA_TOKENS: top_candidates(w.heads, hidden, plan.top_k)}
    slots = inputs.write_slots(x)  # [B, N]: L..L+N-1
    tree = token_tree.tree_inputs(slots, plan.tree)
    logits, cache, extras = base(w.decoder, cache, x, all_logits=True, tree=tree, **kwargs)
    extras = dict(extras)
    hidden = extras.pop(decoder.HIDDEN)  # [B, N, E]
    accepted = token_tree.greedy_accept(logits, x.input_ids, plan.tree)
    cache = token_tree.compact(cache, accepted, slots[:, 0])
    at = accepted.last[:, None, None].expand(-1, 1, hidden.shape[-1])
    candidates = top_candidates(w.heads, hidden.gather(1, at)[:, 0], plan.top_k)  # [B, H, K]
    return (
        logits,
        cache,
        {
            **extras,
            MEDUSA_TOKENS: candidates,
            ACCEPTED_TOKENS: accepted.tokens,
            ACCEPTED_COUNTS: accepted.counts,
        },
    )
