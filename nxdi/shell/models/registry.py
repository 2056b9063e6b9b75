"""MODEL_TYPES: the application classes by Hugging Face model_type and task, as serving clients look them up."""

from __future__ import annotations

from nxdi.shell.models.llama import LlamaInferenceConfig, NeuronLlamaForCausalLM
from nxdi.shell.models.mistral import MistralInferenceConfig, NeuronMistralForCausalLM
from nxdi.shell.models.qwen2 import NeuronQwen2ForCausalLM, Qwen2InferenceConfig
from nxdi.shell.models.qwen3 import NeuronQwen3ForCausalLM, Qwen3InferenceConfig

MODEL_TYPES: dict[str, dict[str, type]] = {
    "llama": {"causal-lm": NeuronLlamaForCausalLM},
    "mistral": {"causal-lm": NeuronMistralForCausalLM},
    "qwen2": {"causal-lm": NeuronQwen2ForCausalLM},
    "qwen3": {"causal-lm": NeuronQwen3ForCausalLM},
}
"""`MODEL_TYPES[model_type]["causal-lm"]` -> the application class."""

CONFIG_TYPES: dict[str, type] = {
    "llama": LlamaInferenceConfig,
    "mistral": MistralInferenceConfig,
    "qwen2": Qwen2InferenceConfig,
    "qwen3": Qwen3InferenceConfig,
}


def model_type_of(model_path: str) -> str:
    """The `model_type` in `model_path/config.json` (KeyError naming the supported types otherwise)."""
    import json
    from pathlib import Path

    config = Path(model_path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"--model-path: no config.json in {model_path!r}")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in MODEL_TYPES:
        raise KeyError(
            f"model_type {model_type!r} has no application class (supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    return str(model_type)
