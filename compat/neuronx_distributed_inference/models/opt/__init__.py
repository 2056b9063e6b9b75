"""NxDI's `models.opt` package."""
