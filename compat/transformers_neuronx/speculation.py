"""transformers-neuronx's `speculation` (`nxdi.shell.tnx.speculation`)."""

from nxdi.shell.tnx.speculation import SpeculativeGenerator

__all__ = ["SpeculativeGenerator"]
