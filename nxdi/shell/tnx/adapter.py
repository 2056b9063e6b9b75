"""`HuggingFaceGenerationModelAdapter(config, model)`: transformers' `generate()` on a transformers-neuronx model.

The transformers-neuronx signature over nxdi's `HuggingFaceGenerationAdapter` (which takes the
model alone): the same generate() loop, on the model's nxdi causal LM.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from nxdi.shell.tnx.model import SamplingModel


class HuggingFaceGenerationModelAdapter(HuggingFaceGenerationAdapter):
    """Wrap a `to_neuron()`-ed transformers-neuronx model so `generate()` works.

    Args:
        config: the checkpoint's transformers config (`AutoConfig.from_pretrained(path)`); its
            model_type must be the model's.
        model: a `*ForSampling` / `NeuronAutoModelForCausalLM` model after `to_neuron()`.

    Raises:
        IncompatibleConfigError: `model` is not a transformers-neuronx model, or `config` is of
            another model_type.
    """

    def __init__(self, config: PretrainedConfig, model: Any) -> None:
        if not isinstance(model, SamplingModel):
            raise IncompatibleConfigError(
                f"HuggingFaceGenerationModelAdapter(config, model): model is a {type(model).__name__}, not a "
                "transformers-neuronx model (LlamaForSampling, ...). For an nxdi causal LM use "
                "HuggingFaceGenerationAdapter(model)"
            )
        ours = model.config.hf_dict().get("model_type")
        theirs = getattr(config, "model_type", None)
        if theirs not in (None, ours):
            raise IncompatibleConfigError(
                f"HuggingFaceGenerationModelAdapter(config, model): config is a {theirs!r} config but the model is "
                f"{ours!r}. Fix: pass AutoConfig.from_pretrained(<the model's checkpoint folder>)"
            )
        super().__init__(model.nxdi_model)
        self.tnx_model = model

    def reset_generation(self) -> None:
        """Clear the KV cache (generate() also starts from an empty one)."""
        self.neuron_model.reset()
