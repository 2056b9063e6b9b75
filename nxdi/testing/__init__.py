"""Helpers for testing code that uses nxdi: hypothesis strategies (`nxdi.testing.strategies`), tiny
random Hugging Face checkpoints (`checkpoints`), brief training for accuracy tests (`training`), and
Medusa heads: a reference module, their `medusa_heads.pt` file and brief training (`medusa`)."""
