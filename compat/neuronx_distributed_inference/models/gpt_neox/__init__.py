"""NxDI's `models.gpt_neox` package."""
