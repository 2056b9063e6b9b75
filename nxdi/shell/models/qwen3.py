"""Qwen3: Qwen3InferenceConfig (Llama attributes plus an explicit head_dim and q/k norms)."""

from __future__ import annotations

from nxdi.shell.models.llama import LLAMA_REQUIRED, LlamaInferenceConfig


class Qwen3InferenceConfig(LlamaInferenceConfig):
    """Qwen3 model attributes plus a NeuronConfig."""

    _model_type = "qwen3"

    def get_required_attributes(self) -> list[str]:
        return [*LLAMA_REQUIRED, "head_dim"]
