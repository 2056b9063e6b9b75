"""NxDI's `models.qwen2` package."""
