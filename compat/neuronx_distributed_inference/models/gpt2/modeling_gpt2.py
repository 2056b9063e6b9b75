"""NxDI"s `models.gpt2.modeling_gpt2`: nxdi"s gpt2 classes (`nxdi.shell.models`)."""

from nxdi.shell.models import GPT2InferenceConfig, NeuronGPT2ForCausalLM, NeuronGPT2Model

__all__ = ["GPT2InferenceConfig", "NeuronGPT2ForCausalLM", "NeuronGPT2Model"]
