"""NxDI's `modules.generation.sampling`: the `[B, 3]` sampling_params helpers."""

from nxdi.shell.sampling_inputs import infer_sampling_params, prepare_sampling_params, validate_sampling_params

__all__ = ["infer_sampling_params", "prepare_sampling_params", "validate_sampling_params"]
