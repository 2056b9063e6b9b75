"""NxDI"s `models.gptj.modeling_gptj`: nxdi"s gptj classes (`nxdi.shell.models`)."""

from nxdi.shell.models import GPTJInferenceConfig, NeuronGPTJForCausalLM, NeuronGPTJModel

__all__ = ["GPTJInferenceConfig", "NeuronGPTJForCausalLM", "NeuronGPTJModel"]
