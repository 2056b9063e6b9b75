"""transformers-neuronx's top-level names on nxdi (`nxdi.shell.tnx`). Re-exports only.

`from transformers_neuronx import LlamaForSampling, NeuronConfig, GQA, ...` imports nxdi's classes, so
the transformers-neuronx guide's code runs on nxdi's engine unmodified.
"""

from nxdi.shell.tnx.adapter import HuggingFaceGenerationModelAdapter
from nxdi.shell.tnx.config import (
    GQA,
    ContinuousBatchingConfig,
    GenerationConfig,
    Layout,
    NeuronConfig,
    QuantizationConfig,
)
from nxdi.shell.tnx.families import (
    BloomForSampling,
    GPT2ForSampling,
    GPT2ForSamplingWithContextBeforeAfter,
    GPT2ForSamplingWithContextBroadcasting,
    GPTJForSampling,
    GPTNeoXForSampling,
    LlamaForSampling,
    MistralForSampling,
    MixtralForSampling,
    OPTForSampling,
)
from nxdi.shell.tnx.model import NeuronAutoModelForCausalLM

__all__ = [
    "GQA",
    "BloomForSampling",
    "ContinuousBatchingConfig",
    "GPT2ForSampling",
    "GPT2ForSamplingWithContextBeforeAfter",
    "GPT2ForSamplingWithContextBroadcasting",
    "GPTJForSampling",
    "GPTNeoXForSampling",
    "GenerationConfig",
    "HuggingFaceGenerationModelAdapter",
    "Layout",
    "LlamaForSampling",
    "MistralForSampling",
    "MixtralForSampling",
    "NeuronAutoModelForCausalLM",
    "NeuronConfig",
    "OPTForSampling",
    "QuantizationConfig",
]
