"""NxDI's `modules.generation` package."""
