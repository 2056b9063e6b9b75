"""A NeuronConfig's quantization settings as the weight plan and the quantizer take them. Pure.

`nxdi.core.weight_plan.weight_quant` is what loading reads (torch-free); `scheme` is
what `save_quantized_state_dict` quantizes with (`weights.QuantScheme`). Scales are always computed
and saved in float32, as the reference's observers produce them; `quantization_scale_dtype` is the
dtype the program holds them in after loading (the reference's scale parameters have that dtype).
"""

from __future__ import annotations

from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import ConfigError, Problem
from nxdi.core.host.quant import weights


def scheme(spec: NeuronSpec) -> Result[weights.QuantScheme, ConfigError]:
    """The scheme `save_quantized_state_dict` quantizes with (the ConfigError of `parse_quant_scheme`)."""
    return weights.parse_quant_scheme(
        quantization_type=spec.quantization_type,
        quantization_dtype=spec.quantization_dtype,
        quantization_block_axis=spec.quantization_block_axis,
        quantization_block_size=spec.quantization_block_size,
    )


def save_config(spec: NeuronSpec) -> Result[NeuronSpec, ConfigError]:
    """A config `save_quantized_state_dict` can write with: it names where to write."""
    if spec.quantized_checkpoints_path is None:
        fix = "set quantized_checkpoints_path to a folder (safetensors) or a file (torch pickle)"
        return Failure(ConfigError(problems=(Problem.missing("neuron_config.quantized_checkpoints_path", fix),)))
    return Success(spec)
