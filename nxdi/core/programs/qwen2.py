"""Qwen2: the Llama program with biases on the q, k and v projections. Pure.

`ModelSpec.qkv_bias` is True and `o_bias` False for every Qwen2 checkpoint; with `fused_qkv` the
three biases are fused into `Wqkv.bias` like the weights. Qwen2's optional sliding window (only for
layers from `max_window_layers` on) is refused by `nxdi.core.programs.families.family_for`.
"""

from __future__ import annotations

from nxdi.core.programs import decoder as llama

Qwen2Weights = llama.LlamaWeights
forward = llama.forward
