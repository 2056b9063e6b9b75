"""NxDI's `models.qwen3.modeling_qwen3`: nxdi's qwen3 classes (`nxdi.shell.models`)."""

from nxdi.shell.models import NeuronQwen3ForCausalLM, NeuronQwen3Model, Qwen3InferenceConfig

__all__ = ["NeuronQwen3ForCausalLM", "NeuronQwen3Model", "Qwen3InferenceConfig"]
