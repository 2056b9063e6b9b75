"""NxDI's `models.llama.modeling_llama`: nxdi's llama classes (`nxdi.shell.models`)."""

from nxdi.shell.models import LlamaInferenceConfig, LlamaNeuronConfig, NeuronLlamaForCausalLM, NeuronLlamaModel

__all__ = ["LlamaInferenceConfig", "LlamaNeuronConfig", "NeuronLlamaForCausalLM", "NeuronLlamaModel"]
