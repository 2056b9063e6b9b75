"""NxDI's `models.gptj` package."""
