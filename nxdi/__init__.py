"""nxdi: LLM inference for AWS Trainium and Inferentia, with a CPU backend that matches transformers.

The documented classes are importable from here. Importing does no work: each name is loaded from
its shell module on first use (so `nxdi plan` never imports torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "NeuronConfig": "nxdi.shell.config",
    "MoENeuronConfig": "nxdi.shell.config",
    "OnDeviceSamplingConfig": "nxdi.shell.config",
    "LoraServingConfig": "nxdi.shell.config",
    "ChunkedPrefillConfig": "nxdi.shell.config",
    "InferenceConfig": "nxdi.shell.inference_config",
    "FusedSpecNeuronConfig": "nxdi.shell.inference_config",
    "load_pretrained_config": "nxdi.shell.inference_config",
    "IncompatibleConfigError": "nxdi.shell.exceptions",
    "MissingAttributesError": "nxdi.shell.exceptions",
    "CheckpointValidationError": "nxdi.shell.exceptions",
    "LlamaInferenceConfig": "nxdi.shell.models.llama",
    "LlamaNeuronConfig": "nxdi.shell.models.llama",
    "MistralInferenceConfig": "nxdi.shell.models.mistral",
    "Qwen2InferenceConfig": "nxdi.shell.models.qwen2",
    "Qwen3InferenceConfig": "nxdi.shell.models.qwen3",
    "MixtralInferenceConfig": "nxdi.shell.models.mixtral",
    "MixtralNeuronConfig": "nxdi.shell.models.mixtral",
    "DbrxInferenceConfig": "nxdi.shell.models.dbrx",
    "DbrxNeuronConfig": "nxdi.shell.models.dbrx",
    "NeuronApplicationBase": "nxdi.shell.application",
    "NeuronBaseForCausalLM": "nxdi.shell.causal_lm",
    "prepare_sampling_params": "nxdi.shell.causal_lm",
    "NeuronLlamaForCausalLM": "nxdi.shell.models.llama",
    "NeuronMistralForCausalLM": "nxdi.shell.models.mistral",
    "NeuronQwen2ForCausalLM": "nxdi.shell.models.qwen2",
    "NeuronQwen3ForCausalLM": "nxdi.shell.models.qwen3",
    "MODEL_TYPES": "nxdi.shell.models.registry",
    "HuggingFaceGenerationAdapter": "nxdi.shell.generation",
    "check_accuracy": "nxdi.shell.accuracy",
    "check_accuracy_logits": "nxdi.shell.accuracy",
    "LogitMatchingValidationError": "nxdi.shell.exceptions",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nxdi' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
