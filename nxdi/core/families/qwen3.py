"""Qwen3: Llama with an RMSNorm over each head of q and k, an explicit head_dim, Qwen2's windows. Pure.

`qk_norm` adds `self_attn.q_norm.weight` / `k_norm.weight` [D], applied per head after the
projections and before RoPE; `head_dim` may differ from hidden_size / num_attention_heads, so the
attention output width H*D need not equal E.
"""

from __future__ import annotations

from nxdi.core.families.llama import LLAMA_WEIGHTS, REQUIRED, read_llama_like
from nxdi.core.families.qwen2 import read_windows
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind

RECORD = FamilyRecord(
    name="qwen3",
    model_types=("qwen3",),
    read=lambda r: read_llama_like(r, "qwen3", qk_norm=True, **read_windows(r)),
    required_attributes=(*REQUIRED, "head_dim"),
    classes=ClassNames(inference_config="Qwen3InferenceConfig", causal_lm="NeuronQwen3ForCausalLM"),
    weights=LLAMA_WEIGHTS,
    program=ProgramKind.DECODER,
    lora=True,
    tiny_config={"head_dim": 32, "use_sliding_window": False},
)
