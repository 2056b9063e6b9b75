"""NxDI's `models.model_base`: the causal LM base and the inner model base (`_model_cls`)."""

from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.inner_model import NeuronBaseModel

__all__ = ["NeuronBaseForCausalLM", "NeuronBaseModel"]
