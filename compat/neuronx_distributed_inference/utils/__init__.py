"""NxDI's `utils` package."""
