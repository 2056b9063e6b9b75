"""The transformers-neuronx API on the nxdi engine (import from here instead of `transformers_neuronx`).

    from nxdi.shell.tnx import LlamaForSampling, NeuronAutoModelForCausalLM, NeuronConfig, GQA
    from nxdi.shell.tnx.config import GenerationConfig
    from nxdi.shell.tnx.stopping_criteria import StoppingCriteria, StoppingCriteriaList

Each name loads its module on first use (importing this package does no work). The family classes
(`LlamaForSampling`, ..., `GPT2ForSamplingWithContextBroadcasting`) come from the family records
(`nxdi.shell.tnx.families`). README: "Migrating from transformers-neuronx".
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "NeuronAutoModelForCausalLM": "nxdi.shell.tnx.model",
    "SamplingModel": "nxdi.shell.tnx.model",
    "NeuronConfig": "nxdi.shell.tnx.config",
    "GQA": "nxdi.shell.tnx.config",
    "Layout": "nxdi.shell.tnx.config",
    "QuantizationConfig": "nxdi.shell.tnx.config",
    "ContinuousBatchingConfig": "nxdi.shell.tnx.config",
    "GenerationConfig": "nxdi.shell.tnx.config",
    "HuggingFaceGenerationModelAdapter": "nxdi.shell.tnx.adapter",
}


def _family_classes() -> dict[str, tuple[str, ...]]:
    # imported here, not above: it imports torch and the engine, which importing this package must not
    names: dict[str, tuple[str, ...]] = importlib.import_module("nxdi.shell.tnx.families").class_names()
    return names


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    # Classes are CapWords; a lowercase name is a submodule (`from nxdi.shell.tnx import loop`), which
    # Python imports after this AttributeError, without the family classes (that would import it first).
    if module is None and name[:1].isupper() and name in _family_classes():
        module = "nxdi.shell.tnx.families"
    if module is None:
        raise AttributeError(f"module 'nxdi.shell.tnx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_family_classes()})
