"""NxDI's `models.gemma3` package."""
