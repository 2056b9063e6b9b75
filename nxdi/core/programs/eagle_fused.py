"""EAGLE speculation as fused speculation: the target and an EAGLE draft in one program. Pure.

The fused programs of `nxdi.core.programs.fused_speculation`, with the EAGLE draft of
`nxdi.core.programs.eagle` in the draft's place (NxDI's `enable_eagle_speculation`). The pairing
(draft position q holds (t_{q+1}, h_q)) is the one the tests' host-driven oracle (tests/support/eagle_loop.py) runs.

1. Hidden-state cache. The draft's first step of a fused call needs h_{p-1}, the target's final
   hidden state at the position before the row's current token: a value of the previous call. The
   cache carries it: after the target's layers and the draft's, one more cache "layer" holds the
   target's hidden state of every position it has processed, slot q holding h_q (`hidden_cache`).
   It has the slots, rows and bucket views of every other layer, so the runtime keeps it per row
   like any KV layer, with static shapes and no extra program input or output. (A cache is a
   sequence of key/value pairs, so h's E values are split across the layer's key tensor, the first
   E//2, and its value tensor, the rest: no memory is spent twice.)
2. Context encoding (`context_step`): the target encodes the prompts and returns its hidden states
   (written to the hidden-state cache) and first token `cur`; the draft encodes the prompt's pairs
   with `cur` at the last one (`eagle.pair_inputs`).
3. A fused step (`fused_step`) at position p with `cur` = t_p: the draft step (`draft_step`) puts
   each token's pair one position behind it, so `fused_speculation.fused_step`'s first draft step
   writes (cur, h_{p-1}) at p-1 (read from the hidden-state cache) and proposes d_1, and step i
   writes (d_i, g) at p-1+i with the draft's own hidden state g from the step before (the `state`
   the fused step threads). The target scores [cur, d_1 .. d_{k-1}] at p .. p+k-1 and also returns
   their hidden states h_p .. h_{p+k-1}, written to the hidden-state cache.
4. Re-pair: with c tokens emitted (t_{p+1} .. t_{p+c}), the draft runs once more over the pairs
   (t_{p+1+s}, h_{p+s}) for s < c (the target's hidden states: NxDI's final draft run), which
   rewrites the provisional slots p .. p+c-1 from the target's h. The next call, at p + c, reads
   h_{p+c-1} from the hidden-state cache and writes that last pair again (the same values).
   Every slot past the accepted ones is rewritten before any query reads it.

Greedy output equals the target's greedy tokens (the target verifies every token); with
on-device sampling the acceptance is the fused step's (speculative sampling against the greedy
draft's one-hot distributions), which keeps the target's distribution.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from nxdi.core.programs import decoder, eagle, fused_speculation, inputs, kv_cache, speculation, step
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.core.programs.fused_speculation import DraftStep, FusedSpec, FusedWeights
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import StepOutputs, StepSpec


def hidden_cache(
    *, batch: int, length: int, width: int, dtype: torch.dtype, device: torch.device | None = None
) -> KVCache:
    """A zero hidden-state cache (rule 1): one layer, key [B, 1, T, E//2] and value [B, 1, T, E - E//2]."""
    low = width // 2
    return KVCache(
        k=(torch.zeros((batch, 1, length, low), dtype=dtype, device=device),),
        v=(torch.zeros((batch, 1, length, width - low), dtype=dtype, device=device),),
    )


def read_hidden(cache: KVCache, positions: Tensor) -> Tensor:
    """h at `positions` [B] of each row -> [B, E]."""
    halves = []
    for t in (cache.k[0], cache.v[0]):  # [B, 1, T, e]
        index = positions.reshape(-1, 1, 1, 1).expand(t.shape[0], 1, 1, t.shape[3])
        halves.append(t.gather(2, index)[:, 0, 0])  # [B, e]
    return torch.cat(halves, dim=-1)


def write_hidden(cache: KVCache, hidden: Tensor, slots: Tensor) -> KVCache:
    """The hidden-state cache with `hidden` [B, S, E] written at `slots` [B, S] (distinct, < T)."""
    low = cache.k[0].shape[3]
    new = hidden.to(cache.k[0].dtype)[:, None]  # [B, 1, S, E]
    return KVCache(
        k=(kv_cache.write(cache.k[0], new[..., :low], slots),),
        v=(kv_cache.write(cache.v[0], new[..., low:], slots),),
    )


def split(cache: KVCache, target_layers: int) -> tuple[KVCache, KVCache, KVCache]:
    """(target, draft, hidden-state cache) of the joined cache: the last layer is the hidden states'."""
    target, rest = fused_speculation.split_caches(cache, target_layers)
    draft = KVCache(k=rest.k[:-1], v=rest.v[:-1])
    return target, draft, KVCache(k=rest.k[-1:], v=rest.v[-1:])


def join(target: KVCache, draft: KVCache, hidden: KVCache) -> KVCache:
    """The inverse of `split`."""
    return fused_speculation.join_caches(fused_speculation.join_caches(target, draft), hidden)


def draft_step(spec: StepSpec, coll: Collectives = SINGLE) -> DraftStep:
    """The EAGLE draft as a fused step's draft (rule 3): token `ids` [B, 1] at `positions` [B, 1] is
    paired at position - 1 with `state` [B, E] (the hidden state before it); the new state is the
    draft's own hidden state g [B, E]."""

    def run(w: Any, cache: KVCache, ids: Tensor, positions: Tensor, state: Any) -> tuple[Tensor, KVCache, Any]:
        # A real call has p >= 1 (context encoding came first); the clamp keeps example inputs at
        # position 0 (tracing, warm-up) inside the cache.
        x = inputs.token_inputs(ids[:, 0], (positions[:, 0] - 1).clamp(min=0))
        logits, own, cache = eagle.forward(
            w, cache, x, state[:, None], spec=spec.model, part=spec.partition, coll=coll
        )  # [B, 1, V], [B, 1, E]
        return logits, cache, own[:, 0]

    return run


def context_step(
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
    """Rule 2: encode the prompts `x` [B, S] into the three caches; the target picks each row's first token.

    Args:
        params: [B, 3] (top_k, top_p, temperature); uniforms: [B] in [0, 1).

    Returns:
        tokens [B] int64; with output_logits, logits [B, 1, V] (the target's) and `DRAFT_LOGITS`
        [B, 1, V] (the draft's at the last pair, its first proposal's); and the joined cache.
    """
    target_cache, draft_cache, hidden_cache_ = split(cache, spec.target_layers)
    target = dataclasses.replace(spec.target, hidden_states=True)
    out, target_cache = step.step(
        target_forward, weights.target, target_cache, x, params, uniforms, spec=target, coll=coll
    )
    hidden = out.extras[decoder.HIDDEN]  # [B, S, E]
    assert out.tokens is not None, "a fused target samples on device"
    paired, prev = eagle.pair_inputs(x, hidden, out.tokens)
    d = spec.draft
    draft_logits, _, draft_cache = eagle.forward(
        weights.draft, draft_cache, paired, prev, spec=d.model, part=d.partition, coll=coll
    )
    hidden_cache_ = write_hidden(hidden_cache_, hidden, x.position_ids)
    extras: dict[str, Tensor] = {}
    if spec.target.output_logits:
        extras[fused_speculation.DRAFT_LOGITS] = eagle.last_of(draft_logits, x.last_index)[:, None]
    outs = StepOutputs(logits=out.logits, tokens=out.tokens, extras=extras)
    return outs, join(target_cache, draft_cache, hidden_cache_)


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
    """Rules 3-4: one EAGLE fused step for every row (inputs and outputs as `fused_speculation.fused_step`).

    Args:
        x: input_ids [B, 1] each row's last accepted token, position_ids [B, 1] its position p
            (1 <= p < max_length: context encoding came first); last_index is unused.
    """
    target_cache, draft_cache, hidden_cache_ = split(cache, spec.target_layers)
    at = x.position_ids  # [B, 1]
    state = read_hidden(hidden_cache_, (at[:, 0] - 1).clamp(min=0))  # [B, E] h_{p-1} (clamped: see draft_step)
    out, joined = fused_speculation.fused_step(
        target_forward,
        draft_step(spec.draft, coll),
        weights,
        fused_speculation.join_caches(target_cache, draft_cache),
        x,
        params,
        uniforms,
        spec=spec,
        coll=coll,
        state=state,
        hidden=True,
    )
    target_cache, draft_cache = fused_speculation.split_caches(joined, spec.target_layers)
    extras = dict(out.extras)
    hidden = extras.pop(decoder.HIDDEN)  # [B, k, E] h_p .. h_{p+k-1}
    counts, tokens = extras[fused_speculation.COUNTS], out.tokens
    assert tokens is not None, "a fused step returns its tokens"
    positions = at + torch.arange(spec.speculation_length, device=at.device)[None, :]  # [B, k]
    draft_cache, hidden_cache_ = catch_up(
        weights.draft, draft_cache, hidden_cache_, tokens, hidden, positions, counts, spec=spec.draft, coll=coll
    )
    outs = StepOutputs(logits=out.logits, tokens=tokens, extras=extras)
    return outs, join(target_cache, draft_cache, hidden_cache_)


def catch_up(
    w: Any,
    draft_cache: KVCache,
    hidden_cache: KVCache,
    emitted: Tensor,
    hidden: Tensor,
    positions: Tensor,
    counts: Tensor,
    *,
    spec: StepSpec,
    coll: Collectives,
) -> tuple[KVCache, KVCache]:
    """After acceptance (rule 4, NxDI's final draft run): the draft runs over the emitted tokens
    `emitted` [B, W] (-1 past each row's count) paired with the target's hidden states `hidden`
    [B, W, E] before them, at `positions` [B, W] (p, p+1, ...), rewriting its cache there; the hidden
    states go to the hidden-state cache at the same positions. `counts` [B] in 1..W. Returns the
    draft's and the hidden-state caches."""
    ids = torch.where(emitted == speculation.PAD, torch.zeros_like(emitted), emitted)  # t_{p+1+s}
    x = StepInputs(input_ids=ids, position_ids=positions, last_index=counts - 1)
    _, _, draft_cache = eagle.forward(w, draft_cache, x, hidden, spec=spec.model, part=spec.partition, coll=coll)
    return draft_cache, write_hidden(hidden_cache, hidden, positions)
