"""A mixture of experts' MoENeuronConfig settings as the programs use them: the MoE block's options,
and the routing outputs a step returns for testing. Pure.

NxD's `return_router_logits` / `return_expert_index` make its MoE module return the router logits
and the chosen experts besides the hidden states. Here they make a step return them for every
layer, as extra named outputs (`routing_outputs`), the way transformers' `output_router_logits=True`
returns one router-logits tensor per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from nxdi.core.config.sub_specs import MoESpec
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning.partition import Partition
from nxdi.core.programs import moe

ROUTER_LOGITS = "router_logits"
"""The extra output of every layer's router logits: [L, B*S, X] fp32."""
EXPERT_INDEX = "expert_index"
"""The extra output of every layer's chosen experts: [L, B*S, k] int64, best first."""
FILL = {ROUTER_LOGITS: 0.0, EXPERT_INDEX: -1}
"""What forward() returns for a token of `input_ids` the call did not route (padding, a prompt's
cached prefix or truncated tail): it has no routing of its own."""


def moe_options(spec: ModelSpec, settings: MoESpec) -> moe.MoEOptions:
    """The MoE block's options from the model and its MoENeuronConfig settings (the checkpoint's
    renormalisation, which `normalize_top_k_affinities=False` turns off)."""
    return moe.MoEOptions(
        top_k=spec.num_experts_per_tok,
        activation=spec.activation,
        router_act=settings.router_config.act_fn,
        router_dtype=getattr(torch, settings.router_config.dtype),
        normalize_top_k=spec.moe_normalize and settings.normalize_top_k_affinities,
        normalize_p=spec.moe_normalize_p,
        capacity_factor=settings.capacity_factor,
        glu_type=settings.glu_type,
        hidden_act_scaling_factor=settings.hidden_act_scaling_factor,
        hidden_act_bias=settings.hidden_act_bias,
        gate_clamp_upper=settings.gate_clamp_upper_limit,
        gate_clamp_lower=settings.gate_clamp_lower_limit,
        up_clamp_upper=settings.up_clamp_upper_limit,
        up_clamp_lower=settings.up_clamp_lower_limit,
        early_affinity_modulation=settings.early_expert_affinity_modulation,
    )


def routing_outputs(part: Partition | None) -> tuple[str, ...]:
    """The extra outputs the MoE settings of `part` ask for, in this order: `ROUTER_LOGITS`
    (`return_router_logits`), `EXPERT_INDEX` (`return_expert_index`); none for a dense model."""
    settings = None if part is None else part.moe
    if settings is None:
        return ()
    asked = ((ROUTER_LOGITS, settings.return_router_logits), (EXPERT_INDEX, settings.return_expert_index))
    return tuple(name for name, on in asked if on)


def stack_routing(routed: Sequence[moe.MoEOutput], names: Sequence[str]) -> dict[str, Tensor]:
    """The routing outputs `names` asks for, every layer's (`routed`, one per layer) stacked:
    `ROUTER_LOGITS` [L, T, X] fp32 (from the router's dtype), `EXPERT_INDEX` [L, T, k] int64."""
    out = {}
    if ROUTER_LOGITS in names:
        out[ROUTER_LOGITS] = torch.stack([r.router_logits.float() for r in routed])
    if EXPERT_INDEX in names:
        out[EXPERT_INDEX] = torch.stack([r.expert_index for r in routed])
    return out
