"""NxDI's `models.qwen3_moe.modeling_qwen3_moe`: nxdi's qwen3_moe classes (`nxdi.shell.models`)."""

from nxdi.shell.models import NeuronQwen3MoeForCausalLM, NeuronQwen3MoeModel, Qwen3MoeInferenceConfig

__all__ = ["NeuronQwen3MoeForCausalLM", "NeuronQwen3MoeModel", "Qwen3MoeInferenceConfig"]
