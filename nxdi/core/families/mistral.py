"""Mistral: Llama with a sliding window in every layer. Pure.

A query at position p attends to positions `p - window < t <= p` (Hugging Face's sliding-window
causal mask); the program keeps the whole cache, so the window is a mask, not a rolling cache.
"""

from __future__ import annotations

from nxdi.core.families.llama import LLAMA_WEIGHTS, REQUIRED, read_llama_like
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind

RECORD = FamilyRecord(
    name="mistral",
    model_types=("mistral",),
    read=lambda r: read_llama_like(r, "mistral", sliding_window=r.opt_int("sliding_window")),
    required_attributes=REQUIRED,
    classes=ClassNames(
        inference_config="MistralInferenceConfig", causal_lm="NeuronMistralForCausalLM", tnx=("MistralForSampling",)
    ),
    weights=LLAMA_WEIGHTS,
    program=ProgramKind.DECODER,
    lora=True,
    tiny_config={"sliding_window": 8},
)
