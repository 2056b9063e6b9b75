"""transformers-neuronx's `stopping_criteria` (`nxdi.shell.tnx.stopping_criteria`)."""

from nxdi.shell.tnx.stopping_criteria import StoppingCriteria, StoppingCriteriaList

__all__ = ["StoppingCriteria", "StoppingCriteriaList"]
