"""Helpers for testing code that uses nxdi: hypothesis strategies (`nxdi.testing.strategies`), tiny
random Hugging Face checkpoints (`checkpoints`), and brief training for accuracy tests (`training`)."""
