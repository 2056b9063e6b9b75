"""The EAGLE (v1) draft's checkpoint layout: its family's weight table, changed as NxDI's draft is. Pure.

An EAGLE draft checkpoint is a folder with a `config.json` (a LlamaConfig with the draft's own
`num_hidden_layers`, often 1, and optionally `fc_bias`) and safetensors holding, as the EAGLE
project ships them, `embed_tokens.weight`, `fc.weight` [E, 2E] (and `fc.bias` [E] with
`fc_bias`), `layers.{i}.*` and `lm_head.weight`, the target's: the EAGLE project's checkpoints
lack it and the feature guide shows copying it in. Keys may also carry the `model.` prefix of a
Hugging Face Llama checkpoint; the weight plan strips it either way (`weight_plan.rename_key`).

Rules (NxDI's `is_eagle_draft`):
- `fc` is added; it maps `[embedding; previous hidden state]` (2E) to the layers' input (E).
- The final norm (`norm.weight`) is dropped: the lm_head reads the last layer's output as it is.
- Every layer's input norm (`layers.{i}.input_layernorm.weight`) is dropped unless
  `enable_eagle_draft_input_norm`; with it, every layer has one. (The EAGLE project's drafts drop
  only the first layer's; NxDI drops all, and the two agree for the usual one-layer draft.)

`EagleDraft.table` derives the draft's table from the family's, so the plan, the program's slots
and the checks all read one layout. `explain` turns the checkpoint check's generic problems with
those tensors into what an EAGLE user needs to hear (copy the target's lm_head, set fc_bias, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from nxdi.core.errors import Problem
from nxdi.core.weight_table import WeightTable, copy

FC = "fc.weight"
FC_BIAS = "fc.bias"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "norm.weight"
INPUT_NORM_SLOT = "input_norm"
"""The layer slot of the input norm (`layers.{i}.input_layernorm.weight` in a Llama table)."""
FINAL_NORM_SLOT = "norm"
MISSING = "<missing>"
"""The value a problem about an absent tensor shows (`Problem.missing`)."""


@attrs.frozen(kw_only=True)
class EagleDraft:
    """How an EAGLE draft's checkpoint differs from its family's (see the module rules)."""

    input_norm: bool = False
    """`enable_eagle_draft_input_norm`: every layer keeps its input norm."""
    fc_bias: bool = False
    """The draft config's `fc_bias` attribute: `fc` has a bias [E]."""

    def table(self, base: WeightTable) -> WeightTable:
        """The draft's weight table: `base` with `fc` (and `fc.bias`) before the layers, without the
        final norm, and without the layers' input norms unless `input_norm`."""
        fc = (copy("fc", FC, ("E", "2E"), linear=True),)
        bias = (copy("fc_bias", FC_BIAS, ("E",)),) if self.fc_bias else ()
        layer = tuple(w for w in base.layer if self.input_norm or w.slot != INPUT_NORM_SLOT)
        after = tuple(w for w in base.after if w.slot != FINAL_NORM_SLOT)
        return attrs.evolve(base, before=(*base.before, *fc, *bias), layer=layer, after=after)


def eagle_draft_for(*, is_eagle_draft: bool, input_norm: bool, fc_bias: bool) -> EagleDraft | None:
    """The layout of a model whose NeuronConfig says `is_eagle_draft` (None for any other model)."""
    return EagleDraft(input_norm=input_norm, fc_bias=fc_bias) if is_eagle_draft else None


def _input_norm_key(name: str) -> bool:
    return name.startswith("layers.") and name.endswith(".input_layernorm.weight")


def _explained(p: Problem, name: str) -> Problem:
    """`p` (about the tensor renamed `name`) with the EAGLE-specific reason and fix, when there is one."""
    missing = p.value == MISSING
    if name == LM_HEAD and missing:
        why = "is required but missing: an EAGLE draft predicts with its target's lm_head, which EAGLE checkpoints lack"
        fix = "copy the target's lm_head.weight into the draft checkpoint, as the feature guide's EAGLE section shows"
        return attrs.evolve(p, reason=why, fix=fix)
    if name == FC and missing:
        why = "is required but missing: an EAGLE draft's fc maps [embedding; hidden state] to its layers' input"
        return attrs.evolve(p, reason=why, fix="point the draft path at an EAGLE draft checkpoint")
    if name == FC and "expected" in p.reason:
        why = f"{p.reason}: an EAGLE (v1) draft's fc is [hidden_size, 2 * hidden_size]"
        fix = (
            "check hidden_size in the draft's config.json (an EAGLE-3 draft's fc is [E, 3E]; EAGLE-3 is not supported)"
        )
        return attrs.evolve(p, reason=why, fix=fix)
    if name == FC_BIAS:
        on = "True" if not missing else "False"
        return attrs.evolve(p, fix=f"set fc_bias={on} in the draft's config.json, as the checkpoint was trained")
    if _input_norm_key(name) and not missing:
        why = "is not read: the draft runs without input norms (enable_eagle_draft_input_norm=False)"
        return attrs.evolve(
            p, reason=why, fix="set enable_eagle_draft_input_norm=True if the draft was trained with it"
        )
    if _input_norm_key(name):
        fix = "set enable_eagle_draft_input_norm=False if the draft was trained without input normalization"
        return attrs.evolve(p, fix=fix)
    if name == FINAL_NORM and not missing:
        why = "is not read: an EAGLE (v1) draft has no final norm"
        return attrs.evolve(p, reason=why, fix="remove it (EAGLE-3 drafts, which have one, are not supported)")
    return p


def explain(problems: Iterable[Problem], rename: Callable[[str], str]) -> tuple[Problem, ...]:
    """The checkpoint check's `problems` (fields are stored keys; `rename` gives their nxdi names),
    with EAGLE-specific reasons and fixes for the tensors an EAGLE draft adds, drops or borrows."""
    return tuple(_explained(p, rename(p.field)) for p in problems)
