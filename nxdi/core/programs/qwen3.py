"""Qwen3: the Llama program with RMSNorm over each head of q and k, and an explicit head_dim. Pure.

`ModelSpec.qk_norm` adds `self_attn.q_norm.weight` / `k_norm.weight` [D], applied per head after
the projections and before RoPE; `head_dim` may differ from hidden_size / num_attention_heads, so
the attention output width H*D need not equal E.
"""

from __future__ import annotations

from nxdi.core.programs import decoder as llama

Qwen3Weights = llama.LlamaWeights
forward = llama.forward
