"""NxDI's `models.dbrx.modeling_dbrx`: nxdi's dbrx classes (`nxdi.shell.models`)."""

from nxdi.shell.models import DbrxInferenceConfig, DbrxNeuronConfig, NeuronDbrxForCausalLM, NeuronDbrxModel

__all__ = ["DbrxInferenceConfig", "DbrxNeuronConfig", "NeuronDbrxForCausalLM", "NeuronDbrxModel"]
