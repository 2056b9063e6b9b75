"""What speculation puts on the device beside the target's own weights and KV cache. Pure.

Rules (figures per core; every figure is what the engine allocates on one rank):
- Fused speculation (`enable_fused_speculation`, EAGLE included): every cache row holds
  `max_length + speculation_length` slots, the last k of them slack a fused step writes past the
  last position (`nxdi.core.planning.fused_programs.cache_length`); the target's KV cache is planned
  at that length, and so are the draft's and the hidden states'.
- The draft (fused speculation): its own weights (its sharding plan at the target's tp, its own
  dtype) and its own KV cache (its layers and KV heads, the target's cache rows, the fused length,
  its own cache dtype). It is counted only when its configuration is given (`Draft`); otherwise the
  plan says it is not counted.
- An EAGLE draft (`is_eagle_draft`) holds its decoder's weights with `fc` [E, 2E] (and its bias
  with `fc_bias`) added, without the final norm, and without the layers' input norms unless
  `enable_eagle_draft_input_norm` (`nxdi.core.eagle_layout`), in the draft's dtype.
- EAGLE (`enable_eagle_speculation`): one more cache layer holds the target's hidden state of every
  slot, `[rows, fused length, hidden]` in the target's dtype (`nxdi.core.programs.eagle_fused`).
- Medusa (`is_medusa`): `num_medusa_heads` heads, each a ResBlock (`[E, E]` weight, `[E]` bias) and
  a vocabulary projection `[V, E]`, in the target's dtype (`nxdi.core.planning.medusa.head_shapes`);
  every rank holds them whole.
"""

from __future__ import annotations

import math

import attrs

from nxdi.core.config.neuron_spec import DTYPE_BYTES, NeuronSpec
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import fused_programs
from nxdi.core.planning import medusa as medusa_plan


@attrs.frozen(kw_only=True)
class Draft:
    """A fused-speculation draft to plan: its architecture and its NeuronSpec (fused_spec_config's)."""

    model: ModelSpec
    spec: NeuronSpec
    """Its NeuronSpec; `is_eagle_draft` marks an EAGLE draft (`eagle_weights_delta`)."""
    fc_bias: bool = False
    """An EAGLE draft's `fc` has a bias (its config.json's `fc_bias`)."""


@attrs.frozen(kw_only=True)
class SpeculationLoad:
    """What a configuration's speculation adds on the device (see the module rules)."""

    spare_slots: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Slack cache slots per row of fused programs (k); 0 without fused speculation."""
    draft: Draft | None = None
    """The fused draft, when its configuration is known."""
    draft_not_counted: bool = False
    """Fused speculation whose draft configuration was not given: its memory is not counted."""
    medusa_heads_bytes: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Every Medusa head's weights (whole on every rank)."""
    hidden_cache_bytes: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """EAGLE's hidden-state cache layer (whole on every rank)."""


def cache_slots(spec: NeuronSpec) -> int:
    """Slots of each cache row: max_length, plus speculation_length with fused speculation."""
    return fused_programs.cache_length(spec) if spec.enable_fused_speculation else spec.max_length


def medusa_heads_bytes(model: ModelSpec, spec: NeuronSpec) -> int:
    """Bytes of the Medusa heads of `spec` (0 unless `is_medusa`)."""
    if not spec.is_medusa:
        return 0
    shapes = medusa_plan.head_shapes(spec.num_medusa_heads, hidden=model.hidden_size, vocab=model.vocab_size)
    return sum(math.prod(s) for s in shapes.values()) * DTYPE_BYTES[spec.torch_dtype]


def hidden_cache_bytes(model: ModelSpec, spec: NeuronSpec) -> int:
    """Bytes of EAGLE's hidden-state cache layer (0 unless `enable_eagle_speculation`)."""
    if not spec.enable_eagle_speculation:
        return 0
    rows = spec.kv_cache_batch_size + spec.kv_cache_padding_size
    return rows * cache_slots(spec) * model.hidden_size * DTYPE_BYTES[spec.torch_dtype]


def eagle_weights_delta(draft: Draft) -> int:
    """Bytes an EAGLE draft holds beyond (or, negative, short of) its decoder's: `fc` added, norms dropped."""
    if not draft.spec.is_eagle_draft:
        return 0
    e, layers = draft.model.hidden_size, draft.model.num_layers
    added = 2 * e * e + (e if draft.fc_bias else 0)
    dropped = e + (0 if draft.spec.enable_eagle_draft_input_norm else layers * e)
    return (added - dropped) * DTYPE_BYTES[draft.spec.torch_dtype]


def load_for(model: ModelSpec, spec: NeuronSpec, draft: Draft | None = None) -> SpeculationLoad:
    """The speculation load of `spec` (a draft given without fused speculation is not used)."""
    fused = spec.enable_fused_speculation
    return SpeculationLoad(
        spare_slots=spec.speculation_length if fused else 0,
        draft=draft if fused else None,
        draft_not_counted=fused and draft is None,
        medusa_heads_bytes=medusa_heads_bytes(model, spec),
        hidden_cache_bytes=hidden_cache_bytes(model, spec),
    )


NOT_COUNTED = (
    "enable_fused_speculation: the draft model's weights and KV cache are not counted "
    "(give its config.json with --draft-model-path to count them)"
)
"""The plan's warning when the fused draft is not counted."""
