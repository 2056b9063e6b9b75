"""NxDI"s `models.opt.modeling_opt`: nxdi"s opt classes (`nxdi.shell.models`)."""

from nxdi.shell.models import NeuronOPTForCausalLM, NeuronOPTModel, OPTInferenceConfig

__all__ = ["NeuronOPTForCausalLM", "NeuronOPTModel", "OPTInferenceConfig"]
