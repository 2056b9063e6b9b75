"""NxDI's `models.mistral.modeling_mistral`: nxdi's mistral classes (`nxdi.shell.models`)."""

from nxdi.shell.models import MistralInferenceConfig, NeuronMistralForCausalLM, NeuronMistralModel

__all__ = ["MistralInferenceConfig", "NeuronMistralForCausalLM", "NeuronMistralModel"]
