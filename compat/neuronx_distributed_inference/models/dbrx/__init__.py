"""NxDI's `models.dbrx` package."""
