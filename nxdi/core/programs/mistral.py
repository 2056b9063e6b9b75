"""Mistral: the Llama program with sliding-window attention. Pure.

The only difference from Llama is `ModelSpec.sliding_window`: a query at position p attends to
slots `p - window < t <= p` (Hugging Face's sliding-window causal mask), applied in every layer.
The cache keeps all positions; a rolling window-sized cache would be a KV-layout choice, not a
change of this program.
"""

from __future__ import annotations

from nxdi.core.programs import decoder as llama

MistralWeights = llama.LlamaWeights
forward = llama.forward
