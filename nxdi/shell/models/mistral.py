"""Mistral: MistralInferenceConfig (Llama attributes plus an optional sliding window)."""

from __future__ import annotations

from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.inference_config import InferenceConfig
from nxdi.shell.models.llama import LlamaInferenceConfig


class MistralInferenceConfig(LlamaInferenceConfig):
    """Mistral model attributes plus a NeuronConfig."""

    _model_type = "mistral"


class NeuronMistralForCausalLM(NeuronBaseForCausalLM):
    """Mistral causal LM (the dense decoder program in nxdi.core.programs)."""

    _model_cls = "mistral"

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return MistralInferenceConfig
