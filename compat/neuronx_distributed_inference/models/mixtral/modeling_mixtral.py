"""NxDI's `models.mixtral.modeling_mixtral`: nxdi's mixtral classes (`nxdi.shell.models`)."""

from nxdi.shell.models import MixtralInferenceConfig, MixtralNeuronConfig, NeuronMixtralForCausalLM, NeuronMixtralModel

__all__ = ["MixtralInferenceConfig", "MixtralNeuronConfig", "NeuronMixtralForCausalLM", "NeuronMixtralModel"]
