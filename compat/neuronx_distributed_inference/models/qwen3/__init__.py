"""NxDI's `models.qwen3` package."""
