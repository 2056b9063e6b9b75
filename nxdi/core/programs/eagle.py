"""The EAGLE (v1) draft program: the decoder fed `fc([embedding; previous hidden state])`. Pure.

Theory of operation (NxDI's `is_eagle_draft` model and its fused EAGLE speculation):
1. What the target gives. A target step run with `StepSpec.hidden_states` (decoder
   `forward_outputs(hidden=True)`) also returns h_q [B, S, E] for every token: the final hidden
   state at position q *after* the final norm, the very vector the lm_head turns into the logits
   that chose token t_{q+1}.
2. Pairing. Draft position q holds the pair (t_{q+1}, h_q): the embedding of the token at position
   q + 1 beside the hidden state that predicted it, `x = fc([embed(t_{q+1}); h_q])` [B, S, E]. So
   the draft runs one position behind the target, and its output at q predicts t_{q+2}.
   `pair_inputs` builds these inputs from a target step's: ids shifted left by one, the token the
   target chose after the last one at the last index, positions and hidden states as they are.
3. Layers. `x` goes through the draft's decoder layers (the decoder program, `inputs_embeds`), with
   no input norm unless `enable_eagle_draft_input_norm` and no final norm: the lm_head (the
   target's) reads the last layer's output g_q as it is. `forward` returns the logits of every
   token [B, S, V] and g_q [B, S, E]: the draft's own hidden state, its estimate of h_{q+1}.
4. Later steps. Drafting past what the target has verified, the draft has no h_q yet and feeds its
   own g_{q-1} instead: (d_{q+1}, g_{q-1}) at position q (the fused step's draft steps, one token per step).
5. Cache. Slot q of the draft's KV cache holds the keys and values computed from the pair at q. A
   slot written from the draft's own g is provisional: once the target has scored the drafted
   tokens, the caller runs `pair_inputs` over that target step (its hidden states, up to the
   accepted count) and `forward` again, which rewrites those slots from the target's h (NxDI's
   final draft run) and whose output at the last index already proposes the next round's first
   token. Slots past the accepted tokens are overwritten before any query can see them.

Static shapes throughout: the pairing is a gather and a `where`, drafting is a Python loop over the
static number of steps, and nothing branches on tensor values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning.partition import Partition
from nxdi.core.programs import decoder
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.core.programs.decoder import DecoderWeights
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.linear import Weight, linear
from nxdi.core.programs.token_tree import TreeInputs


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class EagleWeights:
    """An EAGLE draft's weights: its decoder (no final norm; input norms only with
    `enable_eagle_draft_input_norm`) and `fc`."""

    decoder: DecoderWeights
    fc: Weight
    """[E, 2E]: columns 0..E-1 read the token embedding, E..2E-1 the previous hidden state."""
    fc_bias: Tensor | None = None
    """[E] (the draft config's `fc_bias`)."""


def weights_from_slots(slots: Mapping[str, Any], *, spec: ModelSpec) -> EagleWeights:
    """The weights value from the slots of the draft's table (`EagleDraft.table(...).slots`).

    Raises:
        KeyError: no `fc` slot (slots of a table that is not an EAGLE draft's).
    """
    return EagleWeights(
        decoder=decoder.weights_from_slots(slots, spec=spec), fc=slots["fc"], fc_bias=slots.get("fc_bias")
    )


def forward(
    w: EagleWeights,
    cache: KVCache,
    x: StepInputs,
    prev_hidden: Tensor,
    *,
    spec: ModelSpec,
    part: Partition | None = None,
    coll: Collectives = SINGLE,
    tree: TreeInputs | None = None,
) -> tuple[Tensor, Tensor, KVCache]:
    """One draft step over S pairs (a context bucket, a re-run over a verified step, one token, or
    one level of a token tree).

    Args:
        w: the draft's weights.
        cache: the draft's cache view, L layers of [B, K, T, D].
        x: the pairs' tokens t_{q+1} [B, S], their positions q [B, S] and each row's last real
            index [B] (`pair_inputs` builds them from a target step; `inputs.token_inputs` one).
        prev_hidden: [B, S, E] h_q beside each token: the target's final hidden states, or the
            draft's own from its previous step.
        spec: the draft's architecture (a Llama config with its own num_hidden_layers).
        part, coll: one rank's share and the collectives, as for `decoder.forward_outputs`.
        tree: with a token tree (`nxdi.core.programs.eagle_tree`), the pairs' rotary positions and
            the tree mask they attend by, as for `decoder.forward_outputs`.

    Returns:
        logits [B, S, V] fp32 of every pair (row b's prediction of t_{q+2} at index s), the draft's
        own hidden states g [B, S, E] (the last layer's output, unnormed) and the cache with every
        pair's keys and values written at its slot (padding at the slots after the last real one).
    """
    embeds = decoder.token_embeddings(w.decoder, x.input_ids, spec=spec, part=part, coll=coll)  # [B, S, E]
    joined = torch.cat((embeds, prev_hidden.to(embeds.dtype)), dim=-1)  # [B, S, 2E]
    h = linear(joined, w.fc, w.fc_bias)  # [B, S, E]
    logits, cache, extras = decoder.forward_outputs(
        w.decoder, cache, x, spec=spec, part=part, coll=coll, all_logits=True, inputs_embeds=h, hidden=True, tree=tree
    )
    return logits, extras[decoder.HIDDEN], cache


def pair_inputs(
    x: StepInputs, hidden: Tensor, next_tokens: Tensor, *, last_index: Tensor | None = None
) -> tuple[StepInputs, Tensor]:
    """The draft's inputs for the positions a target step `x` covered (rule 2).

    Args:
        x: the target step's inputs [B, S] (a prompt, or a speculation step's k tokens).
        hidden: the target's final hidden states of that step [B, S, E] (`decoder.HIDDEN`).
        next_tokens: [B] the token the target emitted after the row's last index (its first
            generated token after a prompt; the correction or bonus token after a speculation step).
        last_index: [B] the last index to pair (a speculation step: its accepted draft count, so
            the rejected drafts are left out); default `x.last_index`.

    Returns:
        StepInputs whose token at index s is `x`'s token s+1 (`next_tokens` at the last index),
        with `x`'s positions, and `hidden` unchanged as the previous hidden states.
    """
    last = x.last_index if last_index is None else last_index
    s = x.input_ids.shape[1]
    shifted = torch.roll(x.input_ids, -1, dims=1)  # index s holds token s+1 (the wrapped one is padding)
    at_last = torch.arange(s, device=x.input_ids.device)[None, :] == last[:, None]  # [B, S]
    ids = torch.where(at_last, next_tokens.to(x.input_ids.dtype)[:, None], shifted)
    return StepInputs(input_ids=ids, position_ids=x.position_ids, last_index=last), hidden


def last_of(t: Tensor, index: Tensor) -> Tensor:
    """Row b's entry at `index[b]` of t [B, S, ...] -> [B, ...] (a step's last real pair)."""
    picked = index.reshape(-1, 1, *([1] * (t.dim() - 2))).expand(t.shape[0], 1, *t.shape[2:])
    return t.gather(1, picked).squeeze(1)
