"""NxDI"s `models.gpt_neox.modeling_gpt_neox`: nxdi"s gpt_neox classes (`nxdi.shell.models`)."""

from nxdi.shell.models import GPTNeoXInferenceConfig, NeuronGPTNeoXForCausalLM, NeuronGPTNeoXModel

__all__ = ["GPTNeoXInferenceConfig", "NeuronGPTNeoXForCausalLM", "NeuronGPTNeoXModel"]
