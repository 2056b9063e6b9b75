"""NxDI's `models.dbrx.modeling_dbrx`: nxdi's dbrx classes (`nxdi.shell.models`)."""

from nxdi.shell.models import DbrxInferenceConfig, DbrxNeuronConfig

__all__ = ["DbrxInferenceConfig", "DbrxNeuronConfig"]
