"""NxDI's `models.qwen2.modeling_qwen2`: nxdi's qwen2 classes (`nxdi.shell.models`)."""

from nxdi.shell.models import NeuronQwen2ForCausalLM, NeuronQwen2Model, Qwen2InferenceConfig

__all__ = ["NeuronQwen2ForCausalLM", "NeuronQwen2Model", "Qwen2InferenceConfig"]
