"""NxDI's `models.gemma3.modeling_gemma3`: nxdi's gemma3 classes (`nxdi.shell.models`)."""

from nxdi.shell.models import Gemma3InferenceConfig, Gemma3NeuronConfig, NeuronGemma3ForCausalLM, NeuronGemma3TextModel

__all__ = ["Gemma3InferenceConfig", "Gemma3NeuronConfig", "NeuronGemma3ForCausalLM", "NeuronGemma3TextModel"]
