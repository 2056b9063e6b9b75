"""Qwen2: Qwen2InferenceConfig (Llama attributes; q/k/v projections carry a bias)."""

from __future__ import annotations

from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.inference_config import InferenceConfig
from nxdi.shell.models.llama import LlamaInferenceConfig


class Qwen2InferenceConfig(LlamaInferenceConfig):
    """Qwen2 model attributes plus a NeuronConfig; derives qkv_bias=True and o_bias=False."""

    _model_type = "qwen2"

    def add_derived_config(self) -> None:
        super().add_derived_config()
        self.qkv_bias = True
        self.o_bias = False


class NeuronQwen2ForCausalLM(NeuronBaseForCausalLM):
    """Qwen2 causal LM (the dense decoder program in nxdi.core.programs)."""

    _model_cls = "qwen2"

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen2InferenceConfig
