"""Fused speculation: a draft model and its target in one program per step. Pure.

Theory of operation (NxDI's fused speculation, `enable_fused_speculation`):
1. One program holds both models' weights (`FusedWeights`) and both KV caches, as one `KVCache`
   value: the target's layers first, then the draft's (`join_caches` / `split_caches`). Both
   caches have the same slots, so one cache view (a bucket) serves both.
2. Context encoding (`context_step`): the target encodes the prompts and picks the first token
   (greedy, or sampled with the row's `params` and `uniforms` [B]); the draft encodes the same
   prompts into its cache (`DraftContext`).
3. A fused step (`fused_step`) takes each row's last accepted token `cur` [B, 1] at its position
   p [B, 1]. The draft runs k = speculation_length greedy decode steps, unrolled when traced:
   step i feeds the previous token at p + i. Its first k-1 tokens are the proposals d_1..d_{k-1};
   the k-th step only writes d_{k-1}'s keys and values, so that after a step that accepts every
   proposal the draft's cache holds each emitted input. The target then scores [cur, d_1 ..
   d_{k-1}] at p .. p+k-1 in one k-token pass, and acceptance runs in the program:
   `speculation.greedy_accept`, or with on-device multinomial sampling `speculation.sample_accept`
   with the draft's one-hot distributions (exact speculative sampling for a greedy draft: d is
   kept with probability p(d), else the token is drawn from p without d).
4. Each row emits `counts` [B] in 1..k tokens (`tokens` [B, k], padded past its count with -1)
   and continues at p + count with its last emitted token. Both caches then hold valid keys and
   values for every position below p + count; the rejected tokens' slots lie at or after it and
   are written again by the next step before any query reads them (a query at q reads slots <= q,
   and each step writes its own positions before attending). Rows advance independently.
5. The end of the cache: the cache holds `max_length` positions plus k slack slots, so a step at
   any p < max_length writes inside it; no emitted token may depend on an input at a position >=
   max_length, so counts are clamped to `max_length - p`. A row therefore never advances past
   max_length, and the last token it can emit sits at position max_length (never fed back).
6. Static shapes, no data-dependent Python branch, no `.item()`: k, the vocabulary and whether
   the target samples are fixed when the program is traced (`FusedSpec`).

EAGLE hook: the draft's decode step is a parameter (`DraftStep`): `(weights, cache, ids [B, 1],
positions [B, 1], state) -> (logits [B, 1, V], cache, state)`, with `state` threaded through the k
steps (an EAGLE draft keeps the target's hidden states there). `decoder_draft` builds the
ordinary one from a decoder forward, whose state is unused; `nxdi.core.programs.eagle_fused` the
EAGLE one, with `fused_step(..., hidden=True)` returning the target's hidden states.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from nxdi.core.planning.token_tree import TokenTree
from nxdi.core.programs import decoder, sampling, speculation, step
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import StepOutputs, StepSpec

TOKENS = step.TOKENS
"""Context encoding: the first token [B]; a fused step: the accepted tokens [B, k] (-1 past the count)."""
LOGITS = step.LOGITS
"""With output_logits: the target's logits, [B, 1, V] (context) or [B, k, V] (fused step)."""
COUNTS = "counts"
"""A fused step: tokens each row emits [B], 1..k."""
DRAFT_LOGITS = "draft_logits"
"""With output_logits: the draft's logits, [B, 1, V] (context) or its k steps' [B, k, V]."""

DraftStep = Callable[[Any, KVCache, Tensor, Tensor, Any], tuple[Tensor, KVCache, Any]]
"""One draft decode step: (weights, cache, ids [B, 1], positions [B, 1], state) -> (logits [B, 1, V]
fp32, cache, state). `state` is whatever the draft carries from step to step (None for a plain model)."""

DraftContext = Callable[[Any, KVCache, StepInputs], tuple[Tensor, KVCache]]
"""The draft's context encoding: (weights, cache, prompt inputs [B, S]) -> (logits [B, 1, V], cache)."""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class FusedWeights:
    """Both models' weights: each its own program's weights value."""

    target: Any
    draft: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedSpec:
    """What is fixed when a fused program is traced."""

    target: StepSpec
    """The target's step: its model, partition and on-device sampling (greedy or multinomial)."""
    draft: StepSpec
    """The draft's model and partition (its sampling settings are unused: the draft is greedy)."""
    speculation_length: int
    """k: draft steps per fused step, and tokens the target scores (>= 1)."""
    max_length: int
    """Positions 0..max_length-1 hold tokens; the k slots after them are slack (see the module docstring)."""
    tree: TokenTree | None = None
    """With an EAGLE token tree (`token_tree_config`): its k nodes, the tree step of
    `nxdi.core.programs.eagle_tree` (which emits depth + 1 tokens at most); None: a flat draft."""

    @property
    def target_layers(self) -> int:
        return self.target.model.num_layers

    def outputs(self, *, context: bool) -> tuple[str, ...]:
        """The outputs of a context-encoding (`context`) or fused program, in their order."""
        logits = (LOGITS, DRAFT_LOGITS) if self.target.output_logits else ()
        return (TOKENS, *logits) if context else (TOKENS, COUNTS, *logits)


def join_caches(target: KVCache, draft: KVCache) -> KVCache:
    """One cache value: the target's layers, then the draft's."""
    return KVCache(k=(*target.k, *draft.k), v=(*target.v, *draft.v))


def split_caches(cache: KVCache, target_layers: int) -> tuple[KVCache, KVCache]:
    """The inverse of `join_caches`: (target, draft)."""
    n = target_layers
    return KVCache(k=cache.k[:n], v=cache.v[:n]), KVCache(k=cache.k[n:], v=cache.v[n:])


def decoder_draft(forward: step.Forward, spec: StepSpec, coll: Collectives = SINGLE) -> tuple[DraftStep, DraftContext]:
    """The decode step and context encoding of a draft that is an ordinary decoder (`forward`: its
    program's `forward_outputs`); its state is passed through unchanged."""

    def decode(weights: Any, cache: KVCache, ids: Tensor, positions: Tensor, state: Any) -> tuple[Tensor, KVCache, Any]:
        last = torch.zeros(ids.shape[0], dtype=torch.int64, device=ids.device)
        x = StepInputs(input_ids=ids, position_ids=positions, last_index=last)
        logits, cache, _ = forward(weights, cache, x, spec=spec.model, part=spec.partition, coll=coll)
        return logits, cache, state

    def context(weights: Any, cache: KVCache, x: StepInputs) -> tuple[Tensor, KVCache]:
        logits, cache, _ = forward(weights, cache, x, spec=spec.model, part=spec.partition, coll=coll)
        return logits, cache

    return decode, context


def context_step(
    target_forward: step.Forward,
    draft_context: DraftContext,
    weights: FusedWeights,
    cache: KVCache,
    x: StepInputs,
    params: Tensor,
    uniforms: Tensor,
    *,
    spec: FusedSpec,
    coll: Collectives = SINGLE,
) -> tuple[StepOutputs, KVCache]:
    """Encode the prompts `x` [B, S] into both caches; the target picks each row's first token.

    Args:
        params: [B, 3] (top_k, top_p, temperature); uniforms: [B] in [0, 1).

    Returns:
        tokens [B] int64; with output_logits, logits [B, 1, V] (target) and the extra
        `DRAFT_LOGITS` [B, 1, V]; and the joined cache.
    """
    target_cache, draft_cache = split_caches(cache, spec.target_layers)
    out, target_cache = step.step(
        target_forward, weights.target, target_cache, x, params, uniforms, spec=spec.target, coll=coll
    )
    draft_logits, draft_cache = draft_context(weights.draft, draft_cache, x)
    extras: Mapping[str, Tensor] = {DRAFT_LOGITS: draft_logits} if spec.target.output_logits else {}
    return StepOutputs(logits=out.logits, tokens=out.tokens, extras=extras), join_caches(target_cache, draft_cache)


def fused_step(
    target_forward: step.Forward,
    draft_step: DraftStep,
    weights: FusedWeights,
    cache: KVCache,
    x: StepInputs,
    params: Tensor,
    uniforms: Tensor,
    *,
    spec: FusedSpec,
    coll: Collectives = SINGLE,
    state: Any = None,
    hidden: bool = False,
) -> tuple[StepOutputs, KVCache]:
    """One fused speculation step for every row (see the module docstring).

    Args:
        x: input_ids [B, 1] each row's last accepted token, position_ids [B, 1] its position p
            (< max_length; the cache view must hold p + k slots); last_index is unused.
        params: [B, 3] (top_k, top_p, temperature), used when the target samples.
        uniforms: [B, k] in [0, 1): column i < k-1 tests d_{i+1}, column k-1 is the final draw.
        state: the draft's initial state (None for a plain draft).
        hidden: also return the target's final hidden states of its k-token pass as the extra
            `decoder.HIDDEN` [B, k, E] (what an EAGLE draft reads next; not a program output).

    Returns:
        tokens [B, k] int64 (the row's emitted tokens, then -1), `COUNTS` [B] int64 in
        1..min(k, max_length - p); with output_logits, logits [B, k, V] (target, position i after
        input i) and `DRAFT_LOGITS` [B, k, V] (the draft's k steps); and the joined cache.
    """
    k = spec.speculation_length
    target_cache, draft_cache = split_caches(cache, spec.target_layers)
    cur, at = x.input_ids, x.position_ids  # [B, 1] each
    ids, proposals, draft_logits = cur, [], []
    for i in range(k):  # unrolled when traced: k is static
        logits, draft_cache, state = draft_step(weights.draft, draft_cache, ids, at + i, state)
        draft_logits.append(logits[:, -1])  # [B, V]
        ids = sampling.greedy(logits[:, -1])[:, None]  # [B, 1]: the draft proposes greedily
        proposals.append(ids)
    drafted = torch.cat(proposals[: k - 1], dim=1) if k > 1 else cur[:, :0]  # [B, k-1]
    offsets = torch.arange(k, device=at.device)[None, :]  # [1, k]
    scored = StepInputs(
        input_ids=torch.cat((cur, drafted), dim=1),  # [B, k]
        position_ids=at + offsets,  # [B, k]
        last_index=torch.full((cur.shape[0],), k - 1, dtype=torch.int64, device=cur.device),
    )
    target = spec.target
    asked = {"hidden": True} if hidden else {}  # a program without the option is never passed it
    target_logits, target_cache, target_extras = target_forward(
        weights.target,
        target_cache,
        scored,
        spec=target.model,
        part=target.partition,
        coll=coll,
        all_logits=True,
        **asked,
    )  # [B, k, V]
    tokens, counts = _accept(target_logits, drafted, params, uniforms, spec=target)
    # No emitted token may rest on an input past the cache's max_length positions (the slack).
    counts = torch.minimum(counts, (spec.max_length - at[:, 0]).clamp(min=1))  # [B]
    tokens = torch.where(offsets < counts[:, None], tokens, torch.full_like(tokens, speculation.PAD))
    extras: dict[str, Tensor] = {COUNTS: counts}
    if hidden:
        extras[decoder.HIDDEN] = target_extras[decoder.HIDDEN]  # [B, k, E]
    if target.output_logits:
        extras[DRAFT_LOGITS] = torch.stack(draft_logits, dim=1)  # [B, k, V]
    out = StepOutputs(logits=target_logits if target.output_logits else None, tokens=tokens, extras=extras)
    return out, join_caches(target_cache, draft_cache)


def _accept(
    target_logits: Tensor, drafted: Tensor, params: Tensor, uniforms: Tensor, *, spec: StepSpec
) -> tuple[Tensor, Tensor]:
    """tokens [B, k] and counts [B]: greedy acceptance, or speculative sampling against the draft's
    one-hot distributions when the target samples (rows at temperature 0 or top_k 1 still get the
    greedy result: their p is one-hot)."""
    if not spec.do_sample:
        return speculation.greedy_accept(target_logits, drafted)
    p = speculation.probs(target_logits, params, global_topk=spec.global_topk)  # [B, k, V]
    vocab = torch.arange(p.shape[-1], device=p.device)
    q = (drafted[..., None] == vocab).to(p.dtype)  # [B, k-1, V] one-hot: the draft is greedy
    return speculation.sample_accept(p, q, drafted, uniforms)
