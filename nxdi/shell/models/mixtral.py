"""Mixtral: MixtralInferenceConfig with a MoENeuronConfig."""

from __future__ import annotations

from nxdi.shell.config import MoENeuronConfig, NeuronConfig
from nxdi.shell.models.llama import LLAMA_REQUIRED, LlamaInferenceConfig


class MixtralNeuronConfig(MoENeuronConfig):
    """MoENeuronConfig for Mixtral models."""


class MixtralInferenceConfig(LlamaInferenceConfig):
    """Mixtral model attributes plus a MoENeuronConfig."""

    _model_type = "mixtral"

    def get_required_attributes(self) -> list[str]:
        return [*LLAMA_REQUIRED, "num_local_experts", "num_experts_per_tok"]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return MixtralNeuronConfig
