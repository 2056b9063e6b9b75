"""NxDI's `models.gpt2` package."""
