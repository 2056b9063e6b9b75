"""NxDI's `utils.hf_adapter`: the Hugging Face config hook and the generate() adapter."""

from nxdi.shell.generation import HuggingFaceGenerationAdapter
from nxdi.shell.inference_config import load_pretrained_config

__all__ = ["HuggingFaceGenerationAdapter", "load_pretrained_config"]
