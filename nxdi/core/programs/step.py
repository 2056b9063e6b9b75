"""One compiled step: the decoder forward plus, optionally, the on-device sampler. Pure.

This is the function a backend traces per sub-model and bucket. Its static part is a `StepSpec`
(architecture, whether sampling happens inside the program, whether logits are returned, which
extra outputs the MoE settings ask for); its dynamic part is tensors only, so buckets and batch
sizes come from the input shapes:

    step(weights, cache, x, params, uniforms) -> (StepOutputs, cache)
    StepOutputs: logits [B, 1, V] fp32 | None, tokens [B] | None, extras {name: tensor}

`params` [B, 3] holds (top_k, top_p, temperature) per row and `uniforms` [B] the random draws
(the caller's seeded generator, or 0.5 for deterministic sampling); both are ignored without
on-device sampling. A compiled step returns its outputs flat, in `StepSpec.outputs` order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning.partition import Partition
from nxdi.core.programs import moe_settings, sampling
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.core.programs.decoder import HIDDEN
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache

Forward = Callable[..., tuple[Tensor, KVCache, Mapping[str, Tensor]]]
"""A program's `forward_outputs(weights, cache, x, *, spec, part, coll, ...)`: logits, the cache and
the extra outputs by name (see `nxdi.core.programs.decoder.forward_outputs`)."""

LOGITS = "logits"
TOKENS = "tokens"


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class StepOutputs:
    """What one step returns besides the cache (outputs the program does not return are None)."""

    logits: Tensor | None = None
    """[B, 1, V] fp32 ([B, R, V] with a block cache)."""
    tokens: Tensor | None = None
    """[B] int64 sampled ids ([B*R] with a block cache)."""
    extras: Mapping[str, Tensor] = dataclasses.field(default_factory=dict)
    """Further outputs by name, `StepSpec.extras` (`moe_settings.ROUTER_LOGITS` [L, B*S, X] fp32,
    `moe_settings.EXPERT_INDEX` [L, B*S, k] int64, `decoder.HIDDEN` [B, S, E])."""

    def named(self) -> dict[str, Tensor]:
        """Every output present, by name: logits, tokens, then the extras in their order."""
        fixed = {LOGITS: self.logits, TOKENS: self.tokens}
        return {**{n: t for n, t in fixed.items() if t is not None}, **self.extras}

    @classmethod
    def from_named(cls, named: Mapping[str, Tensor]) -> StepOutputs:
        """The inverse of `named` (a compiled program's outputs, zipped with its signature's names)."""
        extras = {n: t for n, t in named.items() if n not in (LOGITS, TOKENS)}
        return cls(logits=named.get(LOGITS), tokens=named.get(TOKENS), extras=extras)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSpec:
    """What is fixed when a step is traced."""

    model: ModelSpec
    partition: Partition | None = None
    """What one rank holds under tensor parallelism (None: one rank holds everything)."""
    on_device_sampling: bool = False
    """Return sampled tokens instead of (or with) logits."""
    do_sample: bool = False
    """Multinomial sampling; greedy argmax otherwise (ignored without on-device sampling)."""
    global_topk: int = 256
    output_logits: bool = True
    """Return logits too; always True without on-device sampling."""
    all_logits: bool = False
    """Return every token's logits [B, S, V] (and with on-device sampling a token per position,
    [B*S]): a speculation step, which scores the S = speculation_length tokens it is given."""
    program_outputs: tuple[str, ...] = ()
    """Further extra outputs the forward itself returns, after the routing ones (a Medusa
    program's candidates, `nxdi.core.programs.medusa.outputs`)."""
    hidden_states: bool = False
    """Also return every token's final hidden state [B, S, E] (after the final norm) as the extra
    output `decoder.HIDDEN`: what an EAGLE draft reads from its target (NxDI's `full_hidden_states`)."""

    @property
    def extras(self) -> tuple[str, ...]:
        """The extra outputs: those the partition's MoE settings ask for (`moe_settings.routing_outputs`),
        then `program_outputs`, then `decoder.HIDDEN` with `hidden_states`."""
        hidden = (HIDDEN,) if self.hidden_states else ()
        return (*moe_settings.routing_outputs(self.partition), *self.program_outputs, *hidden)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every output's name, in the order a compiled step returns them (its signature's)."""
        if not self.on_device_sampling:
            fixed: tuple[str, ...] = (LOGITS,)
        else:
            fixed = (LOGITS, TOKENS) if self.output_logits else (TOKENS,)
        return (*fixed, *self.extras)


def step(
    forward: Forward,
    weights: Any,
    cache: KVCache,
    x: StepInputs,
    params: Tensor,
    uniforms: Tensor,
    *,
    spec: StepSpec,
    coll: Collectives = SINGLE,
    blocks: BlockInputs | None = None,
) -> tuple[StepOutputs, KVCache]:
    """Run `forward` for one step (on one rank's shard, meeting the others through `coll`) and sample
    if the spec says so. Every rank gets the whole logits, so every rank samples the same tokens.

    With `blocks` (a block KV cache, `nxdi.core.programs.block_kv`) each row returns one output per
    segment: logits [B, R, V], and `params` [B*R, 3] / `uniforms` [B*R] hold a row per segment.

    Returns:
        The outputs: logits [B, 1, V] fp32 ([B, S, V] with `spec.all_logits`; None when only
        tokens were asked for), tokens [B] int64 (None without on-device sampling; [B*R] with
        blocks, [B*S] with all_logits) and the extras `spec.extras`
        names; and the updated cache (view).
    """
    asked = {"hidden": True} if spec.hidden_states else {}  # a program without the option is never passed it
    logits, cache, extras = forward(
        weights,
        cache,
        x,
        spec=spec.model,
        part=spec.partition,
        coll=coll,
        all_logits=spec.all_logits,
        blocks=blocks,
        **asked,
    )
    if not spec.on_device_sampling:
        return StepOutputs(logits=logits, extras=extras), cache
    if spec.all_logits:  # each position is sampled with its row's settings
        per = x.input_ids.shape[1]
        params, uniforms = params.repeat_interleave(per, 0), uniforms.repeat_interleave(per, 0)
    last = logits.reshape(-1, logits.shape[-1])  # [B*R, V]: one output per row (and segment, or position)
    tokens = sampling.select(last, params, uniforms, do_sample=spec.do_sample, global_topk=spec.global_topk)
    return StepOutputs(logits=logits if spec.output_logits else None, tokens=tokens, extras=extras), cache


def example_inputs(*, batch: int, tokens: int) -> tuple[StepInputs, Tensor, Tensor]:
    """Inputs of one step's shapes: what tracing and warm-up run (values are arbitrary but valid).

    Args:
        batch: B rows.
        tokens: S, the context bucket in context encoding and 1 in token generation.

    Returns:
        StepInputs [B, S] (token 0, positions 0..S-1, last index S-1), params [B, 3] of greedy rows
        (1, 1, 1), and uniforms [B] of 0.5.
    """
    x = StepInputs(
        input_ids=torch.zeros(batch, tokens, dtype=torch.int64),
        position_ids=torch.arange(tokens, dtype=torch.int64)[None, :].expand(batch, tokens).contiguous(),
        last_index=torch.full((batch,), tokens - 1, dtype=torch.int64),
    )
    return x, torch.ones(batch, 3, dtype=torch.float32), torch.full((batch,), 0.5, dtype=torch.float32)
