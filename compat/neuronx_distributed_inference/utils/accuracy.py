"""NxDI's `utils.accuracy`: token and logit accuracy checks against the Hugging Face model."""

from nxdi.shell.accuracy import check_accuracy, check_accuracy_logits

__all__ = ["check_accuracy", "check_accuracy_logits"]
