"""A model family as one record: what nxdi knows about it, declared once. Pure.

A `FamilyRecord` holds everything family-specific: the Hugging Face `model_type`s it answers to,
how its ModelSpec is read from a HF config, its checkpoint layout (the weight table, the single
source of both the checkpoint mapping and the program's fields), which program runs it, the
InferenceConfig attributes it requires, and the names of its documented shell classes. The
registry (`nxdi.core.families`), the shell classes (`nxdi.shell.models`) and the package exports
are derived from the records, so a family is added by writing its record.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from nxdi.core.families.reader import ConfigReader
from nxdi.core.weight_table import WeightTable


class ProgramKind(enum.Enum):
    """The programs in `nxdi.core.programs` a family can run on (`nxdi.core.programs.catalog`)."""

    DECODER = "decoder"
    """The decoder-only transformer of `nxdi.core.programs.decoder`."""


@attrs.frozen(kw_only=True)
class ClassNames:
    """The documented shell classes of a family, by name (`nxdi.shell.models` makes them)."""

    inference_config: str
    """The InferenceConfig subclass, e.g. `LlamaInferenceConfig`."""
    causal_lm: str | None = None
    """The NeuronBaseForCausalLM subclass, e.g. `NeuronLlamaForCausalLM`; None while no program runs it."""
    neuron_config: str | None = None
    """A NeuronConfig subclass the family documents (`LlamaNeuronConfig`), if any."""
    inner_model: str | None = None
    """The inner model's name where NxDI does not derive it from `causal_lm` (`NeuronGemma3TextModel`)."""
    tnx: tuple[str, ...] = ()
    """Its transformers-neuronx classes (`LlamaForSampling`), which `nxdi.shell.tnx` makes."""

    @property
    def model(self) -> str | None:
        """The inner model class, named after `causal_lm` as NxDI names it (`NeuronLlamaForCausalLM`
        -> `NeuronLlamaModel`) unless `inner_model` says otherwise: what the causal LM's `_model_cls`
        holds. None without a causal LM."""
        if self.causal_lm is None:
            return None
        return self.inner_model or self.causal_lm.removesuffix("ForCausalLM") + "Model"


def _frozen_map(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return dict(value)


@attrs.frozen(kw_only=True)
class FamilyRecord:
    """Everything nxdi knows about one model family."""

    name: str
    """Short name (`llama`); also the name of the record's module."""
    model_types: tuple[str, ...]
    """Hugging Face `model_type` values this family reads (the first is the canonical one)."""
    read: Callable[[ConfigReader], dict[str, Any]]
    """ModelSpec fields from a HF config (the reader records every problem)."""
    required_attributes: tuple[str, ...] = ()
    """InferenceConfig attributes the family needs (`get_required_attributes`)."""
    derived_attributes: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_map, hash=False)
    """InferenceConfig attributes the family sets itself (`add_derived_config`), e.g. Qwen2's qkv_bias."""
    classes: ClassNames | None = None
    """Its documented shell classes; None for families that are only planned (no shell class yet)."""
    moe: bool = False
    """Its NeuronConfig is a MoENeuronConfig."""
    weights: WeightTable | None = None
    """Its checkpoint layout; None while no program runs it."""
    program: ProgramKind | None = None
    """The program that runs it on the engine; None when it can be planned but not run yet."""
    eagle: bool = True
    """An EAGLE draft of it can be built from its layers (False where they take learned positions or
    ALiBi, or another layout, which a draft's layers would have to follow)."""
    lora: bool = False
    """Multi-LoRA serving runs on it: PEFT adapters name its attention and MLP projections as the
    programs' q/k/v/o and gate/up/down (tested against PEFT for the Llama layout)."""
    tiny_config: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_map, hash=False)
    """Overrides that make a tiny valid HF config of this family (with the shared tiny sizes of
    `nxdi.testing.checkpoints`): what the family-parametrized tests build and compare."""

    @property
    def model_type(self) -> str:
        """The canonical HF model_type."""
        return self.model_types[0]

    @property
    def runnable(self) -> bool:
        """Whether the engine runs this family (it has a program and a weight table)."""
        return self.program is not None and self.weights is not None
