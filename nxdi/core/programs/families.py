"""Which program runs which Hugging Face model_type, and whether a spec is within its reach. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.errors import ConfigError, Problem
from nxdi.core.model_spec import ModelSpec, NormKind, PositionKind
from nxdi.core.programs import decoder as llama
from nxdi.core.programs import mistral, qwen2, qwen3
from nxdi.core.programs.kv_cache import KVCache


@attrs.frozen(kw_only=True)
class Family:
    """A family's weights container and forward program."""

    model_type: str
    weights: type[llama.LlamaWeights]
    forward: Callable[..., tuple[Tensor, KVCache]]


FAMILIES: Mapping[str, Family] = {
    "llama": Family(model_type="llama", weights=llama.LlamaWeights, forward=llama.forward),
    "mistral": Family(model_type="mistral", weights=mistral.MistralWeights, forward=mistral.forward),
    "qwen2": Family(model_type="qwen2", weights=qwen2.Qwen2Weights, forward=qwen2.forward),
    "qwen3": Family(model_type="qwen3", weights=qwen3.Qwen3Weights, forward=qwen3.forward),
}
"""Programs by model_type."""


def family_for(spec: ModelSpec) -> Result[Family, ConfigError]:
    """The program for `spec`.

    Returns:
        `Success(Family)`, or `Failure(ConfigError)` when the model_type has no program, the
        architecture is not a dense RMSNorm/RoPE/gated-MLP decoder, or it asks for a Qwen sliding
        window (Hugging Face applies it to the layers from `max_window_layers` on, which ModelSpec
        does not record).
    """
    family = FAMILIES.get(spec.model_type)
    problems: list[Problem] = []
    if family is None:
        known = ", ".join(sorted(FAMILIES))
        problems.append(Problem.of("model_type", spec.model_type, f"has no CPU program yet (supported: {known})"))
    dense = not spec.is_moe and spec.gated_mlp and spec.norm is NormKind.RMS and spec.position is PositionKind.ROPE
    if not dense or spec.rope is None or spec.clip_qkv is not None:
        problems.append(Problem.of("model_type", spec.model_type, "is not a dense RMSNorm/RoPE/gated-MLP decoder"))
    if spec.model_type in ("qwen2", "qwen3") and spec.sliding_window is not None:
        why = "per-layer sliding windows (max_window_layers) are not supported"
        problems.append(Problem.of("sliding_window", spec.sliding_window, why, "set use_sliding_window=false"))
    if problems or family is None:
        return Failure(ConfigError(problems=tuple(problems)))
    return Success(family)
