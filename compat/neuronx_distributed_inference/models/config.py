"""NxDI's `models.config`: the configuration classes."""

from nxdi.shell.config import (
    ChunkedPrefillConfig,
    HybridShardingConfig,
    MoENeuronConfig,
    NeuronConfig,
    OnDeviceSamplingConfig,
    RouterConfig,
    to_torch_dtype,
)
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.inference_config import FusedSpecNeuronConfig, InferenceConfig
from nxdi.shell.lora_serving import LoraServingConfig

__all__ = [
    "ChunkedPrefillConfig",
    "FusedSpecNeuronConfig",
    "HybridShardingConfig",
    "IncompatibleConfigError",
    "InferenceConfig",
    "LoraServingConfig",
    "MoENeuronConfig",
    "NeuronConfig",
    "OnDeviceSamplingConfig",
    "RouterConfig",
    "to_torch_dtype",
]
