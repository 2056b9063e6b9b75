"""Llama: LlamaInferenceConfig and LlamaNeuronConfig (the model class binds core/programs/llama)."""

from __future__ import annotations

from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.config import NeuronConfig
from nxdi.shell.inference_config import InferenceConfig

LLAMA_REQUIRED = [
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "pad_token_id",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "hidden_act",
]


class LlamaNeuronConfig(NeuronConfig):
    """NeuronConfig for Llama models (same attributes)."""


class LlamaInferenceConfig(InferenceConfig):
    """Llama model attributes plus a NeuronConfig."""

    _model_type = "llama"

    def add_derived_config(self) -> None:
        """Flash decoding groups (`min(tp, heads) / kv_heads` cores per KV group) and hidden padding."""
        spec = self.neuron_config.spec
        self.num_cores_per_group = 1
        if spec.flash_decoding_enabled:
            heads, kv = self.num_attention_heads, self.num_key_value_heads
            self.num_cores_per_group = max(1, min(spec.tp_degree, heads) // kv)
        if spec.padded_hidden_size is not None and not hasattr(self, "original_hidden_size"):
            self.original_hidden_size = self.hidden_size
            self.hidden_size = spec.padded_hidden_size

    def get_required_attributes(self) -> list[str]:
        return list(LLAMA_REQUIRED)

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return LlamaNeuronConfig


class NeuronLlamaForCausalLM(NeuronBaseForCausalLM):
    """Llama causal LM (the dense decoder program in nxdi.core.programs)."""

    _model_cls = "llama"

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return LlamaInferenceConfig
