"""NxDI's `utils.accuracy`: token and logit accuracy checks against the Hugging Face model, and
generation from text prompts (`get_generate_outputs`)."""

from nxdi.shell.accuracy import (
    check_accuracy,
    check_accuracy_logits,
    get_generate_outputs,
    get_generate_outputs_from_token_ids,
)

__all__ = ["check_accuracy", "check_accuracy_logits", "get_generate_outputs", "get_generate_outputs_from_token_ids"]
