"""Qwen3: Qwen3InferenceConfig (Llama attributes plus an explicit head_dim and q/k norms)."""

from __future__ import annotations

from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.inference_config import InferenceConfig
from nxdi.shell.models.llama import LLAMA_REQUIRED, LlamaInferenceConfig


class Qwen3InferenceConfig(LlamaInferenceConfig):
    """Qwen3 model attributes plus a NeuronConfig."""

    _model_type = "qwen3"

    def get_required_attributes(self) -> list[str]:
        return [*LLAMA_REQUIRED, "head_dim"]


class NeuronQwen3ForCausalLM(NeuronBaseForCausalLM):
    """Qwen3 causal LM (the dense decoder program in nxdi.core.programs)."""

    _model_cls = "qwen3"

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen3InferenceConfig
