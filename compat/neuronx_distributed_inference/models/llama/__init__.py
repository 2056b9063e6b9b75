"""NxDI's `models.llama` package."""
