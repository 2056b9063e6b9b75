"""NxDI's `models.mistral` package."""
