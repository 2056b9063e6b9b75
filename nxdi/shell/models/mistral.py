"""Mistral: MistralInferenceConfig (Llama attributes plus an optional sliding window)."""

from __future__ import annotations

from nxdi.shell.models.llama import LlamaInferenceConfig


class MistralInferenceConfig(LlamaInferenceConfig):
    """Mistral model attributes plus a NeuronConfig."""

    _model_type = "mistral"
