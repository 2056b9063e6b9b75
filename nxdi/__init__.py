"""nxdi: LLM inference for AWS Trainium and Inferentia, with a CPU backend that matches transformers.

The documented classes are importable from here, the model classes of every family record
(`NeuronLlamaForCausalLM`, `LlamaInferenceConfig`, ...) included. Importing does no work: each name
is loaded from its shell module on first use (so `nxdi plan` never imports torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from nxdi.core import families

_EXPORTS: dict[str, str] = {
    "NeuronConfig": "nxdi.shell.config",
    "MoENeuronConfig": "nxdi.shell.config",
    "OnDeviceSamplingConfig": "nxdi.shell.config",
    "LoraServingConfig": "nxdi.shell.config",
    "ChunkedPrefillConfig": "nxdi.shell.config",
    "RouterConfig": "nxdi.shell.config",
    "HybridShardingConfig": "nxdi.shell.config",
    "InferenceConfig": "nxdi.shell.inference_config",
    "FusedSpecNeuronConfig": "nxdi.shell.inference_config",
    "load_pretrained_config": "nxdi.shell.inference_config",
    "IncompatibleConfigError": "nxdi.shell.exceptions",
    "MissingAttributesError": "nxdi.shell.exceptions",
    "CheckpointValidationError": "nxdi.shell.exceptions",
    "ArtifactIntegrityError": "nxdi.shell.exceptions",
    "RankError": "nxdi.shell.exceptions",
    "FolderLockedError": "nxdi.shell.exceptions",
    "NeuronApplicationBase": "nxdi.shell.application",
    "NeuronBaseForCausalLM": "nxdi.shell.causal_lm",
    "prepare_sampling_params": "nxdi.shell.causal_lm",
    "MODEL_TYPES": "nxdi.shell.models",
    "HuggingFaceGenerationAdapter": "nxdi.shell.generation",
    "check_accuracy": "nxdi.shell.accuracy",
    "check_accuracy_logits": "nxdi.shell.accuracy",
    "LogitMatchingValidationError": "nxdi.shell.exceptions",
}

_FAMILY_CLASSES: frozenset[str] = frozenset(families.class_names())
"""The model classes `nxdi.shell.models` makes from the family records."""

__all__ = sorted({*_EXPORTS, *_FAMILY_CLASSES})


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name) or ("nxdi.shell.models" if name in _FAMILY_CLASSES else None)
    if module is None:
        raise AttributeError(f"module 'nxdi' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
