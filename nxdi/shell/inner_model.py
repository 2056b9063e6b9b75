"""The inner model of an application class (NxDI's `_model_cls`): a config bound to its program.

NxDI's application classes name, in `_model_cls`, the model they trace for each sub-model
(`NeuronLlamaForCausalLM._model_cls is NeuronLlamaModel`), and serving clients hand it on, e.g.
`FusedSpecNeuronConfig(Cls._model_cls, draft_config=...)` names the worker that runs the target
and draft models. nxdi traces pure programs (`nxdi.core.programs`), not torch modules, so its
inner model is that program bound to one configuration: `NeuronBaseModel(config)` holds the
config, its ModelSpec and the family's program, builds the program's weights value and runs its
forward pass. `nxdi.shell.models` makes one subclass per family with a causal LM
(`NeuronLlamaModel`, ...), which refuses a config of another family. Pure apart from the shell's
exceptions: nothing is read or written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from nxdi.core import families
from nxdi.core.errors import ConfigError
from nxdi.core.families.record import FamilyRecord
from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import catalog
from nxdi.core.programs.kv_cache import KVCache
from nxdi.shell.exceptions import exception_for, unwrap
from nxdi.shell.inference_config import InferenceConfig


def program_of(config: InferenceConfig) -> catalog.Program:
    """The program that runs `config`'s model.

    Raises:
        IncompatibleConfigError: the model is invalid, its family has no program yet, or the program
            lacks a feature the model uses (every problem listed).
    """
    model = config.model_spec()
    program = families.record_for(model.model_type).bind(lambda record: catalog.program_for(record, model))
    return unwrap(program, "This model cannot run on the CPU backend")


class NeuronBaseModel:
    """A configuration's model as nxdi runs it: its family's pure program and the ModelSpec it runs with.

    Args:
        config: the InferenceConfig (model attributes plus a NeuronConfig).

    Raises:
        IncompatibleConfigError: the config's model is invalid or no program runs it, or (a family's
            subclass) the config describes a model of another family.
    """

    _family: ClassVar[FamilyRecord | None] = None
    """The family a `nxdi.shell.models` subclass runs; None accepts every family with a program."""

    def __init__(self, config: InferenceConfig) -> None:
        self.config = config
        self.model_spec: ModelSpec = config.model_spec()
        family = self._family
        if family is not None and self.model_spec.model_type not in family.model_types:
            why = f"is not a {family.name} model"
            fix = f"use the inner model of the {self.model_spec.model_type} causal LM (its `_model_cls`)"
            error = ConfigError.of("model_type", self.model_spec.model_type, why, fix)
            raise exception_for(error, f"{type(self).__name__} cannot run this model")
        self.program: catalog.Program = program_of(config)

    def weights(self, tensors: Mapping[str, Tensor]) -> Any:
        """The program's weights value from converted tensors (as `get_state_dict` returns them)."""
        return self.program.weights(tensors, spec=self.model_spec)

    def forward(self, weights: Any, cache: KVCache, inputs: Any, **kwargs: Any) -> tuple[Tensor, KVCache]:
        """One step of the program: `forward(weights, cache, inputs, spec=model_spec, **kwargs)`.

        Returns the logits and the cache with this step's keys and values written (see the program's
        `forward`, e.g. `nxdi.core.programs.decoder.forward`); inputs are not mutated.
        """
        return self.program.forward(weights, cache, inputs, spec=self.model_spec, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_spec.model_type}, program={self.program.record.name})"
