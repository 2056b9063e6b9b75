"""NxDI's `modules.lora_serving`: the multi-LoRA serving config and the adapters' checkpoint reader."""

from nxdi.shell.lora_serving import LoraCheckpoint, LoraServingConfig

__all__ = ["LoraCheckpoint", "LoraServingConfig"]
