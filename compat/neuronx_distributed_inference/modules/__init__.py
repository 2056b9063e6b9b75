"""NxDI's `modules` package: padding, sampling helpers, LoRA serving."""
