"""NxDI's `models.bloom` package."""
