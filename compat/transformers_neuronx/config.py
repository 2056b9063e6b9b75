"""transformers-neuronx's `config`: NeuronConfig and its sub-configs (`nxdi.shell.tnx.config`)."""

from nxdi.shell.tnx.config import (
    GQA,
    ContinuousBatchingConfig,
    GenerationConfig,
    Layout,
    NeuronConfig,
    QuantizationConfig,
)

__all__ = ["GQA", "ContinuousBatchingConfig", "GenerationConfig", "Layout", "NeuronConfig", "QuantizationConfig"]
