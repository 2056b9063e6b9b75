"""NxDI"s `models.bloom.modeling_bloom`: nxdi"s bloom classes (`nxdi.shell.models`)."""

from nxdi.shell.models import BloomInferenceConfig, NeuronBloomForCausalLM, NeuronBloomModel

__all__ = ["BloomInferenceConfig", "NeuronBloomForCausalLM", "NeuronBloomModel"]
