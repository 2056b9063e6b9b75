"""NxDI's `models` package: configuration, application bases, one package per model family."""
