"""NxDI's `models.mixtral` package."""
