"""Helpers for testing code that uses nxdi: hypothesis strategies and tiny checkpoints."""
