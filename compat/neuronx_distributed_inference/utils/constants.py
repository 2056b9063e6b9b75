"""NxDI's `utils.constants`: `MODEL_TYPES[model_type]["causal-lm"]` -> the application class."""

from nxdi.shell.models import MODEL_TYPES

__all__ = ["MODEL_TYPES"]
